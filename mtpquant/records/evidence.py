"""How sure a measured acceptance is: bootstrap confidence intervals over prompts, and decisions that wait for them.

Acceptance is measured over prompts, and prompts differ a lot (code is predictable, prose less so), so the
sampling unit is the prompt: a measurement keeps its counts per prompt (``UnitCounts``; on the engine path a
unit is a group of prompts sent together, read between two counter snapshots), and the percentile bootstrap
resamples whole units with replacement. AL is a ratio of sums (1 + accepted / steps), recomputed per
resample; a change between two measurements of the *same* prompts (reference vs candidate, before vs after a
heal) is resampled paired, with one set of unit weights for both sides, which is what makes a small change
on few prompts decidable. Nothing here runs a model: the intervals cost no extra passes.

Decisions (``decide``) compare an interval with a boundary and say ``below``, ``above`` or ``inconclusive``;
an inconclusive one comes with the number of units that would settle it, from the usual 1/sqrt(n) shrinkage
of the interval (``units_to_settle``). ``better_beyond_noise`` is the one-line question heal asks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtpquant.records.record import Record, finite_or_none

if TYPE_CHECKING:  # numpy is imported where it computes: the report schema reads these types without it
    import numpy as np

__all__ = [
    "CONFIDENCE",
    "MIN_UNITS",
    "RESAMPLES",
    "Bootstrap",
    "Interval",
    "UnitCounts",
    "better_beyond_noise",
    "decide",
    "split_change",
    "units_to_decide",
    "units_to_settle",
]

CONFIDENCE = 0.95  # two-sided level of every interval validate reports
RESAMPLES = 2000  # bootstrap resamples (seeded: the same counts always give the same interval)
MIN_UNITS = 5  # below this many prompts a percentile bootstrap cannot give an interval worth deciding on
_SETTLE_CAP = 100  # "units_to_settle" says "more than 100x the sample" beyond this factor


def _whole(value: Any) -> Any:
    """Counts as JSON: a whole float as an int, in lists and lists of lists."""
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return int(value) if isinstance(value, float) and value.is_integer() else value


@dataclass(frozen=True)
class UnitCounts(Record):
    """Acceptance counts of one measurement at one k, per sampling unit (a prompt, or a group of prompts).

    ``steps[u]``, ``accepted[u]``: verification steps and accepted draft tokens of unit u;
    ``accepted_per_position[u][i]``: steps whose first i + 1 drafts were all accepted;
    ``drafted_per_position[u][i]``: steps that drafted at least i + 1 tokens. Counts may be expected values
    (floats) where a prediction replaces an indicator by its probability.
    """

    steps: tuple[float, ...]
    accepted: tuple[float, ...]
    accepted_per_position: tuple[tuple[float, ...], ...]
    drafted_per_position: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.steps)
        if not (len(self.accepted) == len(self.accepted_per_position) == len(self.drafted_per_position) == n):
            raise ValueError("UnitCounts: every field needs one entry per unit")

    @property
    def units(self) -> int:
        """Number of sampling units."""
        return len(self.steps)

    @property
    def positions(self) -> int:
        """Draft positions counted (k)."""
        return max((len(p) for p in self.drafted_per_position), default=0)

    @property
    def mean_acceptance_length(self) -> float:
        """AL over all units: 1 + accepted / steps."""
        steps = math.fsum(self.steps)
        return 1.0 + math.fsum(self.accepted) / steps if steps > 0 else float("nan")

    def _matrix(self, rows: tuple[tuple[float, ...], ...]) -> np.ndarray:
        import numpy as np

        out = np.zeros((self.units, self.positions))
        for u, row in enumerate(rows):
            out[u, : len(row)] = row
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """steps [n], accepted [n], accepted_per_position [n, k], drafted_per_position [n, k] as float arrays."""
        import numpy as np

        return (
            np.asarray(self.steps, dtype=np.float64),
            np.asarray(self.accepted, dtype=np.float64),
            self._matrix(self.accepted_per_position),
            self._matrix(self.drafted_per_position),
        )

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The ``units`` object of a report row (lists per unit; integers stay integers)."""
        return {key: _whole(value) for key, value in data.items()}

    @classmethod
    def concat(cls, parts: Sequence[UnitCounts]) -> UnitCounts:
        """The units of several measurements side by side (e.g. groups measured one after another)."""
        return cls(
            tuple(v for p in parts for v in p.steps),
            tuple(v for p in parts for v in p.accepted),
            tuple(r for p in parts for r in p.accepted_per_position),
            tuple(r for p in parts for r in p.drafted_per_position),
        )


