"""Engines' Prometheus ``/metrics``: vLLM's speculative-decoding counters, read and subtracted, and single totals.

vLLM 0.32 exports cumulative Prometheus counters labelled by ``model_name`` (and ``position`` for the
per-position one): ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
``..._num_accepted_tokens_per_pos``, plus ``vllm:request_success`` (finished requests, by reason) and
``vllm:prompt_tokens`` / ``vllm:generation_tokens``. Counters are server-wide, so a measurement is the
difference of two snapshots; the request and token counters tell whether other traffic interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SPEC_PREFIX", "CounterSnapshot", "metric_total", "parse_metrics", "samples"]

SPEC_PREFIX = "vllm:spec_decode_"
_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_REQUESTS = "vllm:request_success"
_PROMPT_TOKENS = "vllm:prompt_tokens"
_GENERATION_TOKENS = "vllm:generation_tokens"


@dataclass(frozen=True)
class CounterSnapshot:
    """The counters of one model at one moment (or, from ``minus``, over an interval)."""

    model: str
    spec_decode: bool  # the server exports speculative-decoding counters at all
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_position: tuple[float, ...] = ()
    requests: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    models: tuple[str, ...] = field(default=(), compare=False)  # every model_name the server reported

    def minus(self, before: CounterSnapshot) -> CounterSnapshot:
        """The counts accumulated between ``before`` and this snapshot."""
        n = max(len(self.accepted_per_position), len(before.accepted_per_position))
        pos = tuple(_at(self.accepted_per_position, i) - _at(before.accepted_per_position, i) for i in range(n))
        return CounterSnapshot(
            self.model,
            self.spec_decode,
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            pos,
            self.requests - before.requests,
            self.prompt_tokens - before.prompt_tokens,
            self.generation_tokens - before.generation_tokens,
            self.models,
        )

    @property
    def positions(self) -> int:
        """Draft positions the server has reported (its K, once it has drafted)."""
        return len(self.accepted_per_position)


def _at(values: tuple[float, ...], i: int) -> float:
    return values[i] if i < len(values) else 0.0


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text body (prometheus_client's own parser; ValueError when it is not one)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: list[tuple[str, dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.append((s.name, dict(s.labels), float(s.value)))
    return samples


def metric_total(text: str, name: str, model: str) -> float:
    """The sum of the samples called ``name`` labelled ``model_name=model`` (0 when there is none)."""
    return sum(v for n, labels, v in samples(text) if n == name and labels.get("model_name") == model)


def parse_metrics(text: str, model: str | None = None) -> CounterSnapshot:
    """The counters in a ``/metrics`` body, for ``model`` (the only model served when None).

    Uses prometheus_client's own text parser; samples of other models are ignored.
    """
    every = samples(text)
    models = tuple(sorted({labels["model_name"] for _, labels, _ in every if "model_name" in labels}))
    chosen = model if model is not None else (models[0] if len(models) == 1 else "")
    mine = [(n, labels, v) for n, labels, v in every if labels.get("model_name") == chosen]

    def total(name: str) -> float:
        return sum(v for n, _, v in mine if n == name + "_total")

    per_pos: dict[int, float] = {}
    for n, labels, v in mine:
        if n == _PER_POS + "_total" and labels.get("position", "").isdigit():
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + v
    spec = any(n.startswith(SPEC_PREFIX) for n, _, _ in mine)
    return CounterSnapshot(
        chosen,
        spec,
        total(_DRAFTS),
        total(_DRAFT_TOKENS),
        total(_ACCEPTED),
        tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else (),
        total(_REQUESTS),
        total(_PROMPT_TOKENS),
        total(_GENERATION_TOKENS),
        models,
    )
