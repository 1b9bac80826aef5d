"""A STAND-IN for ``trtllm-serve`` on 127.0.0.1: not TensorRT-LLM, a small HTTP server that answers as TensorRT-LLM's
source says its OpenAI server does (no TensorRT-LLM runs here: it needs a GPU).

What it reproduces, and from where:

- ``GET /version`` -> ``{"version": ...}`` and ``GET /v1/models`` -> the OpenAI model list
  (``tensorrt_llm/serve/openai_server.py``: ``version``, ``get_model``; ``owned_by`` ``tensorrt_llm``);
- ``GET /prometheus/metrics`` -> Prometheus text with the ``MetricsCollector`` names
  (``tensorrt_llm/metrics/collector.py``): the iteration-level cumulative counters
  ``trtllm_spec_decode_num_draft_tokens_total`` and ``trtllm_spec_decode_num_accepted_tokens_total``, the
  ``trtllm_spec_decode_acceptance_length`` gauge, ``trtllm_request_success_total`` by ``finished_reason``, and the
  ``trtllm_speculative_config_info`` gauge whose labels state the MTP config; every sample labelled with the server's
  labels (``model_name``, ``engine_type``). Iteration stats are logged after the answers: the first read after a
  request still shows the counts before it (``lag``);
- ``POST /v1/completions`` -> ``CompletionResponse`` (``tensorrt_llm/serve/openai_protocol.py``): ``choices`` with
  ``text``, ``finish_reason`` (and ``token_ids`` only when ``token_ids`` is set here), ``usage``.
- anything else: 404.

Its MTP "drafts" ``k`` tokens per step and accepts them in the cycle ``pattern`` (0..k accepted per step), emitting
1 + accepted tokens per step until ``max_tokens``; the counters add k drafted tokens and the accepted ones per step.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["TrtllmStandIn", "steps_for"]

VERSION = "1.3.0rc5"  # a version string as trtllm-serve states it (stand-in)
MODEL = "tiny-qwen3_5-mtp"


def steps_for(max_tokens: int, pattern: Sequence[int]) -> tuple[int, int]:
    """(verify steps, accepted drafts) of one request generating ``max_tokens`` with the stand-in's pattern."""
    emitted = steps = accepted = 0
    while emitted < max_tokens:
        a = min(pattern[steps % len(pattern)], max_tokens - emitted - 1)
        emitted, accepted, steps = emitted + 1 + a, accepted + a, steps + 1
    return steps, accepted


class TrtllmStandIn:
    """``with TrtllmStandIn() as server: server.url`` (a stand-in, not TensorRT-LLM)."""

    def __init__(
        self,
        k: int = 2,
        pattern: Sequence[int] = (2, 1, 0),
        *,
        spec: bool = True,
        token_ids: bool = False,
        lag: bool = True,
        others: int = 0,
    ) -> None:
        self.k, self.pattern, self.spec, self.token_ids, self.lag = k, tuple(pattern), spec, token_ids, lag
        self.drafted = self.accepted = 0
        self.finished = 0
        self._pending_others = others  # requests other clients finish during the first completion
        self._shown = (0, 0, 0)
        self.requests: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                standin.requests.append(("GET", self.path, None))
                if self.path == "/version":
                    self._send(200, json.dumps({"version": VERSION}).encode())
                elif self.path == "/v1/models":
                    model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "tensorrt_llm"}
                    self._send(200, json.dumps({"object": "list", "data": [model]}).encode())
                elif self.path == "/prometheus/metrics":
                    self._send(200, standin.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
                standin.requests.append(("POST", self.path, body))
                if self.path != "/v1/completions":
                    self._send(404, b'{"detail":"Not Found"}')
                    return
                self._send(200, json.dumps(standin.complete(body)).encode())

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One completion: its steps added to the counters (seen by the next read but one, with ``lag``)."""
        n = int(body["max_tokens"])
        steps, accepted = steps_for(n, self.pattern) if self.spec else (n, 0)
        with self._lock:
            if self.spec:
                self.drafted += self.k * steps
                self.accepted += accepted
            self.finished += 1 + self._pending_others
            self._pending_others = 0
        choice: dict[str, Any] = {"index": 0, "text": " x" * n, "finish_reason": "length", "stop_reason": None}
        if self.token_ids:
            choice["token_ids"] = [7] * n
        prompt = body["prompt"]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        return {"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": MODEL, "choices": [choice],
                "usage": usage}

    def metrics(self) -> str:
        """The Prometheus text now (with ``lag``: the counts as of the previous read)."""
        with self._lock:
            now = (self.drafted, self.accepted, self.finished)
            shown, self._shown = (self._shown if self.lag else now), now
        drafted, accepted, finished = shown
        labels = f'engine_type="trtllm",model_name="{MODEL}"'
        lines = [
            "# HELP trtllm_request_success_total Count of successfully processed requests.",
            "# TYPE trtllm_request_success_total counter",
            f'trtllm_request_success_total{{{labels},finished_reason="length"}} {float(finished)}',
        ]
        if self.spec:
            al = 1.0 + accepted / (drafted / self.k) if drafted else 0.0
            lines += [
                "# HELP trtllm_spec_decode_num_draft_tokens_total Total draft tokens.",
                "# TYPE trtllm_spec_decode_num_draft_tokens_total counter",
                f"trtllm_spec_decode_num_draft_tokens_total{{{labels}}} {float(drafted)}",
                "# HELP trtllm_spec_decode_num_accepted_tokens_total Total accepted draft tokens.",
                "# TYPE trtllm_spec_decode_num_accepted_tokens_total counter",
                f"trtllm_spec_decode_num_accepted_tokens_total{{{labels}}} {float(accepted)}",
                "# HELP trtllm_spec_decode_acceptance_length Acceptance length.",
                "# TYPE trtllm_spec_decode_acceptance_length gauge",
                f"trtllm_spec_decode_acceptance_length{{{labels}}} {al}",
                "# HELP trtllm_speculative_config_info Speculative decoding configuration info",
                "# TYPE trtllm_speculative_config_info gauge",
                f'trtllm_speculative_config_info{{{labels},decoding_type="MTP",num_nextn_predict_layers="{self.k}"}}'
                " 1.0",
            ]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> TrtllmStandIn:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
