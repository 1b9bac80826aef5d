"""The search's decisions, on the counts alone (torch-free): is a configuration's AL within the budget of the BF16
MTP's, which configurations to confirm, which one to take.

Every measured configuration is compared with the BF16 MTP on the same sequences, paired (``records.evidence``:
``Bootstrap.al_change`` over the prompts, one seeded resampling plan), at every k and sampling setting. It is
**within** the budget where the whole interval of AL(config) - AL(BF16) lies above ``-budget`` (strictly: a
configuration indistinguishable from BF16 does not meet a budget of 0), **beyond** it where the whole interval lies
below, and **inconclusive** otherwise: not taken, with the prompts that would settle it (``units_to_decide``).

The search (``plan``) measures every group alone in every precision once (the sensitivity), predicts a combination's
change as the sum of its groups' changes, and confirms the smallest combinations the prediction keeps within the
budget, built only from groups that were within it alone, one at a time, until one is within it measured (at most
``max_confirm``). The chosen configuration is the smallest measured one within the budget everywhere (the BF16 MTP
when none is).

With ``--heal`` (``search.finalists``) the ``finalists`` are healed before the choice: the configuration chosen so
far and every smaller measured one the engines load that was not beyond the budget, smallest first; the smallest
healed one within the budget is chosen (the BF16 MTP when none is).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from mtpquant.records.evidence import Bootstrap, Interval, UnitCounts, units_to_decide
from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.space import Assignment, MtpSpace

__all__ = [
    "Judged",
    "KChange",
    "SettingChange",
    "finalists",
    "judge",
    "next_candidates",
    "pareto_front",
    "predicted_change",
]

Verdict = Literal["within", "beyond", "inconclusive", "baseline"]
# why a configuration was measured: the BF16 MTP, a group alone, a combination confirmed, a finalist healed (--heal)
Role = Literal["baseline", "sensitivity", "confirm", "healed"]


@dataclass(frozen=True)
class KChange(Record):
    """One k: the configuration's AL with its interval, its change from the BF16 MTP (paired), the verdict."""

    k: int
    al: Interval
    change: Interval | None  # None: the BF16 MTP itself
    verdict: Verdict


@dataclass(frozen=True)
class SettingChange(Record):
    """Every k under one sampling setting."""

    sampling: SamplingSettings
    by_k: tuple[KChange, ...]


@dataclass(frozen=True)
class Judged(Record):
    """One measured configuration: its bytes, how the output declares it, why it was measured, every change."""

    assignment: Assignment
    nbytes: int
    declaration: str  # plain | mixed | none (a group alone the engines do not load: measured, never chosen)
    role: Role
    by_sampling: tuple[SettingChange, ...]
    units_to_settle: int | None = None  # inconclusive: about how many prompts would decide it

    @property
    def verdict(self) -> Verdict:
        """``within`` at every k and setting; ``beyond`` if any change is; else ``inconclusive``."""
        verdicts = {c.verdict for s in self.by_sampling for c in s.by_k}
        if verdicts == {"baseline"}:
            return "baseline"
        if "beyond" in verdicts:
            return "beyond"
        return "within" if verdicts == {"within"} else "inconclusive"

    @property
    def loads(self) -> bool:
        """Whether the chosen engines load it (a group alone may not: SGLang's whole-layer rule, vLLM's routed experts
        resolved by a quantized shared expert)."""
        return self.declaration != "none"

    @property
    def accepted(self) -> bool:
        """Whether it may be taken: the BF16 MTP, or within the budget everywhere, and loadable."""
        return self.loads and self.verdict in ("baseline", "within")

    def changes(self) -> list[Interval]:
        """Every (setting, k) change interval."""
        return [c.change for s in self.by_sampling for c in s.by_k if c.change is not None]

    @property
    def worst(self) -> float:
        """The largest AL loss estimated over every k and setting (0 for the BF16 MTP; negative: a gain)."""
        return max((-c.estimate for c in self.changes()), default=0.0)


