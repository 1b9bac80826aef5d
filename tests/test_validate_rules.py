"""The verification rules (``validate.rules``, ``engine.sampling``) against direct computations on hand-made
distributions, and the sampled walk (``replay.walk``) on hand-made terms."""

from __future__ import annotations

import math

import pytest
import torch

from mtpquant.measure.replay import walk
from mtpquant.measure.rules import draft_probs, target_probs, terms
from mtpquant.records import sampling
from mtpquant.records.sampling import ARGMAX_DRAFT, PROBABILISTIC, RULES, STRICT, SamplingSettings

pytestmark = pytest.mark.dev

T08 = SamplingSettings(temperature=0.8)


def _close(a: torch.Tensor, b: list[float] | float) -> None:
    assert a.tolist() == pytest.approx(b, abs=1e-6)


def test_target_probs_follow_vllm_temperature_top_k_top_p() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0])
    _close(target_probs(logits, SamplingSettings()), [1, 0, 0, 0, 0])  # greedy: one-hot argmax
    scaled = [math.exp(v / 0.5) for v in logits.tolist()]
    _close(target_probs(logits, SamplingSettings(0.5)), [v / sum(scaled) for v in scaled])
    # top-k 2 keeps every logit at or above the 2nd largest: the tie at 1.0 keeps both
    kept = [math.exp(v) for v in (2.0, 1.0, 1.0)]
    _close(target_probs(logits, SamplingSettings(1.0, top_k=2)), [v / sum(kept) for v in kept] + [0, 0])
    # top-p 0.8 on distinct logits: drop the least likely tokens while the ascending cumulative probability of the
    # plain softmax stays <= 1 - 0.8 = 0.2 (0.013, 0.048, 0.143 dropped; 0.299 kept), computed directly:
    distinct = torch.tensor([2.0, 0.5, 0.0, -1.0, -2.0])
    p = [math.exp(v) for v in distinct.tolist()]
    p = [v / sum(p) for v in p]
    order = sorted(range(5), key=lambda i: p[i])
    cum, keep = 0.0, set(range(5))
    for i in order[:-1]:
        cum += p[i]
        if cum <= 1 - 0.8:
            keep.discard(i)
    assert keep == {0, 1}  # the two most likely tokens: 0.701 + 0.156
    kept_mass = sum(p[i] for i in keep)
    expected = [p[i] / kept_mass if i in keep else 0 for i in range(5)]
    _close(target_probs(distinct, SamplingSettings(1.0, top_p=0.8)), expected)
    # a tiny top-p still keeps the most likely token
    _close(target_probs(logits, SamplingSettings(1.0, top_p=0.01)), [1, 0, 0, 0, 0])


def test_draft_probs_per_rule() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0])
    _close(draft_probs(logits, T08, "vllm"), [0, 1, 0])  # vLLM's default: the argmax, one-hot
    soft = [math.exp(v / 0.8) for v in logits.tolist()]
    for rule in ("probabilistic", "strict"):  # sampled drafts: the temperature only (no top-k/top-p)
        _close(draft_probs(logits, SamplingSettings(0.8, top_p=0.5, top_k=1), rule), [v / sum(soft) for v in soft])
    _close(draft_probs(logits, SamplingSettings(), "probabilistic"), [0, 1, 0])  # greedy requests: argmax


def test_the_rules_are_records_their_cli_spelling_selects() -> None:
    """``--rule vllm`` (the spelling users type and records store, unchanged) selects the argmax-draft record; the
    record's properties, not a spelling, decide how drafts are verified."""
    assert tuple(RULES) == ("vllm", "probabilistic", "strict")
    assert tuple(map(sampling.rule, RULES)) == (ARGMAX_DRAFT, PROBABILISTIC, STRICT)
    assert ARGMAX_DRAFT.name == "argmax-draft" and ARGMAX_DRAFT.flag == "vllm"
    assert [(r.sampled_draft, r.exact_match) for r in RULES.values()] == [(False, False), (True, False), (True, True)]
    with pytest.raises(ValueError, match="unknown rule 'argmax-draft'; choose one of vllm, probabilistic, strict"):
        sampling.rule("argmax-draft")  # the record's name is not a spelling --rule takes


P = torch.tensor([0.5, 0.3, 0.2])
Q_LOGITS = torch.log(torch.tensor([0.2, 0.6, 0.2])) * 0.8  # at T=0.8 the draft distribution is [0.2, 0.6, 0.2]
Q = [0.2, 0.6, 0.2]


@pytest.mark.parametrize("x", [0, 1, 2])
def test_rule_terms_equal_the_direct_computation(x: int) -> None:
    xs = torch.tensor(x)
    t = terms(P, Q_LOGITS, xs, T08, "vllm")  # argmax draft d = 1: accepted with p(1); given x, iff x == 1
    assert t.draft.item() == 1
    _close(t.expected, 0.3)
    _close(t.posterior, 1.0 if x == 1 else 0.0)
    t = terms(P, Q_LOGITS, xs, T08, "probabilistic")  # sum(min(p, q)); min(p(x), q(x)) / p(x)
    _close(t.expected, 0.2 + 0.3 + 0.2)
    _close(t.posterior, min(P[x].item(), Q[x]) / P[x].item())
    t = terms(P, Q_LOGITS, xs, T08, "strict")  # sum(p * q); q(x)
    _close(t.expected, 0.5 * 0.2 + 0.3 * 0.6 + 0.2 * 0.2)
    _close(t.posterior, Q[x])
    for rule in RULES:  # greedy requests: the draft is accepted iff it is the target's argmax, whatever the rule
        g = terms(torch.tensor([0.0, 1.0, 0.0]), Q_LOGITS, xs, SamplingSettings(), rule)
        _close(g.expected, 1.0)
        _close(g.posterior, 1.0 if x == 1 else 0.0)


