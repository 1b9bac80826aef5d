"""The search's decisions checked against truths of their own, without a model (``search.decide``).

The candidates are the trained tiny Qwen3.5's MTP configurations (its header: three groups, BF16 / FP8 / NVFP4); a
simulated counter draws each prompt's acceptance from rates the test sets, so every configuration's true AL loss is
known. The oracles: Holm's procedure on a textbook example; a budget of 0 measures nothing quantized and keeps BF16;
counts identical to the BF16 MTP's are accepted at any budget above 0; a configuration that truly loses far more than
the budget is never chosen; and over 400 seeded searches whose candidates all truly lose just more than the budget
the chosen MTP truly exceeds the budget at most at the stated rate (alpha = 1 - confidence, plus a
binomial margin), where choosing on the selection prompts alone does not keep it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.records.evidence import UnitCounts
from mtpquant.search.decide import Phase, Role, Searched, holm, p_value, search
from mtpquant.search.settings import SearchSettings
from mtpquant.search.space import Assignment, MtpSpace
from mtpquant.synth.train import TINY_MTP_ASSETS

pytestmark = pytest.mark.dev

RATES = (0.8, 0.7, 0.6)  # the BF16 MTP's conditional acceptance at draft positions 1..3 on an average prompt
STEPS = 24  # verification steps per prompt


@pytest.fixture(scope="module")
def space() -> MtpSpace:
    ckpt = Checkpoint.open(TINY_MTP_ASSETS["qwen3_5"])
    return MtpSpace(ckpt.spec.family, {e.name: e for e in ckpt.mtp_tensors()})


def true_al(k: int, factor: float) -> float:
    """AL at k of an MTP whose conditional acceptance is ``RATES`` scaled by ``factor`` (an average prompt)."""
    al, chain = 1.0, 1.0
    for i in range(k):
        chain *= RATES[i] * factor
        al += chain
    return al


def factor_for_loss(loss: float, k: int) -> float:
    """The scale of ``RATES`` that loses ``loss`` AL at k against the BF16 MTP (bisection; the loss grows with k, so
    the loss at the largest k is the worst)."""
    lo, hi = 0.0, 1.0
    target = true_al(k, 1.0) - loss
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if true_al(k, mid) < target else (lo, mid)
    return (lo + hi) / 2


def simulated(
    losses: Callable[[Assignment], float], k: int, seed: int, units: dict[str, int]
) -> Callable[[Assignment, Phase, Role], Sequence[Sequence[UnitCounts]]]:
    """A counter: each prompt (its own difficulty, the same for every configuration: the pairing) drafts ``STEPS``
    steps; draft i is accepted after the ones before it with probability RATES[i] x difficulty x the configuration's
    factor, drawn afresh for every configuration and set of prompts."""
    rng = np.random.default_rng(seed)
    difficulty = {phase: rng.uniform(0.75, 1.15, size=n) for phase, n in units.items()}
    calls = iter(range(10**6))

    def count(a: Assignment, phase: Phase, role: Role) -> Sequence[Sequence[UnitCounts]]:
        del role
        draw = np.random.default_rng([seed, next(calls)])
        f = factor_for_loss(losses(a), k)
        d = difficulty[phase]
        n = d.size
        rates = np.clip(np.outer(d, np.asarray(RATES[:k]) * f), 0.0, 1.0)  # [n, k]
        ok = draw.random((n, STEPS, k)) < rates[:, None, :]
        length = np.cumprod(ok, axis=2).sum(axis=2)  # [n, steps]: leading accepted drafts
        by_k = []
        for kk in range(1, k + 1):
            lk = np.minimum(length, kk)
            per = [tuple(float((lk[u] >= i + 1).sum()) for i in range(kk)) for u in range(n)]
            by_k.append(UnitCounts(tuple([float(STEPS)] * n), tuple(float(x) for x in lk.sum(axis=1)), tuple(per),
                                   tuple((float(STEPS),) * kk for _ in range(n))))  # fmt: skip
        return (tuple(by_k),)

    return count


def additive(per_group: dict[tuple[str, str], float]) -> Callable[[Assignment], float]:
    """A configuration's true loss: the sum of its quantized groups' losses."""
    return lambda a: sum(per_group[(g, p)] for g, p in zip(a.groups, a.precisions) if p != "bf16")


def test_holm_on_a_textbook_example() -> None:
    """p = (0.01, 0.04, 0.03, 0.005), alpha 0.05: sorted 0.005 <= 0.0125, 0.01 <= 0.0167, 0.03 > 0.025: the first
    two rejected, the rest not (the step-down stops)."""
    out = holm([0.01, 0.04, 0.03, 0.005], 0.05)
    assert [r for _, r in out] == [True, False, False, True]
    assert [lv for lv, _ in out] == pytest.approx([0.05 / 3, 0.05 / 1, 0.05 / 2, 0.05 / 4])


def test_identical_counts_have_p_value_zero_and_far_worse_one() -> None:
    counts = simulated(lambda a: 0.0, 3, 0, {"confirmation": 32})
    same = counts(Assignment.of({"input": "bf16"}), "confirmation", "finalist")
    assert p_value(same, same, budget=1e-6, seed=0) == 0.0
    worse = simulated(lambda a: 0.0 if a.all_bf16 else 1.2, 3, 0, {"confirmation": 32})
    base, bad = worse(Assignment.of({"input": "bf16"}), "confirmation", "baseline"), worse(
        Assignment.of({"input": "fp8"}), "confirmation", "finalist")
    assert p_value(base, bad, budget=0.5, seed=0) == 1.0


def test_a_budget_of_zero_measures_no_quantized_configuration(space: MtpSpace) -> None:
    calls: list[tuple[Assignment, str]] = []
    inner = simulated(lambda a: 0.0, 3, 1, {"selection": 16, "confirmation": 16})

    def count(a: Assignment, phase: Phase, role: Role) -> Sequence[Sequence[UnitCounts]]:
        calls.append((a, phase))
        return inner(a, phase, role)

    found = search(space, SearchSettings(budget=0.0), count)
    assert calls == [(space.bf16, "confirmation")]
    assert found.judged[found.chosen].assignment.all_bf16 and not found.confirmation.finalists


@pytest.mark.parametrize("budget", [1e-6, 0.05, 1.0])
def test_a_candidate_identical_to_bf16_is_accepted_at_any_budget(space: MtpSpace, budget: float) -> None:
    """Every configuration counts exactly what the BF16 MTP counts (the same draws: what a byte-identical MTP gives):
    the smallest loadable one is confirmed and chosen, whatever the budget above 0."""
    seed = 2

    def count(a: Assignment, phase: Phase, role: Role) -> Sequence[Sequence[UnitCounts]]:
        return simulated(lambda a: 0.0, 3, seed, {"selection": 16, "confirmation": 16})(space.bf16, phase, role)

    found = search(space, SearchSettings(budget=budget), count)
    chosen = found.judged[found.chosen]
    assert chosen.phase == "confirmation" and chosen.confirmed
    assert chosen.nbytes == min(space.nbytes(a) for a in space.configurations())


@pytest.mark.parametrize("budget", [0.05, 0.3, 0.8])
def test_a_far_worse_group_is_never_chosen(space: MtpSpace, budget: float) -> None:
    """The attention group in either precision truly loses 1.5 AL at k = 3 (of 2.4: a damaged MTP); the others lose
    nothing: no configuration with a quantized attention is chosen (and at a budget the noise cannot hide, one
    without is)."""
    truth = {(g, p): (1.5 if g == "attention" else 0.0) for g in space.group_keys for p in ("fp8", "nvfp4")}
    found = search(space, SearchSettings(budget=budget, num_prompts=24, confirm_prompts=24),
                   simulated(additive(truth), 3, 3, {"selection": 24, "confirmation": 24}))  # fmt: skip
    chosen = found.judged[found.chosen]
    assert chosen.assignment["attention"] == "bf16"
    assert budget < 0.5 or not chosen.assignment.all_bf16


def _naive(found: Searched) -> Assignment:
    """What choosing on the selection prompts alone would take: the smallest configuration accepted there."""
    rows = [j for j in found.judged if j.phase == "selection" and j.accepted]
    return min(rows, key=lambda j: j.nbytes).assignment


@pytest.mark.slow
def test_the_chosen_mtp_truly_exceeds_the_budget_at_most_at_the_stated_rate(space: MtpSpace) -> None:
    """400 seeded searches in which every quantized group, in either precision, truly loses just more than the budget
    (0.0501 AL at k = 3 of 0.05; a combination more): every quantized choice is wrong, and each looks within the
    budget on a lucky draw. The share of searches that choose one is at most alpha + 3 binomial standard errors;
    choosing on the selection prompts alone (no held-out confirmation, no correction) exceeds that bound on the same
    draws, so this test fails for the rule it replaced."""
    settings = SearchSettings(budget=0.05, num_prompts=24, confirm_prompts=24)
    loss = additive({(g, p): settings.budget + 1e-4 for g in space.group_keys for p in ("fp8", "nvfp4")})
    seeds = 400
    alpha = 1 - settings.confidence
    bound = alpha + 3 * math.sqrt(alpha * (1 - alpha) / seeds)
    wrong = naive_wrong = confirmed = 0
    for seed in range(seeds):
        found = search(space, settings, simulated(loss, 3, seed, {"selection": 24, "confirmation": 24}))
        wrong += loss(found.judged[found.chosen].assignment) > settings.budget
        naive_wrong += loss(_naive(found)) > settings.budget
        confirmed += bool(found.confirmation.finalists)
    assert confirmed >= seeds // 20, confirmed  # the confirmation was put to the test
    assert wrong / seeds <= bound, (wrong, naive_wrong)
    assert wrong <= alpha * seeds, (wrong, naive_wrong)  # the stated family-wise error itself (measured: 0 of 400)
    print(f"\nsimulated searches: {wrong}/{seeds} chose a configuration beyond the budget (alpha {alpha:.2f}); "
          f"the selection alone: {naive_wrong}/{seeds}; a finalist confirmed in {confirmed}")
    assert naive_wrong / seeds > bound, (wrong, naive_wrong)  # the test can fail: the old rule does