_ENDS = ("estimate", "low", "high")


@dataclass(frozen=True)
class Interval(Record):
    """A point estimate and its two-sided bootstrap interval at ``level`` over ``units`` sampling units."""

    estimate: float
    low: float
    high: float
    level: float = CONFIDENCE
    units: int = 0

    @property
    def defined(self) -> bool:
        """Whether the interval rests on enough units to decide anything (``MIN_UNITS``)."""
        return self.units >= MIN_UNITS and all(math.isfinite(v) for v in (self.estimate, self.low, self.high))

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """``{"estimate", "low", "high", "level", "units"}`` (strict JSON: a non-finite value is null)."""
        return {k: finite_or_none(v) if k in _ENDS else v for k, v in data.items()}

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A null estimate or end reads as NaN."""
        return {k: float("nan") if k in _ENDS and v is None else v for k, v in data.items()}

    def text(self, signed: bool = False, digits: int = 3) -> str:
        """``-0.088 [-0.151, -0.031]`` (the estimate, then the interval)."""
        f = f"{{:+.{digits}f}}" if signed else f"{{:.{digits}f}}"
        return f"{f.format(self.estimate)} [{f.format(self.low)}, {f.format(self.high)}]"


class Bootstrap:
    """One seeded resampling plan over ``units`` units: every statistic computed with it sees the same resamples,
    so differences between measurements of the same units are paired."""

    def __init__(self, units: int, *, resamples: int = RESAMPLES, seed: int = 0, level: float = CONFIDENCE) -> None:
        if units < 1:
            raise ValueError("bootstrap needs at least one unit")
        if not 0 < level < 1:
            raise ValueError(f"confidence level must be in (0, 1), got {level}")
        import numpy as np

        self.units = units
        self.level = level
        rng = np.random.default_rng(seed)
        # How often each unit is drawn in each resample ([B, n]); row b's statistic is a weighted sum.
        self.weights = rng.multinomial(units, np.full(units, 1.0 / units), size=resamples).astype(np.float64)

    def _check(self, counts: UnitCounts) -> None:
        if counts.units != self.units:
            raise ValueError(f"bootstrap planned for {self.units} units, got {counts.units}")

    def al_samples(self, counts: UnitCounts) -> np.ndarray:
        """AL of every resample ([B]); NaN where a resample drew units without steps."""
        self._check(counts)
        import numpy as np

        steps, accepted, _, _ = counts.arrays()
        den = self.weights @ steps
        num = self.weights @ accepted
        return 1.0 + np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)

    def position_samples(self, counts: UnitCounts) -> np.ndarray:
        """Per-position acceptance of every resample ([B, k])."""
        self._check(counts)
        import numpy as np

        _, _, acc, drafted = counts.arrays()
        num = self.weights @ acc
        den = self.weights @ drafted
        return np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)

    def interval(self, estimate: float, samples: np.ndarray) -> Interval:
        """The percentile interval of ``samples`` around ``estimate``."""
        import numpy as np

        finite = samples[np.isfinite(samples)]
        if not finite.size or not math.isfinite(estimate):
            return Interval(estimate, float("nan"), float("nan"), self.level, self.units)
        tail = (1.0 - self.level) / 2.0
        low, high = np.quantile(finite, [tail, 1.0 - tail])
        # Quantiles of an exactly constant statistic can differ from it by one rounding: clamp to the estimate.
        return Interval(estimate, min(float(low), estimate), max(float(high), estimate), self.level, self.units)

    def al(self, counts: UnitCounts) -> Interval:
        """AL of ``counts`` with its interval."""
        return self.interval(counts.mean_acceptance_length, self.al_samples(counts))

    def al_change(self, before: UnitCounts, after: UnitCounts) -> Interval:
        """AL(after) - AL(before) on the same units, paired."""
        estimate = after.mean_acceptance_length - before.mean_acceptance_length
        return self.interval(estimate, self.al_samples(after) - self.al_samples(before))


def decide(interval: Interval, boundary: float) -> str:
    """``above`` when the whole interval lies above ``boundary`` (touching it counts as above), ``below`` when it
    lies below, else ``inconclusive`` (also when the interval rests on fewer than ``MIN_UNITS`` units)."""
    if not interval.defined:
        return "inconclusive"
    if interval.low >= boundary:
        return "above"
    if interval.high < boundary:
        return "below"
    return "inconclusive"


def units_to_settle(interval: Interval, boundary: float) -> int | None:
    """About how many units would make ``decide(interval, boundary)`` conclusive, assuming the estimate stays and
    the interval shrinks as 1/sqrt(n) (never fewer than ``MIN_UNITS``); None when the estimate sits on the boundary
    (no sample size settles it) or the factor exceeds 100x."""
    n = max(interval.units, 1)
    if not all(math.isfinite(v) for v in (interval.estimate, interval.low, interval.high)):
        return None
    margin = abs(interval.estimate - boundary)
    if margin == 0:
        return None
    # the half-width on the boundary's side of the estimate
    half = (interval.estimate - interval.low) if boundary < interval.estimate else (interval.high - interval.estimate)
    if half <= margin:
        return max(MIN_UNITS, n)
    factor = (half / margin) ** 2
    if factor > _SETTLE_CAP:
        return None
    return max(MIN_UNITS, math.ceil(n * factor))


def split_change(
    reference: UnitCounts, candidate: UnitCounts, cross: UnitCounts | None, boundary: float, *, level: float
) -> tuple[Interval, Interval | None, Interval | None, str]:
    """The AL change from ``reference`` to ``candidate`` on the same units, paired, split into the MTP's part (to
    ``cross``: the candidate MTP on the reference target) and the target's part (from ``cross``), with the change's
    ``decide`` against ``boundary``. ``cross`` on other units is left out (parts None)."""
    plan = Bootstrap(reference.units, level=level)
    change = plan.al_change(reference, candidate)
    mtp = target = None
    if cross is not None and cross.units == reference.units:
        mtp, target = plan.al_change(reference, cross), plan.al_change(cross, candidate)
    return change, mtp, target, decide(change, boundary)


def units_to_decide(changes: Sequence[Interval], boundary: float) -> int | None:
    """About how many units would turn undecided changes into a decision, if their estimates hold: the fewest that
    settle one change below ``boundary`` (one below decides), else the most that settle every change above it (above
    needs all of them); None when no practical number does (``units_to_settle``)."""
    below = [units_to_settle(c, boundary) for c in changes if c.estimate < boundary]
    if below:
        known = [n for n in below if n is not None]
        return min(known) if known else None
    above = [units_to_settle(c, boundary) for c in changes]
    return None if any(n is None for n in above) else max(n for n in above if n is not None)


def better_beyond_noise(
    before: UnitCounts, after: UnitCounts, *, margin: float = 0.0, level: float = CONFIDENCE, seed: int = 0
) -> tuple[bool, Interval]:
    """Whether ``after``'s AL exceeds ``before``'s by more than ``margin`` beyond noise (the paired interval's lower
    end above ``margin``), with that interval; both measured on the same units in the same order."""
    change = Bootstrap(before.units, level=level, seed=seed).al_change(before, after)
    return change.defined and change.low > margin, change
