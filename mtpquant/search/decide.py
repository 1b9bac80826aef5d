"""The search's decisions, on the counts alone (torch-free): is a configuration's AL within the budget of the BF16
MTP's, which configurations to confirm, which one to take (``search``: the whole procedure, given a way to count).

Every measured configuration is compared with the BF16 MTP on the same sequences, paired (``records.evidence``:
``Bootstrap.al_change`` over the prompts, one seeded resampling plan), at every k and sampling setting. It is
**within** the budget where the whole interval of AL(config) - AL(BF16) lies above ``-budget``, **beyond** it where
the whole interval lies below, and **inconclusive** otherwise.

Selection and confirmation use disjoint prompts. **Selection** (its own prompts) measures every group alone in every
precision once (the sensitivity), predicts a combination's change as the sum of its groups' changes, and measures the
smallest combinations the prediction keeps within the budget (at most ``max_confirm``). Its verdicts only screen: the
**finalists** are the smallest loadable configurations within the budget on the selection prompts (with ``--heal``
also the inconclusive ones, healed before they are confirmed), at most ``finalists``. **Confirmation** measures the
BF16 MTP and every finalist again on held-out prompts selection never saw, and tests each finalist's null hypothesis
"it loses ``budget`` AL or more at some k and setting" with Holm's step-down procedure at ``alpha = 1 - confidence``
over the finalists (the family-wise error: the chance that any finalist which truly loses the budget is accepted is
at most ``alpha``). A finalist's p-value is the largest over k and settings of twice the share of bootstrap resamples
of its change at or below ``-budget`` (an intersection-union test: every k must pass); it is accepted where Holm
rejects its null hypothesis and its interval at Holm's adjusted level lies above ``-budget``. The chosen
configuration is the smallest accepted finalist (the BF16 MTP when none is), and every number the report and card
publish for it is the confirmation's.

A budget of 0 is the BF16 MTP, byte for byte: no quantized configuration is measured.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from mtpquant.formats.kinds import quantizes
from mtpquant.records.evidence import CONFIDENCE, MIN_UNITS, Bootstrap, Interval, UnitCounts, units_to_decide
from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.settings import SearchSettings
from mtpquant.search.space import Assignment, MtpSpace

__all__ = [
    "Confirmation",
    "Confirmed",
    "Counter",
    "Judged",
    "KChange",
    "Searched",
    "SettingChange",
    "finalists",
    "holm",
    "judge",
    "next_candidates",
    "p_value",
    "pareto_front",
    "predicted_change",
    "search",
]

Verdict = Literal["within", "beyond", "inconclusive", "baseline"]
# why a configuration was measured: the BF16 MTP, a group alone, a combination (selection), a finalist confirmed on the
# held-out prompts, a finalist healed and confirmed (--heal)
Role = Literal["baseline", "sensitivity", "confirm", "finalist", "healed"]
Phase = Literal["selection", "confirmation"]
HOLM = "Holm"

log = logging.getLogger(__name__)


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
    phase: Phase = "selection"  # which prompts measured it
    confirmed: bool | None = None  # a finalist on the held-out prompts: whether Holm's procedure accepted it

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
        """Whether it may be taken: the BF16 MTP, or within the budget everywhere and loadable (a finalist on the
        held-out prompts: and accepted by Holm's procedure)."""
        return self.loads and (self.verdict == "baseline" or (self.verdict == "within" and self.confirmed is not False))

    def changes(self) -> list[Interval]:
        """Every (setting, k) change interval."""
        return [c.change for s in self.by_sampling for c in s.by_k if c.change is not None]

    @property
    def worst(self) -> float:
        """The largest AL loss estimated over every k and setting (0 for the BF16 MTP; negative: a gain)."""
        return max((-c.estimate for c in self.changes()), default=0.0)


@functools.lru_cache(maxsize=64)
def _plan(units: int, level: float, seed: int) -> Bootstrap:
    """One seeded resampling plan per (units, level, seed), drawn once (every comparison on the same prompts shares
    it: the pairing)."""
    return Bootstrap(units, level=level, seed=seed)


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
    phase: Phase = "selection",
) -> Judged:
    """``counts`` (per setting, per k) of ``assignment`` against the BF16 MTP's ``base`` on the same prompts, with
    intervals at ``level``."""
    boundary = -budget
    out = []
    for s, b_by_k, c_by_k in zip(settings, base, counts, strict=True):
        rows = []
        for k, (b, c) in enumerate(zip(b_by_k, c_by_k, strict=True), 1):
            plan = _plan(b.units, level, seed)
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
    judged = Judged(assignment, space.nbytes(assignment), declaration, role, tuple(out), phase=phase)
    if judged.verdict == "inconclusive":
        judged = dataclasses.replace(judged, units_to_settle=units_to_decide(judged.changes(), boundary))
    return judged


