"""A local HTTP server on 127.0.0.1 that answers as the recorded real SGLang 0.5.23 server did.

``tests/fixtures/sglang-cpu/`` holds what a real SGLang server (CPU build, the trained tiny Qwen3.5, NEXTN with
2 steps) answered, byte for byte (a copy of ``shared/reference/sglang-cpu``; its README says how it was
recorded). This server replays those answers with their status codes and bodies:

- ``GET_<route>.txt``: the body, then the HTTP status on the last line (``GET_version.txt``: SGLang's 404);
- ``GET_metrics_before.txt`` / ``GET_metrics_after.txt``: ``/metrics`` (status 200), the first answer the
  ``before`` text and every later one the ``after`` text, as the server said them around its requests;
- ``POST_generate_greedy.json`` for a ``/generate`` of one prompt, ``POST_generate_batch_t0.8.json`` for a batch,
  ``POST_v1_completions.json`` for ``/v1/completions``;
- any other route: SGLang's (FastAPI's) 404 answer, the body of ``GET_version.txt``.

Every request is kept (``requests``) so a test can check what the client sent. ``settings`` changes named fields
of the recorded ``/get_server_info`` answer, for the servers that were not recorded (started without speculative
decoding, with a draft tree): the rest of the answer stays as recorded.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["RECORDED", "SglangReplay"]

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "sglang-cpu"
_GET = {
    "/get_server_info": "GET_get_server_info.txt",
    "/server_info": "GET_server_info.txt",
    "/get_model_info": "GET_get_model_info.txt",
    "/model_info": "GET_model_info.txt",
    "/v1/models": "GET_v1_models.txt",
    "/health_generate": "GET_health_generate.txt",
    "/version": "GET_version.txt",
}
_JSON = "application/json"
_METRICS = "text/plain; version=0.0.4; charset=utf-8"


def recorded_get(name: str) -> tuple[bytes, int]:
    """A recorded GET answer: its body and status (the file's last line)."""
    text = (RECORDED / name).read_bytes()
    body, _, status = text.rpartition(b"\n")
    return body, int(status)


class SglangReplay:
    """``with SglangReplay() as server: server.url``."""

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        self.settings = dict(settings or {})
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body or None)
        self._metrics_reads = 0
        replay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                replay.requests.append(("GET", self.path, None))
                if self.path == "/metrics":
                    name = "GET_metrics_before.txt" if replay._metrics_reads == 0 else "GET_metrics_after.txt"
                    replay._metrics_reads += 1
                    self._send(200, (RECORDED / name).read_bytes(), _METRICS)
                    return
                name = _GET.get(self.path)
                body, status = recorded_get(name) if name else replay.not_found()
                if name in ("GET_get_server_info.txt", "GET_server_info.txt") and replay.settings:
                    body = json.dumps({**json.loads(body), **replay.settings}, separators=(",", ":")).encode()
                self._send(status, body, _JSON)

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                payload = json.loads(self.rfile.read(length) or b"null")
                replay.requests.append(("POST", self.path, payload))
                if self.path == "/generate":
                    batch = isinstance(payload, dict) and isinstance((payload.get("input_ids") or [None])[0], list)
                    name = "POST_generate_batch_t0.8.json" if batch else "POST_generate_greedy.json"
                    self._send(200, (RECORDED / name).read_bytes(), _JSON)
                elif self.path == "/v1/completions":
                    self._send(200, (RECORDED / "POST_v1_completions.json").read_bytes(), _JSON)
                else:
                    body, status = replay.not_found()
                    self._send(status, body, _JSON)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def not_found() -> tuple[bytes, int]:
        """SGLang's answer to a route it does not have (recorded for ``/version``)."""
        return recorded_get("GET_version.txt")

    def posted(self, path: str) -> list[Any]:
        """The JSON bodies POSTed to ``path``, in order."""
        return [body for method, p, body in self.requests if method == "POST" and p == path]

    def __enter__(self) -> SglangReplay:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
