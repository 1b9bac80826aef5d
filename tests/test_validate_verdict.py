"""validate's evidence (bootstrap intervals over prompts) and the verdicts decided on it, on hand-made counts.

Every case builds per-prompt counts whose AL is known exactly, so the point estimates are checked to the last
digit and the intervals against a direct resampling of the same prompts.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from mtpquant.checkpoint.filesystem import atomic_write_json
from mtpquant.errors import ExitCode
from mtpquant.records.acceptance import Acceptance, AcceptanceRow
from mtpquant.records.evidence import (
    MIN_UNITS,
    Bootstrap,
    Interval,
    UnitCounts,
    better_beyond_noise,
    decide,
    units_to_settle,
)
from mtpquant.records.validation import Agreement, Comparison, KlSummary, MtpInfo, Side, Verdict
from mtpquant.validate.run import ValidateOptions
from mtpquant.validate.verdict import verdict

pytestmark = pytest.mark.dev

STEPS = 40  # verification steps per prompt in the hand-made counts


def _units(accepted: list[int], steps: int = STEPS) -> UnitCounts:
    """k = 1 counts: ``accepted[u]`` of ``steps`` drafts accepted in prompt u."""
    return UnitCounts(
        tuple(float(steps) for _ in accepted),
        tuple(float(a) for a in accepted),
        tuple((float(a),) for a in accepted),
        tuple((float(steps),) for _ in accepted),
    )


def _acceptance(units: UnitCounts) -> Acceptance:
    steps, accepted = int(sum(units.steps)), int(sum(units.accepted))
    row = AcceptanceRow(
        k=1,
        num_steps=steps,
        num_drafted=steps,
        num_accepted=accepted,
        acceptance_rate=accepted / steps,
        mean_acceptance_length=1 + accepted / steps,
        drafted_per_position=(steps,),
        accepted_per_position=(accepted,),
        acceptance_per_position=(accepted / steps,),
        al_interval=Bootstrap(units.units).al(units),
        units=units,
    )
    return Acceptance((row,), None)


def _side(units: UnitCounts | None, *, error: str | None = None, non_finite: int = 0) -> Side:
    acc = _acceptance(units) if units is not None else None
    return Side("x", "qwen3_5", {}, "model", 1, 8, 4, MtpInfo(error is None, error), acc, non_finite_target=non_finite)


def _cmp(cross: UnitCounts | None, main_agreement: float = 0.95) -> Comparison:
    return Comparison(
        mtp=Agreement(100, 1.0, KlSummary(0, 0, 0, 0)),
        candidate_mtp_on_reference_target=_acceptance(cross) if cross is not None else None,
        main=Agreement(100, main_agreement, KlSummary(0.1, 0.1, 0.2, 0.3)),
    )


def _spread(n: int, mean: float, jitter: int, seed: int = 0) -> list[int]:
    """n prompts whose accepted counts average ``mean`` * STEPS exactly, spread by +-jitter (paired)."""
    rng = random.Random(seed)
    base = round(mean * STEPS)
    offs = [rng.randint(-jitter, jitter) for _ in range(n // 2)]
    values = [base + o for o in offs] + [base - o for o in offs] + ([base] if n % 2 else [])
    return values


OPTS = ValidateOptions("ref", warn_al_drop=0.1)


# ---- evidence ---------------------------------------------------------------------------------------------------
def test_bootstrap_interval_matches_a_direct_resampling() -> None:
    units = _units([10, 30, 20, 25, 5, 35, 15])
    plan = Bootstrap(units.units, resamples=500, seed=3)
    al = plan.al(units)
    assert al.estimate == 1 + 140 / 280
    # the same resamples, done by hand: draw counts per prompt -> AL per resample -> 2.5 / 97.5 percentiles
    direct = []
    for w in plan.weights:
        acc = sum(wi * a for wi, a in zip(w, units.accepted))
        steps = sum(wi * s for wi, s in zip(w, units.steps))
        direct.append(1 + acc / steps)
    low, high = np.quantile(direct, [0.025, 0.975])
    assert (al.low, al.high) == pytest.approx((low, high), abs=1e-12)
    assert al.low < al.estimate < al.high and al.units == 7 and al.level == 0.95
    assert Bootstrap(7, resamples=500, seed=3).al(units) == al  # seeded: the same counts give the same interval


def test_paired_change_of_identical_sides_is_exactly_zero() -> None:
    units = _units([10, 30, 20, 25, 5, 35])
    change = Bootstrap(units.units).al_change(units, units)
    assert (change.estimate, change.low, change.high) == (0.0, 0.0, 0.0)
    # a constant shift of every prompt is a paired change with no spread at all
    shifted = _units([a + 4 for a in (10, 30, 20, 25, 5, 35)])
    change = Bootstrap(6).al_change(units, shifted)
    assert change.estimate == pytest.approx(0.1) and change.high - change.low == pytest.approx(0, abs=1e-12)


def test_decide_and_units_to_settle() -> None:
    assert decide(Interval(-0.05, -0.08, -0.02, units=10), -0.1) == "above"
    assert decide(Interval(-0.3, -0.4, -0.2, units=10), -0.1) == "below"
    straddle = Interval(-0.08, -0.2, 0.04, units=8)
    assert decide(straddle, -0.1) == "inconclusive"
    # half-width 0.12 on the boundary's side, margin 0.02: (0.12 / 0.02)^2 = 36 times the 8 prompts: beyond 100x? no
    assert units_to_settle(straddle, -0.1) == math.ceil(8 * (0.12 / 0.02) ** 2)
    assert units_to_settle(Interval(-0.1, -0.2, 0.0, units=8), -0.1) is None  # on the boundary: nothing settles it
    assert decide(Interval(0.5, 0.5, 0.5, units=MIN_UNITS - 1), 0.0) == "inconclusive"  # too few prompts


def test_better_beyond_noise() -> None:
    before = _units(_spread(40, 0.5, 6))
    after = _units([a + 4 for a in _spread(40, 0.5, 6)])  # +0.1 AL on every prompt
    better, change = better_beyond_noise(before, after)
    assert better and change.estimate == pytest.approx(0.1)
    noisy = _units(_spread(40, 0.5, 6, seed=9))  # the same mean, prompts reshuffled: no real change
    better, change = better_beyond_noise(before, noisy)
    assert not better and change.low < 0 < change.high


def test_units_round_trip_json() -> None:
    units = UnitCounts((3.0, 4.0), (1.0, 2.5), ((1.0, 0.0), (2.0, 0.5)), ((3.0, 3.0), (4.0, 3.0)))
    again = UnitCounts.from_json(json.loads(json.dumps(units.to_json())), "u")
    assert again == units and units.to_json()["accepted"] == [1, 2.5]


# ---- verdicts ---------------------------------------------------------------------------------------------------
def test_identical_mtp_small_sample_is_inconclusive_not_a_warn() -> None:
    ref = _units(_spread(6, 0.6, 8))
    cand_acc = [a - 6 + d for a, d in zip(ref.accepted, (-8, 9, -7, 8, 0, -2))]  # -0.15 AL, very uneven
    cand = _units([int(a) for a in cand_acc])
    v = verdict(OPTS, _side(ref), _side(cand), _cmp(ref))  # the candidate MTP on the reference target: identical
    assert v.status == "inconclusive" and v.exit_code == ExitCode.VALIDATE_INCONCLUSIVE
    (e,) = v.evidence
    assert e.mtp is not None and (e.mtp.estimate, e.mtp.low, e.mtp.high) == (0.0, 0.0, 0.0)
    assert e.target is not None and e.target.estimate == pytest.approx(e.change.estimate)
    reason = v.reasons[0]
    assert reason.startswith("sample too small: the AL change at k=1 is -0.150 [")
    assert "MTP +0.000 [+0.000, +0.000], target -0.150" in reason and "allowed drop 0.1 AL" in reason
    assert f"about {v.prompts_needed} prompts would settle it" in reason and v.prompts_needed > 6


def test_the_same_drop_on_many_prompts_is_a_warn_naming_the_target() -> None:
    ref = _units(_spread(200, 0.6, 4))
    cand = _units([int(a) - 8 for a in ref.accepted])  # -0.2 AL on every prompt
    v = verdict(OPTS, _side(ref), _side(cand), _cmp(ref))
    assert v.status == "warn" and v.exit_code == ExitCode.VALIDATE_WARN
    assert v.reasons[0].startswith("AL drops by 0.200 at k=1 (change -0.200 [")
    assert "MTP +0.000 [+0.000, +0.000], target -0.200" in v.reasons[0]
    assert "beyond the allowed drop 0.1 AL, 95 % intervals over 200 prompts" in v.reasons[0]


def test_a_small_change_on_enough_prompts_passes() -> None:
    ref = _units(_spread(64, 0.6, 6))
    cand = _units([int(a) - 1 for a in ref.accepted])  # -0.025 AL
    v = verdict(OPTS, _side(ref), _side(cand), _cmp(ref))
    assert v.status == "pass" and v.exit_code == ExitCode.OK and not v.broken
    assert "within the allowed drop 0.1 AL" in v.reasons[0] and "k=1 -0.025 [" in v.reasons[0]
    assert v.thresholds == {"warn_al_drop": 0.1, "broken_al": 1.02, "min_main_agreement": 0.5, "confidence": 0.95}


def test_a_constant_token_candidate_is_broken() -> None:
    """The collapsed target: every draft accepted (AL = k + 1), main-model agreement 0."""
    ref = _units(_spread(16, 0.6, 4))
    cand = _units([STEPS] * 16)
    v = verdict(OPTS, _side(ref), _side(cand), _cmp(ref, main_agreement=0.0))
    assert v.status == "fail" and v.broken and v.exit_code == ExitCode.VALIDATE_BROKEN
    assert v.reasons[0].startswith("candidate is broken: candidate's main model agrees with the reference's top-1")
    assert "AL rises by +0.400 [" in v.reasons[0] and "(its target's part of the change)" in v.reasons[0]
    # agreement alone: a candidate whose main model disagrees is broken even at a plausible AL
    v = verdict(OPTS, _side(ref), _side(ref), _cmp(ref, main_agreement=0.3))
    assert v.broken and "30.0 % of 100 positions, below the floor of 50 %" in v.reasons[0]


def test_non_finite_logits_are_broken() -> None:
    ref = _units(_spread(16, 0.6, 4))
    v = verdict(OPTS, _side(ref), _side(ref, non_finite=128), _cmp(ref))
    assert v.broken
    assert v.reasons == ("candidate is broken: candidate's main model gives non-finite logits at 128 positions",)


def test_an_mtp_that_drafts_for_nothing_fails() -> None:
    ref = _units(_spread(16, 0.6, 4))
    rand = _units([0] * 15 + [1])  # a random MTP: one accepted draft in 640
    v = verdict(OPTS, _side(ref), _side(rand), _cmp(rand))
    assert v.status == "fail" and not v.broken and v.exit_code == ExitCode.VALIDATE_FAIL
    assert v.reasons[0].startswith("candidate MTP is broken: AL 1.002 [") and "below 1.02" in v.reasons[0]
    single = verdict(OPTS, _side(rand), None)
    assert single.status == "fail" and single.reasons[0].startswith("checkpoint MTP is broken")
    missing = verdict(OPTS, _side(ref), _side(None, error="MTP declared but no mtp.* tensors"))
    assert missing.status == "fail" and missing.reasons == ("candidate: MTP declared but no mtp.* tensors",)


def test_single_checkpoint_passes() -> None:
    v = verdict(OPTS, _side(_units(_spread(8, 0.6, 4))), None)
    assert v.status == "pass" and v.reasons == ("AL 1.60 for k = 1",)


def test_verdict_json_is_strict_and_round_trips(tmp_path: Path) -> None:
    ref = _units(_spread(6, 0.6, 12))
    cand = _units([STEPS] * 6)
    v = verdict(OPTS, _side(ref), _side(cand), _cmp(ref, main_agreement=0.0))
    atomic_write_json(tmp_path / "v.json", v.to_json())
    again = Verdict.from_json(json.loads((tmp_path / "v.json").read_text()), "verdict")
    assert again == v
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        atomic_write_json(tmp_path / "nan.json", {"kl": float("nan")})
    assert not (tmp_path / "nan.json").exists()
