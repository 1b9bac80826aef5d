"""heal's decision rule on constructed intervals (``heal.decision``): write when better beyond noise at the served k
and worse beyond noise at no k; ``--strict``: better beyond noise at every k. The numbers are issue 43's measured
heal of the trained tiny Qwen3.8-Flash-Next keep quant (k = 1 within noise, k = 2 and 3 clearly better)."""

from __future__ import annotations

import pytest

from mtpquant.heal.check import CheckResult, SettingCheck
from mtpquant.heal.decision import AlChange, HealRule, changes_text, decide, setting_verdict
from mtpquant.records.sampling import GREEDY, SamplingSettings

pytestmark = pytest.mark.dev


def change(k: int, before: float, estimate: float, low: float, high: float) -> AlChange:
    return AlChange(k, before, before + estimate, low, high, better=low > 0)


# issue 43: k = 1 +0.020 [-0.006, +0.044], k = 2 +0.140 [+0.083, +0.192], k = 3 +0.272 [+0.190, +0.352]
MEASURED = (change(1, 1.60, 0.020, -0.006, 0.044), change(2, 1.90, 0.140, 0.083, 0.192),
            change(3, 2.00, 0.272, 0.190, 0.352))


def test_served_k_better_and_no_k_worse_is_written() -> None:
    assert [c.verdict for c in MEASURED] == ["no change", "better", "better"]
    assert decide([MEASURED], HealRule()) and decide([MEASURED], HealRule(served_k=3))
    assert decide([MEASURED], HealRule(served_k=2))
    assert setting_verdict(MEASURED, HealRule()) == "better"


def test_served_k_unchanged_is_refused() -> None:
    assert not decide([MEASURED], HealRule(served_k=1))  # k = 1 within noise
    assert setting_verdict(MEASURED, HealRule(served_k=1)) == "no change"


def test_any_k_worse_is_refused() -> None:
    worse_k1 = (change(1, 1.60, -0.05, -0.08, -0.01), *MEASURED[1:])
    assert worse_k1[0].verdict == "worse"
    for rule in (HealRule(), HealRule(served_k=3), HealRule(strict=True)):
        assert not decide([worse_k1], rule)
        assert setting_verdict(worse_k1, rule) == "worse"
    # worse at another sampling setting (every k of it) refuses too, even when the headline is better
    assert not decide([MEASURED, worse_k1], HealRule())
    # an interval that touches 0 from below is not beyond noise
    assert decide([(change(1, 1.6, -0.01, -0.03, 0.0), *MEASURED[1:])], HealRule())


def test_strict_needs_every_k_better() -> None:
    assert not decide([MEASURED], HealRule(strict=True))
    assert setting_verdict(MEASURED, HealRule(strict=True)) == "no change"
    every = (change(1, 1.60, 0.05, 0.01, 0.09), *MEASURED[1:])
    assert decide([every], HealRule(strict=True)) and decide([every], HealRule())


def test_the_headline_setting_decides() -> None:
    unchanged = tuple(change(k, 1.5, 0.0, -0.02, 0.02) for k in (1, 2, 3))
    assert not decide([unchanged, MEASURED], HealRule())  # better only at a later setting: not written
    assert decide([MEASURED, unchanged], HealRule())
    assert not decide([], HealRule())


def test_check_result_and_decision_line_name_every_k() -> None:
    sampled = SamplingSettings(0.7, 1.0, 0, 0)
    result = CheckResult(64, 8192, (SettingCheck(GREEDY, MEASURED, HealRule()),), decision=HealRule())
    assert result.better and result.greedy_only and result.settings[0].verdict == "better"
    strict = CheckResult(64, 8192, (SettingCheck(GREEDY, MEASURED, HealRule(strict=True)),),
                         decision=HealRule(strict=True))
    assert not strict.better
    two = CheckResult(64, 8192, (SettingCheck(GREEDY, MEASURED), SettingCheck(sampled, MEASURED)))
    assert two.better and not two.greedy_only
    assert changes_text(MEASURED) == (
        "k=1 no change: 1.600 -> 1.620 (+0.020 [-0.006, +0.044]); "
        "k=2 better: 1.900 -> 2.040 (+0.140 [+0.083, +0.192]); "
        "k=3 better: 2.000 -> 2.272 (+0.272 [+0.190, +0.352])"
    )
    assert HealRule().text(3) == "better beyond noise at the served k = 3 and worse beyond noise at no k"
