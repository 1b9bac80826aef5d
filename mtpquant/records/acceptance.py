"""Acceptance as the validation report records it: ``AcceptanceStats`` over verification steps, the ``by_k`` rows
with their intervals and per-unit counts, the ``by_context`` buckets, and one sampling setting's ``Acceptance``.
Imports nothing heavy (no torch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mtpquant.records.evidence import Interval, UnitCounts
from mtpquant.records.jsonrecord import as_floats, as_ints, as_object, require
from mtpquant.records.sampling import SamplingSettings

__all__ = ["Acceptance", "AcceptanceRow", "AcceptanceStats", "ContextBucket"]


@dataclass(frozen=True)
class AcceptanceStats:
    """Acceptance over a run of verification steps; per-position tuples are for positions 1..K (vLLM's counters'
    terms). ``metrics.acceptance_stats`` computes it from step records, ``measure.engine_stats`` from an engine's
    counters."""

    num_steps: int
    num_drafted: int
    num_accepted: float  # an int when counted; a sum of probabilities when predicted under sampling
    acceptance_rate: float
    mean_acceptance_length: float
    drafted_per_position: tuple[int, ...]
    accepted_per_position: tuple[float, ...]  # ints when counted, expectations when predicted
    acceptance_per_position: tuple[float, ...]


_STATS_FIELDS = tuple(f.name for f in fields(AcceptanceStats))


@dataclass(frozen=True)
class ContextBucket:
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

    def to_json(self) -> dict[str, Any]:
        """One ``by_context`` entry (rates null where nothing was drafted: strict JSON)."""

        def num(v: float) -> float | int | None:
            if v != v:  # NaN
                return None
            return int(v) if float(v).is_integer() and not isinstance(v, bool) else v

        return {
            "low": self.low,
            "high": self.high,
            "steps": self.steps,
            "accepted": num(self.accepted),
            "mean_acceptance_length": num(self.mean_acceptance_length),
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": [num(a) for a in self.accepted_per_position],
            "acceptance_per_position": [num(a) for a in self.acceptance_per_position],
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> ContextBucket:
        """Read a ``by_context`` entry."""
        d = as_object(d, where)
        return cls(
            int(require(d, "low", int, where)),
            int(require(d, "high", int, where)),
            int(require(d, "steps", int, where)),
            float(require(d, "accepted", (int, float), where)),
            as_ints(d.get("drafted_per_position"), f"{where}.drafted_per_position"),
            as_floats(d.get("accepted_per_position"), f"{where}.accepted_per_position"),
        )


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

    def to_json(self) -> dict[str, Any]:
        """The ``by_k`` entry."""
        out: dict[str, Any] = {"k": self.k}
        for name in _STATS_FIELDS:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        if self.al_interval is not None:
            out["al_interval"] = self.al_interval.to_json()
        if self.units is not None:
            out["units"] = self.units.to_json()
        if self.by_context:
            out["by_context"] = [b.to_json() for b in self.by_context]
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> AcceptanceRow:
        """Read a ``by_k`` entry."""
        d = as_object(d, where)
        interval = d.get("al_interval")
        units = d.get("units")
        return cls(
            al_interval=None if interval is None else Interval.from_json(interval, f"{where}.al_interval"),
            units=None if units is None else UnitCounts.from_json(units, f"{where}.units"),
            by_context=tuple(
                ContextBucket.from_json(b, f"{where}.by_context[{i}]") for i, b in enumerate(d.get("by_context") or ())
            ),
            k=require(d, "k", int, where),
            num_steps=require(d, "num_steps", int, where),
            num_drafted=require(d, "num_drafted", int, where),
            num_accepted=require(d, "num_accepted", (int, float), where),
            acceptance_rate=float(require(d, "acceptance_rate", (int, float), where)),
            mean_acceptance_length=float(require(d, "mean_acceptance_length", (int, float), where)),
            drafted_per_position=as_ints(d.get("drafted_per_position"), f"{where}.drafted_per_position"),
            accepted_per_position=tuple(
                int(v) if float(v).is_integer() else v
                for v in as_floats(d.get("accepted_per_position"), f"{where}.accepted_per_position")
            ),
            acceptance_per_position=as_floats(d.get("acceptance_per_position"), f"{where}.acceptance_per_position"),
        )


@dataclass(frozen=True)
class Acceptance:
    """Acceptance for k = 1..K under one sampling setting and verification rule, plus the teacher-forced agreement
    (None when measured by an engine)."""

    by_k: tuple[AcceptanceRow, ...]
    teacher_forced_agreement: float | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    rule: str = "vllm"

    @property
    def al(self) -> list[float]:
        """Mean acceptance length per k."""
        return [r.mean_acceptance_length for r in self.by_k]

    def to_json(self) -> dict[str, Any]:
        """The ``acceptance`` object."""
        return {
            "sampling": self.sampling.to_json(),
            "rule": self.rule,
            "teacher_forced_agreement": self.teacher_forced_agreement,
            "by_k": [r.to_json() for r in self.by_k],
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> Acceptance:
        """Read an ``acceptance`` object."""
        d = as_object(d, where)
        rows = d.get("by_k")
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{where}.by_k: expected a non-empty list")
        tf = d.get("teacher_forced_agreement")
        if tf is not None and not isinstance(tf, (int, float)):
            raise ValueError(f"{where}.teacher_forced_agreement: expected a number or null")
        sampling = d.get("sampling")
        return cls(
            tuple(AcceptanceRow.from_json(r, f"{where}.by_k[{i}]") for i, r in enumerate(rows)),
            None if tf is None else float(tf),
            SamplingSettings.from_json(sampling) if isinstance(sampling, Mapping) else SamplingSettings(),
            str(d.get("rule") or "vllm"),
        )
