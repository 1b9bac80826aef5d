"""Acceptance arithmetic and logit-distribution metrics; pure functions, no model code.

Definitions follow what the engines report (vLLM spec-decode metrics):
- greedy verification: the target scores k + 1 positions in one pass; the longest prefix of the
  drafts equal to the target's greedy tokens is accepted, plus one token of the target's own.
- acceptance rate = accepted / drafted tokens.
- mean acceptance length AL = 1 + accepted / verification steps (tokens emitted per step).
- acceptance at draft position i = steps whose first i drafts were all accepted / steps that
  drafted at least i tokens (unconditional, as vLLM's per-position counters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mtpquant.records.acceptance import AcceptanceStats, ContextBucket
from mtpquant.records.evidence import UnitCounts

__all__ = [
    "StepRecord",
    "Summary",
    "acceptance_stats",
    "context_buckets",
    "kl_per_position",
    "summarize",
    "token_agreement",
    "unit_counts",
]


@dataclass(frozen=True)
class StepRecord:
    """One verification step: how many tokens were drafted and how many of them were accepted.

    ``through`` (a prediction under sampling): for each drafted position i, the probability that the first i + 1
    drafts are all accepted; the counts then add these expectations instead of the 0/1 outcome of ``accepted``
    (which still decides where the next step starts). ``context``: tokens in the context when the step drafted.
    """

    drafted: int
    accepted: int
    through: tuple[float, ...] = ()
    context: int = 0

    def __post_init__(self) -> None:
        if self.drafted < 1 or not 0 <= self.accepted <= self.drafted:
            raise ValueError(f"invalid step: drafted {self.drafted}, accepted {self.accepted}")
        if self.through and len(self.through) != self.drafted:
            raise ValueError(f"invalid step: {len(self.through)} expectations for {self.drafted} drafts")

    @property
    def accepted_through(self) -> tuple[float, ...]:
        """Per drafted position: (the probability) that the first i + 1 drafts were all accepted."""
        if self.through:
            return self.through
        return (1.0,) * self.accepted + (0.0,) * (self.drafted - self.accepted)


def _count(value: float) -> float:
    """A sum of 0/1 outcomes stays an exact integer (an int), a sum of expectations a float."""
    return int(value) if float(value).is_integer() else value


def acceptance_stats(records: Sequence[StepRecord]) -> AcceptanceStats:
    """Aggregate step records into rates, AL and per-position acceptance."""
    if not records:
        raise ValueError("no verification steps")
    max_k = max(r.drafted for r in records)
    drafted_pos = tuple(sum(1 for r in records if r.drafted >= i) for i in range(1, max_k + 1))
    through = [r.accepted_through for r in records]
    accepted_pos = tuple(
        _count(math.fsum(t[i - 1] for t in through if len(t) >= i)) for i in range(1, max_k + 1)
    )
    num_drafted = sum(r.drafted for r in records)
    num_accepted = _count(math.fsum(accepted_pos))
    return AcceptanceStats(
        num_steps=len(records),
        num_drafted=num_drafted,
        num_accepted=num_accepted,
        acceptance_rate=num_accepted / num_drafted,
        mean_acceptance_length=1.0 + num_accepted / len(records),
        drafted_per_position=drafted_pos,
        accepted_per_position=accepted_pos,
        acceptance_per_position=tuple(a / d for a, d in zip(accepted_pos, drafted_pos)),
    )


def unit_counts(per_unit: Sequence[Sequence[StepRecord]], k: int) -> UnitCounts:
    """The counts of each sampling unit's steps (one unit per sequence) for positions 1..k: what the bootstrap
    resamples (``evidence.Bootstrap``); summed over units they are ``acceptance_stats`` of all the steps."""
    through = [[r.accepted_through for r in recs] for recs in per_unit]
    return UnitCounts(
        steps=tuple(float(len(recs)) for recs in per_unit),
        accepted=tuple(math.fsum(v for t in ts for v in t) for ts in through),
        accepted_per_position=tuple(
            tuple(math.fsum(t[i - 1] for t in ts if len(t) >= i) for i in range(1, k + 1)) for ts in through
        ),
        drafted_per_position=tuple(
            tuple(float(sum(1 for r in recs if r.drafted >= i)) for i in range(1, k + 1)) for recs in per_unit
        ),
    )


def context_buckets(records: Sequence[StepRecord], edges: Sequence[int], k: int) -> tuple[ContextBucket, ...]:
    """Per context bucket [edges[i-1], edges[i]) (from 0): the steps whose context falls in it, for positions 1..k;
    steps beyond the last edge are left out."""
    out = []
    for low, high in zip((0, *edges[:-1]), edges):
        steps = [r for r in records if low <= r.context < high]
        through = [r.accepted_through for r in steps]
        out.append(
            ContextBucket(
                low,
                high,
                len(steps),
                _count(math.fsum(v for t in through for v in t)),
                tuple(sum(1 for r in steps if r.drafted >= i) for i in range(1, k + 1)),
                tuple(_count(math.fsum(t[i - 1] for t in through if len(t) >= i)) for i in range(1, k + 1)),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Summary:
    """Mean, median and 99th percentile (linear interpolation between order statistics)."""

    count: int
    mean: float
    median: float
    p99: float


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Tensor | Sequence[float]) -> Summary:
    """Summarise a 1-D set of values (NumPy's default 'linear' quantiles)."""
    flat = sorted(float(v) for v in (values.flatten().tolist() if isinstance(values, Tensor) else values))
    if not flat:
        raise ValueError("nothing to summarise")
    return Summary(
        count=len(flat),
        mean=math.fsum(flat) / len(flat),
        median=_quantile(flat, 0.5),
        p99=_quantile(flat, 0.99),
    )


def _rows(ref: Tensor, cand: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if ref.shape != cand.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref.shape)} vs {tuple(cand.shape)}")
    ref2, cand2 = ref.reshape(-1, ref.shape[-1]), cand.reshape(-1, cand.shape[-1])
    if mask is not None:
        keep = mask.reshape(-1).to(torch.bool)
        ref2, cand2 = ref2[keep], cand2[keep]
    return ref2, cand2


def kl_per_position(ref: Tensor, cand: Tensor, mask: Tensor | None = None, chunk_rows: int = 256) -> Tensor:
    """KL(ref || cand) in nats per position, float64; logits ``[..., V]``, mask ``[...]``."""
    ref2, cand2 = _rows(ref, cand, mask)
    out = []
    for start in range(0, ref2.shape[0], chunk_rows):
        logp = torch.log_softmax(ref2[start : start + chunk_rows].double(), dim=-1)
        logq = torch.log_softmax(cand2[start : start + chunk_rows].double(), dim=-1)
        p = logp.exp()
        # Terms with p = 0 contribute 0 (also where the reference masked a token to -inf).
        terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
        out.append(terms.sum(dim=-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def token_agreement(candidate: Tensor, reference: Tensor, mask: Tensor | None = None) -> float:
    """Fraction of positions where two token-id tensors agree (e.g. MTP argmax vs target greedy)."""
    if candidate.shape != reference.shape:
        raise ValueError(f"token shapes differ: {tuple(candidate.shape)} vs {tuple(reference.shape)}")
    same = candidate == reference
    if mask is not None:
        same = same[mask.to(torch.bool)]
    if same.numel() == 0:
        raise ValueError("no positions to compare")
    return float(same.double().mean())
