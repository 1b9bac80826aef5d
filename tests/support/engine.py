"""Real vLLM servers for the engine tests, one pool per test process (xdist worker): a server starts once per
(checkpoint, K, engine settings) and every test of the process that needs the same one shares it, across modules (the
modules that need the same servers are one xdist work unit, tests/support/lanes.py ``SHARED_UNITS``, so one process
runs them all).

Servers start lazily through mtpquant's own launcher (``mtpquant.engine.launch``) from the engine
environment ``tests/support/vllm_env.py`` builds; the least recently used one is stopped when a new one
would exceed ``max_alive`` (each CPU server holds a couple of GB). Logs land in the session's temp dir.
With ``MTPQUANT_ENGINE_STARTS=FILE`` every engine start in the session (the pool's and those validate makes itself)
appends a line to FILE (``record_engine_starts``): ``.ci/run`` prints how many started and how many were distinct.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.launch import EngineProcess, free_port, server_args
from mtpquant.engine.server import ServerInfo
from mtpquant.engine.sizing import plan_engine_memory, probe_machine
from mtpquant.engine.vllm import VllmClient
from mtpquant.errors import EngineStartError
from mtpquant.records.acceptance import AcceptanceRow

__all__ = [
    "CONCURRENCY",
    "CPU_ENV",
    "MP_CPU_ENV",
    "STARTS_ENV",
    "EnginePool",
    "RunningServer",
    "assert_drafts",
    "engine_acceptance",
    "pool_server",
    "prompt_ids",
    "record_engine_starts",
]


def _cpu_env() -> dict[str, str]:
    """The servers' environment: nothing about memory (mtpquant sizes it, engine/sizing.py), no tokenizer threads, and
    two processes instead of vLLM's three. vLLM's CPU platform turns the single-process executor into the
    multiprocessing one unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``CpuPlatform.check_and_update_config``): a third
    process that imports torch and vLLM again (~10 s of CPU each). Without it the trained tiny model's server is ready
    in 24 s instead of 37 s (idle machine, 2026-12-07, scripts in docs/BENCHMARKS.md "the test lanes"), with the same
    tokens and the same speculative counters on 8 greedy prompts at k = 2. Nothing binds the model's threads then:
    ``OMP_NUM_THREADS=1`` gives each server one thread, so two workers' servers compute on the two cores (vLLM's own
    binding put both on core 0, ``MP_CPU_ENV``'s note)."""
    return {"TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}


def _mp_cpu_env() -> dict[str, str]:
    """vLLM's default CPU executor (engine core, worker process, OpenMP threads bound by vLLM), as users get it: the
    test of the server mtpquant starts for ``validate --engine vllm`` runs it. Under xdist each worker's servers are
    bound to a core of their own: vLLM binds its OpenMP threads to the first core it may use and reserves the rest
    (``VLLM_CPU_OMP_THREADS_BIND=auto``): two workers' servers measuring at once both ran on core 0 while core 1 did
    the rest (measured 2026-12-07). Unbound (``nobind``) is worse: its two OpenMP threads spin against the suite's
    other work (8 requests of 200 tokens: 274 s against 24 s bound, on the busy 2-core machine)."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... (unset without xdist: vLLM's own binding)
    if worker.startswith("gw") and worker[2:].isdigit() and hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[int(worker[2:]) % len(cpus)])
    return env


CPU_ENV = _cpu_env()
MP_CPU_ENV = _mp_cpu_env()
MAX_LEN = 256  # the longest sequences the tests send
CONCURRENCY = 8  # the most requests a test keeps in flight at once (validate --concurrency)
STARTS_ENV = "MTPQUANT_ENGINE_STARTS"
# What the pool's servers are started with besides the checkpoint and K: part of the key, so a pool that ever
# starts servers with other settings does not hand one out for another.
SETTINGS = (("max_len", MAX_LEN), ("sequences", CONCURRENCY), *sorted(CPU_ENV.items()))


@contextmanager
def record_engine_starts() -> Iterator[None]:
    """With ``MTPQUANT_ENGINE_STARTS=FILE``: every ``EngineProcess.start`` in this process appends one JSON line to
    FILE (engine, its arguments less the port, seconds to ready); otherwise nothing."""
    target = os.environ.get(STARTS_ENV)
    if not target:
        yield
        return
    original = EngineProcess.start

    def start(self: EngineProcess) -> None:
        t0 = time.monotonic()
        try:
            original(self)
        finally:
            args = list(self.args)
            if "--port" in args:
                del args[args.index("--port") : args.index("--port") + 2]
            line = {"engine": self.engine, "args": args, "seconds": round(time.monotonic() - t0, 1)}
            with open(target, "a") as f:
                f.write(json.dumps(line) + "\n")

    EngineProcess.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        EngineProcess.start = original  # type: ignore[method-assign]


def pool_server(
    python: Path, logs: Path, checkpoint: Path, k: int | None, env: dict[str, str] = CPU_ENV
) -> EngineProcess:
    """The (not yet started) vLLM server the pool starts for ``checkpoint`` at ``k``: mtpquant's memory sizing for
    ``CONCURRENCY`` sequences of ``MAX_LEN`` tokens, the CPU backend's flags, ``env`` (the pool's: ``CPU_ENV``), its
    log in ``logs``."""
    port = free_port()
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
    log = logs / f"{checkpoint.name}-k{k}-{port}.log"
    return EngineProcess("vllm", python, args, log, port=port, startup_timeout=300, env=env)


@dataclass
class RunningServer:
    """A started server, its client and the model name it serves."""

    server: EngineProcess
    client: VllmClient
    info: ServerInfo
    model: str
    started_s: float


Key = tuple[str, "int | None", tuple[tuple[str, object], ...]]


@dataclass
class EnginePool:
    """Lazily started vLLM servers keyed by (checkpoint, K, engine settings); K None means no speculative decoding.
    The checkpoint is its resolved path (the tests never change a checkpoint a server serves)."""

    python: Path
    logs: Path
    max_alive: int = 2
    alive: OrderedDict[Key, RunningServer] = field(default_factory=OrderedDict)
    startup_seconds: list[float] = field(default_factory=list)
    started: list[Key] = field(default_factory=list)  # every start, in order (a key twice: restarted after eviction)

    def get(self, checkpoint: Path, k: int | None) -> RunningServer:
        """A running server for ``checkpoint`` with ``k`` MTP drafts (started if needed)."""
        key: Key = (str(Path(checkpoint).resolve()), k, SETTINGS)
        if key in self.alive:
            self.alive.move_to_end(key)
            return self.alive[key]
        while len(self.alive) >= self.max_alive:
            _, old = self.alive.popitem(last=False)
            old.server.stop()
        server = pool_server(self.python, self.logs, checkpoint, k)
        t0 = time.monotonic()
        server.start()
        self.startup_seconds.append(time.monotonic() - t0)
        self.started.append(key)
        client = VllmClient(server.url)
        running = RunningServer(server, client, client.info(), str(checkpoint), self.startup_seconds[-1])
        self.alive[key] = running
        return running

    def start_failure(self, checkpoint: Path, k: int | None) -> EngineStartError:
        """The error of a server that must fail to start (it is stopped either way)."""
        server = pool_server(self.python, self.logs, checkpoint, k)
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


def assert_drafts(vllm: EnginePool, path: Path, k: int, prompts: int) -> None:
    """``path`` served at ``k`` from the pool loads and its MTP drafts usefully: the first ``prompts`` default prompts,
    greedy, verify steps and accept drafts (and no other request reached the server)."""
    from mtpquant.records.sampling import GREEDY
    from mtpquant.validate.measure import measure

    running = vllm.get(path, k)
    ids, n = prompt_ids(path, prompts)
    m = measure(running.client, running.info, running.model, ids, n, GREEDY)
    assert m.k == k and m.other_requests == 0
    assert m.stats.num_steps > 0 and m.stats.num_accepted > 0, m.stats


# engine_acceptance's two measurements by (checkpoint, k, prompts, max_len): the same checkpoint measured twice in a
# process (tests/test_engine_heal.py's unhealed keep quant is tests/test_engine_search.py's BF16-MTP baseline) is
# served and predicted once. The tests never change a checkpoint they measure.
_MEASURED: dict[tuple[str, int, int, int], tuple[AcceptanceRow, AcceptanceRow]] = {}


def engine_acceptance(
    path: Path, vllm: EnginePool, report_dir: Path, *, ks: tuple[int, ...], prompts: int = 32, max_len: int = 128
) -> dict[int, dict[str, Any]]:
    """What vLLM measures on ``path`` against what validate's built-in replay predicts on the same prompts, per k in
    ``ks``: the AL vLLM's own counters give (``engine``) and the prediction (``predicted``, activations emulated: the
    engine runs the W4A4 activations too), each side's per-position acceptance (``engine_per_position``,
    ``predicted_per_position``) and the engine's verification steps (``engine_steps``); no other request reached the
    server while it measured.

    One server per checkpoint, at the largest k, from the session's pool (``validate --server``; a test elsewhere that
    measures the same checkpoint at the same k gets the same server): vLLM accepts draft i with the same probability,
    given the context, whatever k >= i, so a k-server's first j positions measure what a j-server accepts (AL at j:
    1 + their sum; checked in tests/test_engine_validate.py). The prediction is ``validate`` of the same prompts and
    lengths at the same k, without an engine. A checkpoint measured before in the process at the same k, prompts and
    length is not measured again (``_MEASURED``): ``report_dir`` then stays empty."""
    from mtpquant.api import ValidateOptions, validate

    k = max(ks)
    key = (str(Path(path).resolve()), k, prompts, max_len)
    if key not in _MEASURED:
        common: dict[str, Any] = {"num_prompts": prompts, "max_len": max_len, "progress": False}
        server = vllm.get(path, k)
        measured = validate(
            ValidateOptions(path, server=server.server.url, concurrency=CONCURRENCY, report_dir=report_dir, **common)
        ).report
        assert [e.k for e in measured.engine] == [k] and all(e.other_requests == 0 for e in measured.engine)
        (engine,) = measured.reference.acceptance_by_sampling[0].by_k
        predicted = validate(ValidateOptions(path, ks=(k,), device="cpu", activations="emulate", **common)).report
        built_in = predicted.reference.acceptance_by_sampling[0].by_k[-1]
        assert engine.k == built_in.k == k
        _MEASURED[key] = (engine, built_in)
    engine, built_in = _MEASURED[key]
    out = {}
    for j in ks:
        e, p = list(engine.acceptance_per_position[:j]), list(built_in.acceptance_per_position[:j])
        out[j] = {
            "engine": engine.mean_acceptance_length if j == k else 1 + sum(e),
            "predicted": built_in.mean_acceptance_length if j == k else 1 + sum(p),
            "engine_per_position": e,
            "predicted_per_position": p,
            "engine_steps": engine.num_steps,
        }
    return out
