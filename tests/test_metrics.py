"""Acceptance arithmetic and logit metrics on hand-computed examples."""

from __future__ import annotations

import pytest
import torch

from mtpquant.measure.metrics import (
    StepRecord,
    Summary,
    acceptance_stats,
    kl_per_position,
    summarize,
    token_agreement,
)

pytestmark = pytest.mark.dev


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
    kl = kl_per_position(logits, logits.clone())
    assert kl.shape == (10,) and kl.abs().max() == 0.0
    assert kl_per_position(logits, logits.clone(), mask=torch.arange(10).reshape(2, 5) % 5 < 3).shape == (6,)
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
