"""Context-length buckets (the plan that fills them, the per-bucket counts) and ``speculation_profile.json``, on
hand-made steps and reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mtpquant.errors import ValidateError
from mtpquant.measure.metrics import StepRecord, acceptance_stats, context_buckets, unit_counts
from mtpquant.records.acceptance import Acceptance, AcceptanceRow
from mtpquant.records.evidence import Bootstrap, UnitCounts
from mtpquant.records.profile import profile_headline, speculation_profile
from mtpquant.records.sampling import SamplingSettings
from mtpquant.records.validation import MtpInfo, Report, Settings, Side, ValidationReport, Verdict, sides
from mtpquant.text.prompts import context_edges, plan_sequences
from mtpquant.validate.options import ValidateOptions
from mtpquant.validate.report import _acceptance_plot, write_report

pytestmark = pytest.mark.dev


def test_plan_without_buckets_is_the_usual_cut() -> None:
    ids = [list(range(100)), list(range(10))]
    plan = plan_sequences(ids, 64)
    assert [(len(s.prompt), s.new_tokens, s.bucket) for s in plan] == [(32, 32, None), (10, 54, None)]


def test_plan_fills_every_bucket() -> None:
    ids = [list(range(600)) for _ in range(6)] + [list(range(50)), list(range(50))]
    plan = plan_sequences(ids, 128, (64, 256, 512))
    # buckets [0, 64), [64, 256), [256, 512): round robin (the 8th prompt, 50 tokens, is too short for its bucket 1
    # and for 2: it goes to the next it fills, 0); from 0 at most half the bucket; then min(span, 64) tokens; the
    # plan ordered by bucket
    assert [(len(s.prompt), s.new_tokens, s.bucket) for s in plan] == [
        (32, 32, 0),
        (32, 32, 0),
        (32, 32, 0),
        (32, 32, 0),
        (64, 64, 1),
        (64, 64, 1),
        (256, 64, 2),
        (256, 64, 2),
    ]
    for s in plan:  # every step a sequence drafts has a context inside its bucket
        low, high = (0, *(64, 256, 512))[s.bucket], (64, 256, 512)[s.bucket]  # type: ignore[index]
        assert low <= len(s.prompt) + 1 and len(s.prompt) + s.new_tokens <= high
    assert context_edges(128) == (32, 64, 96, 128) and context_edges(128, (10, 20)) == (10, 20)
    with pytest.raises(ValidateError, match="--context-buckets must ascend"):
        ValidateOptions("x", context_buckets=(64, 32)).check()


def test_context_buckets_count_steps_by_context() -> None:
    steps = [
        StepRecord(2, 2, context=10),
        StepRecord(2, 0, context=20),
        StepRecord(2, 1, context=40),
        StepRecord(2, 2, through=(0.5, 0.25), context=41),
        StepRecord(1, 1, context=90),  # beyond the last edge: left out
    ]
    low, high = context_buckets(steps, (32, 64), 2)
    assert (low.low, low.high, low.steps, low.accepted) == (0, 32, 2, 2)
    assert low.drafted_per_position == (2, 2) and low.accepted_per_position == (1, 1)
    assert low.acceptance_per_position == (0.5, 0.5) and low.mean_acceptance_length == 2.0
    assert (high.steps, high.accepted, high.accepted_per_position) == (2, 1.75, (1.5, 0.25))
    assert high.mean_acceptance_length == pytest.approx(1.875)


GREEDY = SamplingSettings()


def _report(
    steps: list[list[StepRecord]], edges: tuple[int, ...] = (8, 16), sampling: SamplingSettings = GREEDY
) -> Report:
    acceptance = _acceptance(steps, edges, sampling)
    precision = {"main": {"bf16": 7}}
    side = Side("ckpt", "qwen3_5", precision, "model", len(steps), 64, 32, MtpInfo(True), acceptance)
    settings = Settings(2, len(steps), 16, "p", "cpu", "float32", "off", None, 0.1, 1.02, sampling=(sampling,))
    return Report("0.1.0", "now", "single", settings, side, Verdict("pass", ("ok",)))


def _acceptance(steps: list[list[StepRecord]], edges: tuple[int, ...], sampling: SamplingSettings) -> Acceptance:
    rows = []
    for k in (1, 2):
        # the same steps had only k tokens been drafted (greedy chains share prefixes)
        per_k = [
            [StepRecord(min(r.drafted, k), min(r.accepted, k), r.through[:k], r.context) for r in unit]
            for unit in steps
        ]
        units: UnitCounts = unit_counts(per_k, k)
        rows.append(
            AcceptanceRow.of(
                k,
                acceptance_stats([r for u in per_k for r in u]),
                units,
                Bootstrap(units.units).al(units),
                context_buckets([r for u in per_k for r in u], edges, k),
            )
        )
    return Acceptance(tuple(rows), sampling=sampling)


def test_speculation_profile_vectors_and_identities(tmp_path: Path) -> None:
    steps = [
        [StepRecord(2, 2, context=4), StepRecord(2, 0, context=7), StepRecord(2, 1, context=9)],
        [StepRecord(2, 2, context=5), StepRecord(2, 2, context=12), StepRecord(2, 0, context=15)],
    ]
    report = _report(steps)
    profile = speculation_profile(report)
    assert profile is not None
    # k = 2: 6 steps; first draft accepted in 4, both in 3
    assert profile["schema_version"] == "1.0" and profile["measured"] is True and profile["method"] == "mtp"
    assert profile["num_speculative_tokens"] == 2
    assert profile["marginal_accept_rates"] == [round(4 / 6, 6), round(3 / 6, 6)]
    assert profile["conditional_accept_rates"] == [round(4 / 6, 6), round(3 / 4, 6)]
    assert profile["acceptance_length_histogram"] == {"1": 2, "2": 1, "3": 3}
    assert profile["acceptance_length_histogram_counts"] == "observed"  # greedy chains: whole steps
    al = profile["mean_accept_length"]
    assert al == pytest.approx(1 + 7 / 6) == pytest.approx(1 + sum(profile["marginal_accept_rates"]), abs=1e-5)
    hist = profile["acceptance_length_histogram"]
    assert sum(int(n) * c for n, c in hist.items()) / sum(hist.values()) == pytest.approx(al)
    assert profile["mean_accept_length_per_request"] == pytest.approx(((1 + 3 / 3) + (1 + 4 / 3)) / 2, abs=1e-6)
    assert profile["accept_length_model"] == "measured_per_k" and profile["verification_method"] == "longest_prefix"
    assert [r["k"] for r in profile["by_k"]] == [1, 2] and profile["by_k"][0]["marginal_accept_rates"] == [
        round(4 / 6, 6)
    ]
    assert [b["context"] for b in profile["by_context"]] == [[0, 8], [8, 16]]
    conditions = profile["measurement_conditions"]
    assert (conditions["engine"], conditions["temperature"], conditions["rule"]) == ("built-in", 0.0, "vllm")
    headline = profile_headline(profile)
    assert headline is not None and headline.k == 2 and headline.conditional_accept_rates == (0.666667, 0.75)
    write_report(ValidationReport(report), tmp_path / "r")
    assert json.loads((tmp_path / "r" / "speculation_profile.json").read_text()) == profile
    assert (tmp_path / "r" / "context.png").read_bytes()[:4] == b"\x89PNG"


def test_an_empty_bucket_or_an_unreached_position_is_null_not_zero_acceptance() -> None:
    """What a user saw: a context bucket no prompt reached was written as 0 % acceptance
    (``"conditional_accept_rates": [0.0, 0.0]`` beside ``mean_accept_length: null``), which a serving simulator reads
    as no acceptance at those contexts; a position after one that nothing passed read 0 % too. Both are null now.
    Under sampling the built-in counts are expectations: the histogram says so."""
    sampled = SamplingSettings(0.8)
    steps = [  # every context below 8: the bucket [8, 16) has no step; position 1 is never certain, 2 half as likely
        [StepRecord(2, 1, through=(0.5, 0.25), context=4), StepRecord(2, 0, through=(0.25, 0.0), context=6)],
        [StepRecord(2, 0, through=(0.5, 0.25), context=5)],
    ]
    profile = speculation_profile(_report(steps, sampling=sampled))
    assert profile is not None
    empty = profile["by_context"][1]
    assert empty == {
        "context": [8, 16],
        "steps": 0,
        "conditional_accept_rates": None,
        "marginal_accept_rates": None,
        "mean_accept_length": None,
        "acceptance_length_histogram": {},
        "acceptance_length_histogram_counts": "expected",
    }
    # k = 2 over 3 steps: expected first-draft acceptances 1.25, both 0.5; the histogram counts fractional steps
    assert profile["marginal_accept_rates"] == [round(1.25 / 3, 6), round(0.5 / 3, 6)]
    assert profile["acceptance_length_histogram"] == {"1": 1.75, "2": 0.75, "3": 0.5}
    assert profile["acceptance_length_histogram_counts"] == "expected"
    assert profile["measurement_conditions"]["temperature"] == 0.8
    # a position after one no step passed: its conditional rate is undefined (null), not 0
    never = [[StepRecord(2, 0, context=4), StepRecord(2, 0, context=5)]]
    profile = speculation_profile(_report(never))
    assert profile is not None
    assert profile["conditional_accept_rates"] == [0.0, None] and profile["marginal_accept_rates"] == [0.0, 0.0]
    headline = profile_headline(profile)
    assert headline is not None and headline.conditional_accept_rates == (0.0, None)


def test_acceptance_plot_shows_every_sampling_setting_with_its_interval() -> None:
    """What a user saw: acceptance.png drew the first temperature only, named none and had no intervals. Now one
    series per sampling setting, named by side and setting, AL with the interval the tables give."""
    from matplotlib.container import ErrorbarContainer

    steps = [
        [StepRecord(2, 2, through=(0.9, 0.6), context=4), StepRecord(2, 1, through=(0.7, 0.3), context=5)]
        for _ in range(12)
    ] + [[StepRecord(2, 0, through=(0.4, 0.1), context=6)] for _ in range(12)]
    greedy, hot = SamplingSettings(), SamplingSettings(0.8, 0.9)
    report = _report(steps)
    side = report.reference
    by_sampling = (side.acceptance, _acceptance(steps, (8, 16), hot))
    assert side.acceptance is not None and greedy == side.acceptance.sampling
    report = dataclasses.replace(report, reference=dataclasses.replace(side, acceptance_by_sampling=by_sampling))
    fig = _acceptance_plot(report, sides(report))
    bars, lines = fig.axes
    names = ["checkpoint (T=0)", "checkpoint (T=0.8, top-p 0.9)"]
    assert bars.get_legend_handles_labels()[1] == names and lines.get_legend_handles_labels()[1] == names
    assert "95 % intervals" in lines.get_title()
    containers = [c for c in lines.containers if isinstance(c, ErrorbarContainer)]
    assert len(containers) == 2
    for container, acc in zip(containers, by_sampling):
        assert acc is not None
        segments = container.lines[2][0].get_segments()
        drawn = [float(v) for seg in segments for v in (seg[0][0], seg[0][1], seg[1][1])]
        expected = []
        for row in acc.by_k:
            assert row.al_interval is not None and row.al_interval.defined
            expected += [row.k, row.al_interval.low, row.al_interval.high]
        assert drawn == pytest.approx(expected)
    # the per-position bars: both settings at k = 2
    heights = [round(p.get_height(), 6) for p in bars.patches]
    assert heights == [round(100 * a, 6) for acc in by_sampling if acc for a in acc.by_k[-1].acceptance_per_position]