def p_value(
    base: Sequence[Sequence[UnitCounts]], counts: Sequence[Sequence[UnitCounts]], *, budget: float, seed: int
) -> float:
    """The bootstrap p-value of "``counts`` lose ``budget`` AL or more against ``base`` at some k and setting": the
    largest over (setting, k) of twice the share of paired resamples whose change lies at or below ``-budget`` (the
    smallest level whose two-sided percentile interval lies above ``-budget``); 1 where a change is undefined."""
    import numpy as np

    worst = 0.0
    for b_by_k, c_by_k in zip(base, counts, strict=True):
        for b, c in zip(b_by_k, c_by_k, strict=True):
            if b.units < MIN_UNITS:
                return 1.0
            plan = _plan(b.units, CONFIDENCE, seed)
            samples = plan.al_samples(c) - plan.al_samples(b)
            if not np.isfinite(samples).all():
                return 1.0
            worst = max(worst, min(1.0, 2.0 * float(np.mean(samples <= -budget))))
    return worst


def holm(p_values: Sequence[float], alpha: float) -> list[tuple[float, bool]]:
    """Holm's step-down procedure: for each hypothesis (in the given order) the level it is tested at (``alpha /
    (m - rank)``, rank by ascending p-value) and whether it is rejected (every one of smaller p-value rejected too)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: (p_values[i], i))
    out = [(alpha, False)] * m
    going = True
    for rank, i in enumerate(order):
        level = alpha / (m - rank)
        going = going and p_values[i] <= level
        out[i] = (level, going)
    return out


def predicted_change(assignment: Assignment, singles: dict[tuple[str, str], Judged]) -> list[float]:
    """The change predicted for ``assignment`` at every (setting, k): the sum of its groups' changes measured alone
    (NaN where a group was not measured alone)."""
    parts = [singles.get((g, p)) for g, p in zip(assignment.groups, assignment.precisions) if quantizes(p)]
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


def finalists(judged: Sequence[Judged], limit: int, *, heal: bool = False) -> list[Assignment]:
    """The configurations confirmed on the held-out prompts: the smallest quantized ones the engines load that were
    within the budget on the selection prompts (``heal``: or inconclusive, which heal may bring within), smallest
    first (then by the smaller loss), at most ``limit``."""
    verdicts = ("within", "inconclusive") if heal else ("within",)
    pool = sorted(
        (j for j in judged if j.loads and j.role != "baseline" and j.phase == "selection" and j.verdict in verdicts),
        key=lambda j: (j.nbytes, j.worst),
    )
    out: list[Assignment] = []
    for j in pool:
        if len(out) < limit and j.assignment not in out:
            out.append(j.assignment)
    return out


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


@dataclass(frozen=True)
class Confirmed(Record):
    """One finalist confirmed on the held-out prompts: its row in ``evaluated``, its p-value, the level Holm tested it
    at (its interval's level is ``1 - level``) and whether it was accepted."""

    assignment: Assignment
    row: int
    p_value: float
    level: float
    accepted: bool


@dataclass(frozen=True)
class Confirmation(Record):
    """How the finalists were confirmed: the family-wise method, its error rate ``alpha``, each finalist."""

    method: str
    alpha: float
    finalists: tuple[Confirmed, ...] = ()


@dataclass(frozen=True)
class Searched:
    """What ``search`` measured (selection rows, then confirmation rows) and chose (an index into ``judged``)."""

    judged: tuple[Judged, ...]
    chosen: int
    confirmation: Confirmation


class Counter(Protocol):
    """Counts of a configuration's MTP on one set of prompts: per sampling setting, per k (``role`` ``healed``: the
    finalist healed)."""

    def __call__(self, assignment: Assignment, phase: Phase, role: Role, /) -> Sequence[Sequence[UnitCounts]]: ...


def search(
    space: MtpSpace,
    settings: SearchSettings,
    count: Counter,
    *,
    heal: Callable[[list[Assignment]], None] | None = None,
) -> Searched:
    """The whole search (see the module docstring) over ``space``, measuring with ``count``; ``heal`` (``--heal``)
    is handed the finalists before they are confirmed, and ``count`` then measures them healed."""
    sampling = settings.sampling
    judged: list[Judged] = []
    bases: dict[Phase, Sequence[Sequence[UnitCounts]]] = {}
    alpha = 1.0 - settings.confidence

    def add(a: Assignment, role: Role, phase: Phase, units: Sequence[Sequence[UnitCounts]], level: float) -> Judged:
        if role == "baseline":
            bases[phase] = units
        j = judge(a, bases[phase], units, sampling, space=space, role=role, budget=settings.budget, level=level,
                  seed=settings.seed, phase=phase)  # fmt: skip
        judged.append(j)
        log.info("search (%s): %s%s: %s, %s", phase, a.label, " (healed)" if role == "healed" else "", j.nbytes,
                 j.verdict)  # fmt: skip
        return j

    def measure(a: Assignment, role: Role, phase: Phase = "selection") -> Judged:
        return add(a, role, phase, count(a, phase, role), settings.confidence)

    if settings.budget == 0:  # the BF16 MTP, byte for byte; measured on the held-out prompts for the report
        measure(space.bf16, "baseline", "confirmation")
        return Searched(tuple(judged), 0, Confirmation(HOLM, alpha))
    measure(space.bf16, "baseline")
    singles: dict[tuple[str, str], Judged] = {}
    for key in space.group_keys:  # every group alone, loadable or not: what quantizing it costs
        for p in space.precisions:
            if quantizes(p) and space.refusal(key, p) is None:
                singles[(key, p)] = measure(space.bf16.with_group(key, p), "sensitivity")
    best = min(j.nbytes for j in judged if j.accepted)
    for _ in range(settings.max_confirm):
        seen = {j.assignment for j in judged}
        todo = [a for a in next_candidates(space, singles, settings.budget, best) if a not in seen]
        if not todo:
            break
        j = measure(todo[0], "confirm")
        if j.accepted and j.nbytes < best:
            break
    finals = finalists(judged, settings.finalists, heal=heal is not None)
    if heal is not None and finals:
        heal(finals)
    base = measure(space.bf16, "baseline", "confirmation")
    role: Role = "healed" if heal is not None else "finalist"
    units = [count(a, "confirmation", role) for a in finals]
    ps = [p_value(bases["confirmation"], u, budget=settings.budget, seed=settings.seed) for u in units]
    confirmed = []
    for a, u, pv, (level, rejected) in zip(finals, units, ps, holm(ps, alpha), strict=True):
        j = add(a, role, "confirmation", u, 1.0 - level)
        ok = rejected and j.verdict == "within" and j.loads
        judged[-1] = dataclasses.replace(j, confirmed=ok)
        confirmed.append(Confirmed(a, len(judged) - 1, pv, level, ok))
    accepted = [c.row for c in confirmed if c.accepted]
    chosen = min(accepted, key=lambda i: (judged[i].nbytes, judged[i].worst)) if accepted else judged.index(base)
    return Searched(tuple(judged), chosen, Confirmation(HOLM, alpha, tuple(confirmed)))
