"""Real vLLM servers for the engine tests, shared across tests: one per (checkpoint, K), a few alive at once.

Servers start lazily through mtpquant's own launcher (``mtpquant.engine.launch``) from the engine
environment ``tests/support/vllm_env.py`` builds; the least recently used one is stopped when a new one
would exceed ``max_alive`` (each CPU server holds a couple of GB). Logs land in the session's temp dir.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.launch import EngineProcess, free_port, server_args
from mtpquant.engine.server import ServerInfo
from mtpquant.engine.sizing import plan_engine_memory, probe_machine
from mtpquant.engine.vllm import VllmClient
from mtpquant.errors import EngineStartError

__all__ = ["CONCURRENCY", "CPU_ENV", "EnginePool", "RunningServer", "engine_acceptance", "prompt_ids"]

# The servers' environment: nothing about memory (mtpquant sizes it, engine/sizing.py), no tokenizer threads.
CPU_ENV = {"TOKENIZERS_PARALLELISM": "false"}
MAX_LEN = 256  # the longest sequences the tests send
CONCURRENCY = 8  # the most requests a test keeps in flight at once (validate --concurrency)


@dataclass
class RunningServer:
    """A started server, its client and the model name it serves."""

    server: EngineProcess
    client: VllmClient
    info: ServerInfo
    model: str
    started_s: float


@dataclass
class EnginePool:
    """Lazily started vLLM servers keyed by (checkpoint, K); K None means no speculative decoding."""

    python: Path
    logs: Path
    max_alive: int = 2
    alive: OrderedDict[tuple[str, int | None], RunningServer] = field(default_factory=OrderedDict)
    startup_seconds: list[float] = field(default_factory=list)

    def _server(self, checkpoint: Path, k: int | None) -> EngineProcess:
        port = free_port()
        name = f"{checkpoint.name}-k{k}-{port}.log"
        memory = plan_engine_memory(
            "vllm",
            Checkpoint.open(checkpoint).spec,
            0,
            max_len=MAX_LEN,
            k=k or 0,
            machine=probe_machine(cpu=True),
            sequences=CONCURRENCY,
        )
        args = server_args("vllm", str(checkpoint), port, k=k, cpu=True, memory=memory.args())
        return EngineProcess("vllm", self.python, args, self.logs / name, port=port, startup_timeout=300, env=CPU_ENV)

    def get(self, checkpoint: Path, k: int | None) -> RunningServer:
        """A running server for ``checkpoint`` with ``k`` MTP drafts (started if needed)."""
        key = (str(checkpoint), k)
        if key in self.alive:
            self.alive.move_to_end(key)
            return self.alive[key]
        while len(self.alive) >= self.max_alive:
            _, old = self.alive.popitem(last=False)
            old.server.stop()
        server = self._server(checkpoint, k)
        t0 = time.monotonic()
        server.start()
        self.startup_seconds.append(time.monotonic() - t0)
        client = VllmClient(server.url)
        running = RunningServer(server, client, client.info(), str(checkpoint), self.startup_seconds[-1])
        self.alive[key] = running
        return running

    def start_failure(self, checkpoint: Path, k: int | None) -> EngineStartError:
        """The error of a server that must fail to start (it is stopped either way)."""
        server = self._server(checkpoint, k)
        try:
            server.start()
        except EngineStartError as exc:
            return exc
        server.stop()
        raise AssertionError(f"vLLM started {checkpoint} (k={k}), which was expected to fail")

    def close(self) -> None:
        """Stop every server."""
        while self.alive:
            _, running = self.alive.popitem()
            running.server.stop()


def prompt_ids(checkpoint: Path, n: int, max_len: int = 96) -> tuple[list[list[int]], list[int]]:
    """The built-in validate path's first ``n`` default prompts as token ids (prompt <= half of ``max_len``),
    and how many tokens to generate for each (the rest of ``max_len``), as ``validate`` uses them."""
    from tokenizers import Tokenizer

    from mtpquant.text.prompts import default_prompts

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ids = [tok.encode(p, add_special_tokens=False).ids[: max_len // 2] for p in default_prompts(n)]
    return ids, [max_len - len(i) for i in ids]


def engine_acceptance(
    path: Path, vllm: EnginePool, report_dir: Path, *, ks: tuple[int, ...], prompts: int = 32, max_len: int = 128
) -> dict[int, dict[str, Any]]:
    """``validate --engine vllm --compare-reference`` of ``path``: per k, the AL vLLM's own counters give
    (``engine``) and validate's built-in replay predicts on the same prompts (``predicted``), activations emulated on
    the built-in side (the engine runs the W4A4 activations too), each side's per-position acceptance
    (``engine_per_position``, ``predicted_per_position``) and the engine's verification steps (``engine_steps``); no
    other request reached the server."""
    from mtpquant.api import ValidateOptions, validate

    report = validate(
        ValidateOptions(
            path,
            num_prompts=prompts,
            max_len=max_len,
            ks=ks,
            device="cpu",
            activations="emulate",
            engine="vllm",
            vllm_python=vllm.python,
            env=CPU_ENV,
            compare_reference=True,
            report_dir=report_dir,
            progress=False,
        )
    ).report
    rows = report.predicted.reference or () if report.predicted else ()
    assert [r.k for r in rows] == list(ks)
    assert all(e.other_requests == 0 for e in report.engine)
    return {
        r.k: {
            "engine": r.engine_al,
            "predicted": r.predicted_al,
            "engine_per_position": list(r.engine_per_position),
            "predicted_per_position": list(r.predicted_per_position),
            "engine_steps": r.engine_steps,
        }
        for r in rows
    }
