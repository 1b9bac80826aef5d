"""Acceptance as the validation report records it: ``AcceptanceStats`` over verification steps, the ``by_k`` rows
with their intervals and per-unit counts, the ``by_context`` buckets, and one sampling setting's ``Acceptance``.
Imports nothing heavy (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated, Any

from annotated_types import MinLen

from mtpquant.records.evidence import Interval, UnitCounts
from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings

__all__ = ["Acceptance", "AcceptanceRow", "AcceptanceStats", "ContextBucket"]


@dataclass(frozen=True)
class AcceptanceStats(Record):
    """Acceptance over a run of verification steps; per-position tuples are for positions 1..K (vLLM's counters'
    terms). ``metrics.acceptance_stats`` computes it from step records, ``measure.engine_stats`` from an engine's
    counters."""

    num_steps: int
    num_drafted: int
    num_accepted: int | float  # an int when counted; a sum of probabilities when predicted under sampling
    acceptance_rate: float
    mean_acceptance_length: float
    drafted_per_position: tuple[int, ...]
    accepted_per_position: tuple[int | float, ...]  # ints when counted, expectations when predicted
    acceptance_per_position: tuple[float, ...]


_STATS_FIELDS = tuple(f.name for f in fields(AcceptanceStats))


def _num(v: float) -> float | int | None:
    """A count or rate as the report writes it: null for NaN (strict JSON), a whole number as an int."""
    if v != v:  # NaN
        return None
    return int(v) if float(v).is_integer() and not isinstance(v, bool) else v


@dataclass(frozen=True)
class ContextBucket(Record):
    """Acceptance of the steps whose context (prompt + generated tokens when the step drafted) lies in
    [low, high): per-position counts in vLLM's terms, and AL."""

    low: int
    high: int
    steps: int
    accepted: float
    drafted_per_position: tuple[int, ...]
    accepted_per_position: tuple[float, ...]

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        """Accepted / drafted per position (NaN where nothing was drafted)."""
        pairs = zip(self.accepted_per_position, self.drafted_per_position)
        return tuple(a / d if d else float("nan") for a, d in pairs)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / steps (NaN without steps)."""
        return 1.0 + self.accepted / self.steps if self.steps else float("nan")

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """One ``by_context`` entry, with its AL and rates (null where nothing was drafted: strict JSON)."""
        return {
            "low": self.low,
            "high": self.high,
            "steps": self.steps,
            "accepted": _num(self.accepted),
            "mean_acceptance_length": _num(self.mean_acceptance_length),
            "drafted_per_position": data["drafted_per_position"],
            "accepted_per_position": [_num(a) for a in self.accepted_per_position],
            "acceptance_per_position": [_num(a) for a in self.acceptance_per_position],
        }


@dataclass(frozen=True)
class AcceptanceRow(AcceptanceStats):
    """Acceptance with k drafts per step: the report's ``by_k`` entry, with AL's interval over the sampling units
    (prompts) and the per-unit counts it was resampled from."""

    k: int
    al_interval: Interval | None = None
    units: UnitCounts | None = None
    by_context: tuple[ContextBucket, ...] = ()

    @classmethod
    def of(
        cls,
        k: int,
        stats: AcceptanceStats,
        units: UnitCounts | None = None,
        al_interval: Interval | None = None,
        by_context: tuple[ContextBucket, ...] = (),
    ) -> AcceptanceRow:
        """The row of ``stats`` for k."""
        return cls(
            k=k,
            al_interval=al_interval,
            units=units,
            by_context=by_context,
            **{name: getattr(stats, name) for name in _STATS_FIELDS},
        )

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The ``by_k`` entry: k first; the interval, units and buckets only where measured."""
        out = {"k": data["k"], **{name: data[name] for name in _STATS_FIELDS}}
        out |= {key: data[key] for key in ("al_interval", "units") if data[key] is not None}
        return out | ({"by_context": data["by_context"]} if data["by_context"] else {})


@dataclass(frozen=True)
class Acceptance(Record):
    """Acceptance for k = 1..K under one sampling setting and verification rule, plus the teacher-forced agreement
    (None when measured by an engine)."""

    by_k: Annotated[tuple[AcceptanceRow, ...], MinLen(1)]
    teacher_forced_agreement: float | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    rule: str = "vllm"

    @property
    def al(self) -> list[float]:
        """Mean acceptance length per k."""
        return [r.mean_acceptance_length for r in self.by_k]

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The ``acceptance`` object: the sampling setting and rule first."""
        return {key: data[key] for key in ("sampling", "rule", "teacher_forced_agreement", "by_k")}
