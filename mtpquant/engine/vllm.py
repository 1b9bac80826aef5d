"""A running vLLM OpenAI-compatible server: version, models, tokenization, completions, and its counters.

vLLM's speculative-decoding counters are server-wide Prometheus counters (``engine/counters.py``): a measurement
reads them before and after its requests and subtracts, and the request counter says whether other clients'
requests finished meanwhile (their drafts are then in the numbers). ``/version`` answering ``{"version": ...}``
is what tells a vLLM server from another one. mtpquant never imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mtpquant.engine.counters import CounterSnapshot, parse_metrics
from mtpquant.engine.http import METRICS_CAP, EngineClientBase, EngineHttp
from mtpquant.engine.server import Completion, DraftCounts, EngineRun, RunRequest, ServerInfo
from mtpquant.errors import EngineAnswerError, EngineSpecDecodeError
from mtpquant.records.sampling import GREEDY, SamplingSettings

__all__ = ["VllmClient", "is_vllm"]

log = logging.getLogger(__name__)

SPEC_HINT = 'start it with --speculative-config \'{"method":"mtp","num_speculative_tokens":K}\''


def is_vllm(http: EngineHttp) -> str | None:
    """The version a vLLM server states at ``/version``, or None when the server is not vLLM."""
    resp = http.request("GET", "/version")
    if resp.status_code != 200:
        return None
    try:
        body = resp.json()
    except ValueError:
        return None
    version = body.get("version") if isinstance(body, dict) else None
    return version if isinstance(version, str) else None


class VllmClient(EngineClientBase):
    """Talks to one vLLM OpenAI server at ``url``."""

    engine = "vllm"

    def info(self) -> ServerInfo:
        """``/version`` and ``/v1/models``; refuses a server that is not vLLM."""
        version = is_vllm(self.http)
        if version is None:
            raise EngineAnswerError(f'{self.url}: not a vLLM server (no /version answering {{"version": ...}})')
        models = self.http.json("/v1/models", what="a vLLM OpenAI")
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data:
            raise EngineAnswerError(f"{self.url}/v1/models: no model listed")
        ids = tuple(str(m.get("id")) for m in data if isinstance(m, dict))
        mml = data[0].get("max_model_len") if isinstance(data[0], dict) else None
        return ServerInfo(self.url, "vllm", version, ids, mml if isinstance(mml, int) else None)

    def counters(self, model: str) -> CounterSnapshot:
        """The speculative-decoding counters of ``model`` now."""
        resp = self.http.request("GET", "/metrics", limit=METRICS_CAP)
        if resp.status_code != 200:
            raise EngineAnswerError(f"{self.url}/metrics: HTTP {resp.status_code}")
        try:
            snap = parse_metrics(resp.text, model)
        except ValueError as exc:
            raise EngineAnswerError(f"{self.url}/metrics: not Prometheus text ({exc})") from None
        if not snap.models:
            raise EngineAnswerError(f"{self.url}/metrics: no vllm:* metrics (is this a vLLM server?)")
        return snap

    def server_args(self) -> tuple[str, ...]:
        """vLLM does not state its launch arguments over HTTP."""
        return ()

    def complete(
        self,
        model: str,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        sampling: SamplingSettings = GREEDY,
        *,
        concurrency: int = 1,
        indices: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Completions of token-id prompts (``ignore_eos``), one request each, ``concurrency`` in flight; the prompt
        numbered i (``indices``, default 0, 1, ...) carries ``sampling.for_prompt(i)`` (its own seed)."""

        def one(http: EngineHttp, item: tuple[int, Sequence[int], int]) -> Completion:
            i, ids, n = item
            payload = {
                "model": model,
                "prompt": [int(t) for t in ids],
                "max_tokens": int(n),
                "ignore_eos": True,
                **sampling.for_prompt(i).vllm_fields(),
                "return_token_ids": True,
            }
            body = http.json("/v1/completions", payload=payload, timeout=self.generate_timeout)
            try:
                choice = body["choices"][0]
                tokens = tuple(int(t) for t in choice["token_ids"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise EngineAnswerError(
                    f"{self.url}/v1/completions: no token_ids in the answer (vLLM >= 0.10 returns them)"
                ) from None
            return Completion(tuple(int(t) for t in ids), tokens, choice.get("finish_reason"))

        numbers = indices if indices is not None else range(len(prompts))
        items = [(i, ids, n) for i, ids, n in zip(numbers, prompts, max_tokens)]
        return self.each(items, one, concurrency)

    def run(self, request: RunRequest, info: ServerInfo) -> EngineRun:
        """The completions, and the counter deltas around each group (server-wide: other traffic is counted in)."""
        del info  # vLLM states its speculative settings only through its counters
        model = request.model
        start = before = self.counters(model)
        completions: dict[int, Completion] = {}
        deltas: list[CounterSnapshot] = []
        for group in request.split():
            done = self.complete(
                model,
                [request.prompts[i] for i in group],
                [request.max_tokens[i] for i in group],
                request.sampling,
                concurrency=request.concurrency,
                indices=group,
            )
            completions.update(zip(group, done))
            after = self.counters(model)
            deltas.append(after.minus(before))
            before = after
        delta = before.minus(start)
        if delta.drafts <= 0 or delta.draft_tokens <= 0:
            what = "exports no speculative-decoding counters" if not delta.spec_decode else "did not draft"
            raise EngineSpecDecodeError(
                f"{self.url}: {model} {what} during {len(completions)} requests: speculative decoding with MTP is "
                f"not configured ({SPEC_HINT})"
            )
        other = max(0, round(delta.requests) - len(completions))
        parts = tuple(_counts(d) for d in deltas)
        return EngineRun(model, request.ordered(completions), _counts(delta), other, True, parts)


def _counts(delta: CounterSnapshot) -> DraftCounts:
    return DraftCounts(
        steps=round(delta.drafts),
        drafted=round(delta.draft_tokens),
        accepted=round(delta.accepted),
        accepted_per_position=tuple(round(a) for a in delta.accepted_per_position),
    )
