"""heal's check at the sampling settings users serve with (``heal --temperature 0 0.8``, validate's flags).

The decision per setting (better / no change / worse beyond noise) and the rule that combines them are shown on
counts whose outcome is known; the trained tiny Qwen3.5 model then shows the whole path: the check reported at both
settings (the text and the provenance), and a heal whose sampled acceptance falls refused with exit 24 unless
``--force``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mtpquant.cli import main as cli
from mtpquant.errors import ExitCode, UsageError
from mtpquant.heal.check import HeldOut, compare
from mtpquant.heal.options import HealOptions
from mtpquant.measure.replay import SequenceRecord, TargetRun
from mtpquant.records.evidence import UnitCounts
from mtpquant.records.provenance import read_provenance
from mtpquant.records.sampling import GREEDY, SamplingSettings
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.support.cli import one_error
from tests.support.heal import HealedTiny
from tests.test_graft import leftovers, private_copy, tree_state

pytestmark = pytest.mark.dev

SAMPLED = SamplingSettings(0.8)
# a schedule of seconds; --lr 0.1 wrecks the MTP (its acceptance falls at every setting)
FAST = ["--device", "cpu", "--steps", "3", "--samples", "8", "--check-prompts", "16"]


def _counts(accepted: list[float]) -> UnitCounts:
    """k = 1 counts of 10 verification steps per unit, ``accepted[u]`` drafts accepted in unit u."""
    return UnitCounts(tuple(10.0 for _ in accepted), tuple(accepted), tuple((a,) for a in accepted),
                      tuple((10.0,) for _ in accepted))


def _held_out(*settings: SamplingSettings) -> list[HeldOut]:
    run = TargetRun("t", [SequenceRecord(torch.zeros(4, dtype=torch.long), 2, torch.zeros(4, 2))])
    return [HeldOut(s, run) for s in settings]


LOW = [3.0, 4.0, 3.0, 5.0, 4.0, 3.0, 4.0, 5.0]
HIGH = [a + 2 for a in LOW]


def test_a_setting_worse_beyond_noise_refuses_what_the_greedy_check_would_write() -> None:
    """Greedy better and sampled worse: not better (the heal must not be written silently); the sampled setting
    within noise does not stop a greedy gain; the first setting is the one that must be better."""
    mixed = compare([[_counts(LOW)], [_counts(HIGH)]], [[_counts(HIGH)], [_counts(LOW)]], _held_out(GREEDY, SAMPLED))
    assert [s.verdict for s in mixed.settings] == ["better", "worse"]
    assert [s.sampling for s in mixed.settings] == [GREEDY, SAMPLED] and not mixed.better and not mixed.greedy_only
    assert mixed.by_k == mixed.settings[0].by_k and mixed.by_k[0].low > 0 and mixed.settings[1].by_k[0].high < 0
    flat = compare([[_counts(LOW)], [_counts(LOW)]], [[_counts(HIGH)], [_counts(LOW)]], _held_out(GREEDY, SAMPLED))
    assert [s.verdict for s in flat.settings] == ["better", "no change"] and flat.better
    first = compare([[_counts(LOW)], [_counts(LOW)]], [[_counts(LOW)], [_counts(HIGH)]], _held_out(GREEDY, SAMPLED))
    assert [s.verdict for s in first.settings] == ["no change", "better"] and not first.better
    greedy = compare([[_counts(LOW)]], [[_counts(HIGH)]], _held_out(GREEDY))
    assert greedy.greedy_only and greedy.better


def test_sampling_flags_are_validates() -> None:
    """The same flags and the same one-line refusals as validate's (``records.sampling.check_sampling``)."""
    opts = HealOptions(quant="q", source="s", out="o", temperatures=(0.0, 0.7), top_p=(1.0, 0.95), seed=3)
    assert opts.sampling_settings == (SamplingSettings(0.0, 1.0, 0, 3), SamplingSettings(0.7, 0.95, 0, 3))
    assert opts.data_temperature == 0.7 and HealOptions(quant="q", source="s", out="o").data_temperature == 0.7
    assert HealOptions(quant="q", source="s", out="o", temperatures=(0.0, 1.0)).data_temperature == 1.0
    for kwargs, text in [
        ({"temperatures": (0.0, 0.0)}, "--temperature/--top-p/--top-k: a sampling setting is listed twice"),
        ({"temperatures": (0.0, 0.7), "top_k": (1, 2, 3)},
         "--temperature/--top-p/--top-k/--rule: --top-k takes one value or one per temperature (2), got 3"),
        ({"temperatures": ()}, "--temperature needs at least one value"),
        ({"rule": "nope"}, "--temperature/--top-p/--top-k/--rule: unknown rule 'nope'"),
    ]:
        with pytest.raises(UsageError) as refused:
            HealOptions(quant="q", source="s", out="o", **kwargs).check()
        assert str(refused.value).startswith(text), str(refused.value)


@pytest.mark.slow
def test_heal_checks_each_setting_and_refuses_a_sampled_fall_unless_forced(
    healed_tiny: HealedTiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quant = private_copy(healed_tiny.quant("keep"), tmp_path / "q")
    before = tree_state(quant)
    src = str(TINY_MTP_ASSET)
    # the check at both settings, reported in the text and recorded (written with --force whatever it finds)
    capsys.readouterr()
    assert cli(["heal", str(quant), "--from", src, "--out", str(tmp_path / "a"), *FAST, "--temperature", "0", "0.8",
                "--force"]) == 0
    out = capsys.readouterr().out
    assert "check      16 held-out prompts (the quantized target's own continuations) at 2 settings, sampled ones " \
           "verified by --rule vllm" in out
    assert "\n           T=0: " in out and "\n           T=0.8: " in out
    record = read_provenance(tmp_path / "a").heal
    assert record is not None and record.temperature == 0.8  # the training data's sampled half: the first sampled T
    assert [(c.sampling, c.rule, [a.k for a in c.by_k]) for c in record.checks] == [
        (SamplingSettings(0.0), "vllm", [1, 2, 3]), (SamplingSettings(0.8), "vllm", [1, 2, 3])
    ]
    assert record.by_k == record.checks[0].by_k
    # a heal that wrecks the MTP: its sampled acceptance falls beyond noise; refused, nothing written
    argv = [str(quant), "--from", src, *FAST, "--lr", "0.1", "--temperature", "0", "0.8"]
    code, err = one_error(capsys, "-q", "heal", *argv, "--in-place")
    assert code == ExitCode.HEAL_NOT_BETTER, err
    assert "the healed MTP is worse beyond noise at T=0 and T=0.8 on 16 held-out prompts" in err
    assert "T=0.8 (worse): k=1 " in err and err.endswith("nothing written")
    assert tree_state(quant) == before and leftovers(tmp_path) == []
    # --force: written, and the record says what the check found
    assert cli(["-q", "heal", *argv, "--out", str(tmp_path / "b"), "--force"]) == 0
    forced = read_provenance(tmp_path / "b").heal
    assert forced is not None and forced.forced and not forced.better
    assert [(c.better, c.worse) for c in forced.checks] == [(False, True), (False, True)]
    assert all(a.after < a.before and a.high < 0 for a in forced.checks[1].by_k)