@pytest.mark.parametrize("rule", ["vllm", "probabilistic", "strict"])
def test_the_rules_as_the_engines_run_them(rule: str) -> None:
    """Simulate one draft position the way the engine verifies it; the rate of acceptance, the posterior given the
    emitted token, and (for the lossless rules) the emitted distribution match ``terms``."""
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    q = torch.tensor(Q)
    if RULES[rule].sampled_draft:
        d = torch.multinomial(q, n, replacement=True, generator=gen)
    else:
        d = torch.full((n,), 1)
    u = torch.rand(n, generator=gen)
    if rule == "strict":
        x_target = torch.multinomial(P, n, replacement=True, generator=gen)
        accepted = d == x_target
        emitted = x_target
    else:
        q_d = q[d] if rule == "probabilistic" else torch.ones(n)
        accepted = u <= P[d] / q_d
        subtract = q[None, :] if rule == "probabilistic" else torch.nn.functional.one_hot(d, 3).float()
        residual = torch.clamp(P[None, :] - subtract, min=0)
        recovered = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
        emitted = torch.where(accepted, d, recovered)
    expected = terms(P, Q_LOGITS, torch.tensor(0), T08, rule).expected.item()
    assert accepted.double().mean().item() == pytest.approx(expected, abs=0.005)
    for x in range(3):
        here = emitted == x
        posterior = terms(P, Q_LOGITS, torch.tensor(x), T08, rule).posterior.item()
        assert accepted[here].double().mean().item() == pytest.approx(posterior, abs=0.01)
        assert here.double().mean().item() == pytest.approx(P[x].item(), abs=0.005)  # every rule emits p


@pytest.mark.parametrize("rule", ["vllm", "probabilistic", "strict"])
def test_two_positions_expectation_is_exact(rule: str) -> None:
    """P(draft 1 and draft 2 accepted) = sum over emitted token v of p1(v) * w1(v) * beta2(v): the walk's estimator
    (posterior of the position before times expected of the position after) in expectation, by enumeration."""
    p1 = P
    q1_logits = Q_LOGITS
    p2 = {0: torch.tensor([0.1, 0.1, 0.8]), 1: torch.tensor([0.7, 0.2, 0.1]), 2: torch.tensor([1 / 3] * 3)}
    q2 = {0: [0.1, 0.2, 0.7], 1: [0.6, 0.3, 0.1], 2: [0.5, 0.25, 0.25]}
    estimator = 0.0
    for v in range(3):
        w1 = terms(p1, q1_logits, torch.tensor(v), T08, rule).posterior.item()
        beta2 = terms(p2[v], torch.log(torch.tensor(q2[v])) * 0.8, torch.tensor(0), T08, rule).expected.item()
        estimator += p1[v].item() * w1 * beta2
    # the direct computation: which token the accepted first draft is, then the second position's acceptance
    q1 = Q
    if rule == "vllm":
        d1 = 1
        d2 = max(range(3), key=lambda i: q2[d1][i])
        direct = p1[d1].item() * p2[d1][d2].item()
    elif rule == "probabilistic":
        direct = sum(
            min(p1[v].item(), q1[v]) * sum(min(a, b) for a, b in zip(p2[v].tolist(), q2[v])) for v in range(3)
        )
    else:
        direct = sum(p1[v].item() * q1[v] * sum(a * b for a, b in zip(p2[v].tolist(), q2[v])) for v in range(3))
    assert estimator == pytest.approx(direct, abs=1e-6)


def test_walk_on_hand_made_terms() -> None:
    # prompt of 2 tokens, sequence of 8: steps can draft from rows 1..5 (remaining = 8 - t - 2)
    expected = torch.tensor([[0.9, 0.8], [0.5, 0.5], [0.7, 0.6], [0.4, 0.3], [0.2, 0.1]])
    posterior = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])  # 0/1: the vllm rule
    steps = walk(8, 2, 2, expected, posterior, torch.Generator().manual_seed(0))
    # row 1: accepts 1 (posterior 1 then 0) -> row 3: accepts 2 -> row 6: remaining 0, stop
    assert [(s.drafted, s.accepted, s.context) for s in steps] == [(2, 1, 3), (2, 2, 5)]
    assert steps[0].through == pytest.approx((0.9, 1.0 * 0.8))
    assert steps[1].through == pytest.approx((0.7, 1.0 * 0.6))
    k1 = walk(8, 2, 1, expected[:, :1], posterior[:, :1], torch.Generator().manual_seed(0))
    # row 1 accepts -> row 3 accepts -> row 5 accepts -> row 7: remaining -1, stop
    assert [(s.drafted, s.accepted) for s in k1] == [(1, 1), (1, 1), (1, 1)]
    assert [s.through for s in k1] == [pytest.approx((0.9,)), pytest.approx((0.7,)), pytest.approx((0.2,))]