def judge(
    assignment: Assignment,
    base: Sequence[Sequence[UnitCounts]],
    counts: Sequence[Sequence[UnitCounts]],
    settings: Sequence[SamplingSettings],
    *,
    space: MtpSpace,
    role: Role,
    budget: float,
    level: float,
    seed: int,
) -> Judged:
    """``counts`` (per setting, per k) of ``assignment`` against the BF16 MTP's ``base`` on the same prompts."""
    boundary = -budget
    out = []
    for s, b_by_k, c_by_k in zip(settings, base, counts, strict=True):
        rows = []
        for k, (b, c) in enumerate(zip(b_by_k, c_by_k, strict=True), 1):
            plan = Bootstrap(b.units, level=level, seed=seed)
            if role == "baseline":
                rows.append(KChange(k, plan.al(c), None, "baseline"))
                continue
            change = plan.al_change(b, c)
            verdict: Verdict = "inconclusive"
            if change.defined and change.low > boundary:
                verdict = "within"
            elif change.defined and change.high < boundary:
                verdict = "beyond"
            rows.append(KChange(k, plan.al(c), change, verdict))
        out.append(SettingChange(s, tuple(rows)))
    declaration = space.declaration(assignment).kind or "none"
    judged = Judged(assignment, space.nbytes(assignment), declaration, role, tuple(out))
    if judged.verdict == "inconclusive":
        settle = units_to_decide(judged.changes(), boundary)
        judged = Judged(judged.assignment, judged.nbytes, judged.declaration, role, judged.by_sampling, settle)
    return judged


def predicted_change(assignment: Assignment, singles: dict[tuple[str, str], Judged]) -> list[float]:
    """The change predicted for ``assignment`` at every (setting, k): the sum of its groups' changes measured alone
    (NaN where a group was not measured alone)."""
    parts = [singles.get((g, p)) for g, p in zip(assignment.groups, assignment.precisions) if p != "bf16"]
    if not parts:
        return []
    if any(p is None for p in parts):
        return [math.nan]
    sums: list[float] = []
    for p in parts:
        assert p is not None
        estimates = [c.estimate for c in p.changes()]
        sums = estimates if not sums else [a + b for a, b in zip(sums, estimates, strict=True)]
    return sums


def next_candidates(
    space: MtpSpace, singles: dict[tuple[str, str], Judged], budget: float, below: int
) -> list[Assignment]:
    """The combinations worth confirming, smallest first: loadable, smaller than ``below`` bytes, of two groups or
    more, each of its groups within the budget alone, and the predicted change within it at every k and setting."""
    ok = {key for key, j in singles.items() if j.verdict == "within"}
    out = []
    options = [("bf16", *(p for p in space.precisions if (g, p) in ok)) for g in space.group_keys]
    for combo in itertools.product(*options):
        a = Assignment(space.group_keys, combo)  # type: ignore[arg-type]
        if len(a.changed()) < 2 or space.nbytes(a) >= below:
            continue
        predicted = predicted_change(a, singles)
        if predicted and all(math.isfinite(x) and x > -budget for x in predicted):
            out.append(a)
    out = space.loadable(out)
    return sorted(out, key=lambda a: (space.nbytes(a), -min(predicted_change(a, singles))))


def finalists(judged: Sequence[Judged], best: Judged, limit: int) -> list[Assignment]:
    """The configurations healed before the choice (``--heal``): ``best`` (the choice without heal) when quantized,
    then the smaller measured configurations the engines load that were within the budget or inconclusive (heal may
    bring them within), smallest first; at most ``limit``, ``best`` always among them."""
    smaller = sorted(
        (j for j in judged if j.loads and j.role != "baseline" and j.nbytes < best.nbytes
         and j.verdict in ("within", "inconclusive")),
        key=lambda j: (j.nbytes, j.worst),
    )  # fmt: skip
    chosen = [] if best.assignment.all_bf16 else [best.assignment]
    for j in smaller:
        if len(chosen) >= limit:
            break
        if j.assignment not in chosen:
            chosen.append(j.assignment)
    return sorted(chosen, key=lambda a: next(j.nbytes for j in judged if j.assignment == a))


def pareto_front(judged: Sequence[Judged]) -> list[int]:
    """Indices of the measured configurations the engines load that no other beats in both bytes and worst AL loss
    (fewer bytes and no larger loss, or no more bytes and a smaller loss)."""
    front = []
    for i, a in enumerate(judged):
        dominated = any(
            (b.nbytes <= a.nbytes and b.worst <= a.worst) and (b.nbytes < a.nbytes or b.worst < a.worst)
            for j, b in enumerate(judged)
            if j != i and b.loads
        )
        if a.loads and not dominated:
            front.append(i)
    return front
