"""Acceptance arithmetic and logit metrics on hand-computed examples."""

from __future__ import annotations

import pytest
import torch

from mtpquant.validate.metrics import (
    StepRecord,
    Summary,
    acceptance_by_k,
    acceptance_stats,
    compare_logits,
    kl_per_position,
    summarize,
    token_agreement,
    top1_agreement,
    verify_greedy,
)


def test_verify_greedy():
    v = verify_greedy([5, 7, 9], [5, 7, 1, 4])
    assert (v.accepted, v.emitted) == (2, (5, 7, 1))
    v = verify_greedy([5, 7, 9], [5, 7, 9, 4])
    assert (v.accepted, v.emitted) == (3, (5, 7, 9, 4))
    v = verify_greedy([1, 2], [3, 2, 2])  # a later match does not count after a miss
    assert (v.accepted, v.emitted) == (0, (3,))
    with pytest.raises(ValueError, match="needs 3 tokens"):
        verify_greedy([1, 2], [1, 2])


def test_acceptance_stats_k3():
    # 4 steps of 3 drafts, accepting 3, 1, 0, 2.
    records = [StepRecord(3, 3), StepRecord(3, 1), StepRecord(3, 0), StepRecord(3, 2)]
    s = acceptance_stats(records)
    assert (s.num_steps, s.num_drafted, s.num_accepted) == (4, 12, 6)
    assert s.acceptance_rate == 0.5
    assert s.mean_acceptance_length == 2.5
    assert s.drafted_per_position == (4, 4, 4)
    assert s.accepted_per_position == (3, 2, 1)
    assert s.acceptance_per_position == (0.75, 0.5, 0.25)


def test_acceptance_by_k():
    records = [StepRecord(3, 3), StepRecord(3, 1), StepRecord(3, 0), StepRecord(3, 2)]
    k1, k2, k3 = acceptance_by_k(records)
    assert (k1.num_drafted, k1.num_accepted, k1.acceptance_rate, k1.mean_acceptance_length) == (
        4,
        3,
        0.75,
        1.75,
    )
    assert (k2.num_drafted, k2.num_accepted, k2.acceptance_rate, k2.mean_acceptance_length) == (
        8,
        5,
        0.625,
        2.25,
    )
    assert (k3.num_drafted, k3.num_accepted, k3.acceptance_rate, k3.mean_acceptance_length) == (
        12,
        6,
        0.5,
        2.5,
    )
    assert k2.acceptance_per_position == (0.75, 0.5)
    assert len(acceptance_by_k(records, max_k=2)) == 2
    with pytest.raises(ValueError, match="max_k 4"):
        acceptance_by_k(records, max_k=4)


def test_acceptance_stats_uneven_drafts():
    records = [StepRecord(2, 2), StepRecord(1, 0), StepRecord(3, 1)]
    s = acceptance_stats(records)
    assert (s.num_drafted, s.num_accepted) == (6, 3)
    assert s.acceptance_rate == 0.5
    assert s.mean_acceptance_length == 2.0
    assert s.drafted_per_position == (3, 2, 1)
    assert s.accepted_per_position == (2, 1, 0)
    assert s.acceptance_per_position == (2 / 3, 0.5, 0.0)


def test_invalid_records():
    with pytest.raises(ValueError):
        StepRecord(2, 3)
    with pytest.raises(ValueError):
        StepRecord(0, 0)
    with pytest.raises(ValueError):
        acceptance_stats([])


def test_identical_logits():
    logits = torch.randn(2, 5, 11)
    c = compare_logits(logits, logits.clone())
    assert c.num_positions == 10
    assert c.top1_agreement == 1.0
    assert (c.kl.mean, c.kl.median, c.kl.p99) == (0.0, 0.0, 0.0)
    # Logits are defined up to a constant per row.
    assert kl_per_position(logits, logits + 3.0).abs().max() < 1e-12


def test_two_class_kl():
    ref = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # p = (1/2, 1/2)
    cand = torch.tensor([[0.0, 1.0986122886681098]], dtype=torch.float64)  # ln 3: q = (1/4, 3/4)
    # KL(p || q) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    assert kl_per_position(ref, cand).item() == pytest.approx(0.14384103622589045, abs=1e-12)
    # The other direction is a different number: 1/4 ln(1/2) + 3/4 ln(3/2).
    assert kl_per_position(cand, ref).item() == pytest.approx(0.13081203594113694, abs=1e-12)
    assert kl_per_position(ref, cand).dtype == torch.float64


def test_kl_with_masked_reference_token():
    ref = torch.tensor([[0.0, float("-inf")]])  # p = (1, 0)
    cand = torch.tensor([[0.0, 0.0]])  # q = (1/2, 1/2)
    assert kl_per_position(ref, cand).item() == pytest.approx(0.6931471805599453, abs=1e-12)


def test_top1_agreement_and_mask():
    ref = torch.tensor([[9.0, 0, 0], [0, 9, 0], [0, 0, 9], [9, 0, 0]])
    cand = torch.tensor([[9.0, 0, 0], [0, 0, 9], [0, 0, 9], [0, 9, 0]])
    assert top1_agreement(ref, cand) == 0.5
    assert top1_agreement(ref, cand, mask=torch.tensor([True, False, True, False])) == 1.0
    c = compare_logits(ref, cand, mask=torch.tensor([True, False, True, True]))
    assert c.num_positions == 3
    assert c.top1_agreement == pytest.approx(2 / 3)


def test_token_agreement():
    assert token_agreement(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 3, 0])) == 0.5
    assert (
        token_agreement(torch.tensor([1, 2]), torch.tensor([1, 0]), mask=torch.tensor([True, False])) == 1.0
    )


def test_summarize():
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert (s.count, s.mean, s.median) == (4, 2.5, 2.5)
    assert s.p99 == pytest.approx(3.97, abs=1e-12)  # 3 + 0.97 * (4 - 3)
    assert isinstance(s, Summary)
    s = summarize(torch.arange(101, dtype=torch.float64))
    assert (s.count, s.mean, s.median, s.p99) == (101, 50.0, 50.0, 99.0)
    with pytest.raises(ValueError):
        summarize([])
