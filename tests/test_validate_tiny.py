"""validate on the trained tiny model (the embedded default), before vs after ``convert``, and its verdicts.

``convert`` runs once per MTP mode (keep, quantize, drop) with two short calibration rows. The keep
pair runs both target models and saves their hidden states; the quantize and drop candidates have
the same main model (checked byte for byte), so they reuse that file instead of re-running targets.
The verdict cases alter a copy of the keep output: non-finite quantization scales (a collapsed target) and a
random MTP.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main
from mtpquant.errors import ExitCode, ValidateError
from mtpquant.families import TensorClass
from mtpquant.records.evidence import Bootstrap, UnitCounts
from mtpquant.records.validation import ValidationReport
from mtpquant.synth.train import TINY_MTP_ASSET, TINY_MTP_ASSETS
from mtpquant.validate.run import ValidateOptions, validate

pytestmark = pytest.mark.slow

ASSET = TINY_MTP_ASSET
CALIB: dict[str, Any] = {"calib_samples": 2, "calib_seq_len": 32}
COMMON: dict[str, Any] = {"num_prompts": 8, "max_len": 128, "k": 3, "device": "cpu", "progress": False}


def _fingerprint(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """The trained asset converted with ``--mtp MODE`` (once per mode); the asset must stay untouched."""
    from mtpquant.convert.run import ConvertOptions, convert

    root = tmp_path_factory.mktemp("tiny-mtp-convert")
    before = _fingerprint(ASSET)
    done: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in done:
            out = root / mode
            convert(ConvertOptions(src=str(ASSET), out=out, mtp=mode, device="cpu", progress=False, **CALIB))
            done[mode] = out
        return done[mode]

    yield get
    assert _fingerprint(ASSET) == before, "a test modified the shipped asset"


@pytest.fixture(scope="module")
def keep_pair(
    converted: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[ValidationReport, Path, Path]:
    """validate ASSET vs its keep-mode quant, with both targets; hidden states saved for reuse."""
    root = tmp_path_factory.mktemp("keep-pair")
    hidden = root / "hidden.safetensors"
    report = validate(
        ValidateOptions(ASSET, converted("keep"), save_hidden=hidden, report_dir=root / "report", **COMMON)
    )
    return report, hidden, root / "report"


def test_asset_layout() -> None:
    ckpt = Checkpoint.open(ASSET)
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 20 * 1024 * 1024
    assert ckpt.config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = ckpt.config["text_config"]
    assert text["head_dim"] == 256 and text["linear_key_head_dim"] == 128 and text["linear_value_head_dim"] == 128
    groups = ckpt.by_class()
    assert len(groups[TensorClass.MTP]) == 15 and groups[TensorClass.VISION]
    assert all(n.startswith("model.language_model.") for n in (e.name for e in groups[TensorClass.MAIN]))
    assert len(ckpt.shards) >= 2 and len({e.shard for e in groups[TensorClass.MTP]}) >= 2
    assert {e.dtype for e in groups[TensorClass.MTP]} == {"BF16"}
    assert (ASSET / "tokenizer.json").is_file()
    training = json.loads((ASSET / "training.json").read_text())
    # Measured by scripts/train_tiny_mtp.py with the default settings (32 held-out prompts).
    assert training["acceptance"]["by_k"][0]["acceptance_rate"] >= 0.40


def test_qwen3_5_moe_asset_layout(tiny_factory: Callable[[str], Path]) -> None:
    """The trained tiny Qwen3.5-MoE has the tiny qwen3_5_moe variant's tensor set and dtypes (the VL wrapper, fused
    3-D main experts, the MTP's 4 routed experts per expert and its shared expert), in a few MB, with head dims vLLM's
    CPU build serves; its MTP drafts as the dense asset's does."""
    asset = TINY_MTP_ASSETS["qwen3_5_moe"]
    ckpt = Checkpoint.open(asset, strict=True)
    tiny = Checkpoint.open(tiny_factory("qwen3_5_moe"), strict=True)
    assert sum(p.stat().st_size for p in asset.iterdir()) <= 8 * 1024 * 1024
    assert ckpt.config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = ckpt.config["text_config"]
    assert (text["vocab_size"], text["num_experts"], text["num_experts_per_tok"]) == (2048, 4, 2)
    assert text["head_dim"] == 256 and text["linear_key_head_dim"] == 128 and text["linear_value_head_dim"] == 128
    assert sorted(ckpt.tensors) == sorted(tiny.tensors)
    assert {n: e.dtype for n, e in ckpt.tensors.items()} == {n: e.dtype for n, e in tiny.tensors.items()}
    mtp = ckpt.by_class()[TensorClass.MTP]
    assert len(mtp) == 29 and {e.dtype for e in mtp} == {"BF16"} and len({e.shard for e in mtp}) == 2
    assert ckpt.tensors["mtp.layers.0.mlp.experts.3.down_proj.weight"].shape == (128, 128)
    training = json.loads((asset / "training.json").read_text())
    assert training["spec"]["family"] == "qwen3_5_moe"
    # measured by scripts/train_tiny_mtp.py (32 held-out prompts); the dense asset's bar
    assert training["acceptance"]["by_k"][0]["acceptance_rate"] >= 0.6


def test_trained_mtp_is_accepted(keep_pair: tuple[ValidationReport, Path, Path]) -> None:
    ref = keep_pair[0].to_json()["reference"]["acceptance"]
    assert ref["by_k"][0]["acceptance_rate"] >= 0.40
    als = [row["mean_acceptance_length"] for row in ref["by_k"]]
    assert als == sorted(als)  # more drafts never lower AL under greedy chains


def test_keep_mode_mtp_identical_difference_only_from_target(keep_pair: tuple[ValidationReport, Path, Path]) -> None:
    report, _, report_dir = keep_pair
    data = report.to_json()
    cmp = data["comparison"]
    assert cmp["mtp"]["kl"] == {"mean": 0.0, "median": 0.0, "p99": 0.0, "max": 0.0}
    assert cmp["mtp"]["top1_agreement"] == 1.0
    assert cmp["al_delta_from_mtp_by_k"] == [0.0, 0.0, 0.0]
    assert cmp["al_delta_by_k"] == pytest.approx(cmp["al_delta_from_target_by_k"], abs=1e-12)
    # The target was quantized: its distribution moved, measurably.
    assert cmp["main"]["kl"]["mean"] > 0
    cand = data["candidate"]
    assert cand["mtp"]["precision"] == {"bf16": 8} and "nvfp4" in cand["precision"]["main"]
    assert {p.name for p in report_dir.iterdir()} == {
        "report.json",
        "report.md",
        "acceptance.png",
        "context.png",
        "kl.png",
        "speculation_profile.json",
    }
    md = (report_dir / "report.md").read_text()  # one path style: each directory by its name
    assert f"## Reference: `{ASSET.name}`" in md and "## Candidate: `keep`" in md


def test_identical_mtp_small_sample_is_inconclusive(keep_pair: tuple[ValidationReport, Path, Path]) -> None:
    """The byte-identical MTP on 8 prompts: the AL drop at k=3 comes from the NVFP4 target, and the sample is too
    small to tell it from the allowed drop; before intervals this was a WARN (exit 17) that blamed nobody."""
    verdict = keep_pair[0].report.verdict
    assert verdict.status == "inconclusive" and verdict.exit_code == ExitCode.VALIDATE_INCONCLUSIVE
    assert verdict.reasons[0].startswith("sample too small: the AL change at k=")
    assert "MTP +0.000 [+0.000, +0.000], target " in verdict.reasons[0]
    assert "allowed drop 0.1 AL, 95 % intervals over 8 prompts" in verdict.reasons[0]
    for e in verdict.evidence:  # every change is the target's: the MTP part is exactly 0 on every resample
        assert e.mtp is not None and (e.mtp.low, e.mtp.estimate, e.mtp.high) == (0.0, 0.0, 0.0)
        assert e.target is not None and e.target.estimate == pytest.approx(e.change.estimate, abs=1e-12)
    assert verdict.prompts_needed is None or verdict.prompts_needed > 8


def test_intervals_come_from_the_counts_of_the_one_pass(keep_pair: tuple[ValidationReport, Path, Path]) -> None:
    """The confidence intervals cost no model pass: each is a resampling of the per-prompt counts the report holds
    (recomputed here from report.json alone, bit for bit)."""
    data = _strict_json(keep_pair[2] / "report.json")
    level = data["settings"]["confidence"]
    rows = [r for side in ("reference", "candidate") for r in data[side]["acceptance"]["by_k"]]
    assert len(rows) == 6
    for row in rows:
        units = UnitCounts.from_json(row["units"], "units")
        assert units.units == 8 and units.mean_acceptance_length == pytest.approx(row["mean_acceptance_length"])
        assert Bootstrap(units.units, level=level).al(units).to_json() == row["al_interval"]


def _main_bytes(path: Path) -> str:
    ckpt = Checkpoint.open(path)
    h = hashlib.sha256()
    for name in sorted(n for n in ckpt.tensors if ckpt.classify(n) != TensorClass.MTP):
        h.update(name.encode() + ckpt.read_raw(ckpt.tensors[name]))
    return h.hexdigest()


def test_the_default_quantizes_w4a4_activations_as_the_engines_do(
    converted: Callable[[str], Path], keep_pair: tuple[ValidationReport, Path, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """issue 43: ``validate SRC QUANT`` with no flags on a W4A4 NVFP4 quant runs its activations quantized (as vLLM,
    SGLang and TensorRT-LLM run them): the numbers equal an explicit ``--activations emulate`` run's, not ``off``'s,
    and the report, the verdict line and the speculation profile say so; ``--activations off`` stays, labelled in
    the verdict line itself."""
    quant = converted("keep")
    assert Checkpoint.open(quant).tensors["model.language_model.layers.0.mlp.down_proj.input_scale"]  # W4A4
    out = tmp_path / "default"
    code = main(["-q", "validate", str(ASSET), str(quant), "--num-prompts", "8", "--device", "cpu",
                 "--report-dir", str(out)])
    printed = capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert code in (0, 17, 23)
    assert data["settings"]["activations"] == "emulate"
    assert "activations emulated as the engines run them." in (out / "report.md").read_text()
    verdict = next(line for line in printed.splitlines() if line.startswith("verdict: "))
    assert "NOT quantized" not in verdict and "not emulated" not in verdict
    profile = json.loads((out / "speculation_profile.json").read_text())
    assert profile["measurement_conditions"]["activations"] == "emulate"

    def al(report: dict[str, Any]) -> list[float]:
        return [r["mean_acceptance_length"] for r in report["candidate"]["acceptance"]["by_k"]]

    emulated = validate(ValidateOptions(ASSET, quant, activations="emulate", **COMMON)).to_json()
    off = validate(ValidateOptions(ASSET, quant, activations="off", **COMMON)).to_json()
    assert al(data) == al(emulated) != al(off)  # the default's numbers are the emulated ones
    assert profile["mean_accept_length"] == pytest.approx(al(emulated)[-1], abs=1e-9)
    assert off["settings"]["activations"] == "off"
    assert off["verdict"]["reasons"][-1].startswith("activations NOT quantized (--activations off): the engines "
                                                    "quantize the inputs of the ")
    assert not any("NOT quantized" in r for r in emulated["verdict"]["reasons"])


def test_quantize_mode_reports_a_measured_difference(
    converted: Callable[[str], Path], keep_pair: tuple[ValidationReport, Path, Path]
) -> None:
    _, hidden, _ = keep_pair
    quant = converted("quantize")
    assert _main_bytes(quant) == _main_bytes(converted("keep"))  # so the saved targets are this quant's
    data = validate(ValidateOptions(ASSET, quant, hidden=hidden, activations="off", **COMMON)).to_json()
    cmp = data["comparison"]
    assert data["candidate"]["mtp"]["precision"] == {"nvfp4": 7, "bf16": 1}  # fc stays BF16
    assert cmp["mtp"]["kl"]["mean"] > 0 and cmp["mtp"]["kl"]["max"] > 0
    assert cmp["mtp"]["top1_agreement"] > 0.5
    emulated = validate(ValidateOptions(ASSET, quant, hidden=hidden, activations="emulate", **COMMON)).to_json()
    assert len(emulated["candidate"]["mtp"]["emulated_activations"]) == 7
    assert emulated["comparison"]["mtp"]["kl"]["mean"] != cmp["mtp"]["kl"]["mean"]


def test_dropped_mtp_is_a_failure(
    converted: Callable[[str], Path],
    keep_pair: tuple[ValidationReport, Path, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, hidden, _ = keep_pair
    drop = converted("drop")
    argv = ["-q", "validate", str(ASSET), str(drop), "--hidden", str(hidden), "--num-prompts", "3", "--device", "cpu"]
    assert main(argv) == ExitCode.VALIDATE_FAIL
    out = capsys.readouterr().out
    assert "verdict: FAIL: candidate: the checkpoint has no MTP layer" in out


def _altered(src: Path, dst: Path, change: Callable[[str, torch.Tensor], torch.Tensor | None]) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``change(name, tensor)`` applied to every tensor (None: kept)."""
    shutil.copytree(src, dst)
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(shard)
        changed = {n: change(n, t) for n, t in tensors.items()}
        if any(v is not None for v in changed.values()):
            save_file({n: (t if changed[n] is None else changed[n]) for n, t in tensors.items()}, shard, metadata)
    return dst


def _strict_json(path: Path) -> Any:
    def refuse(token: str) -> None:
        raise AssertionError(f"{path.name} holds {token}: not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_non_finite_scales_are_a_broken_candidate(
    converted: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-finite quantization scales: the target's logits are NaN, it emits one constant token, and the MTP,
    fed the same NaN, agrees with it (AL near k + 1). That is a broken candidate (exit 25), not a PASS."""
    first = "model.language_model.layers.0.mlp.down_proj.weight_scale_2"

    def poison(name: str, t: torch.Tensor) -> torch.Tensor | None:
        return torch.full_like(t, float("nan")) if name == first else None

    bad = _altered(converted("keep"), tmp_path / "nan-scales", poison)
    argv = ["-q", "validate", str(ASSET), str(bad), "--num-prompts", "8", "--max-len", "64", "--device", "cpu"]
    assert main([*argv, "--report-dir", str(tmp_path / "r")]) == ExitCode.VALIDATE_BROKEN
    out = capsys.readouterr().out
    verdict_line = next(line for line in out.splitlines() if line.startswith("verdict: "))
    assert verdict_line.startswith("verdict: FAIL: candidate is broken: candidate's main model gives non-finite logits")
    assert "below the floor of 50 %" in verdict_line and "AL rises by +" in verdict_line
    data = _strict_json(tmp_path / "r" / "report.json")  # no bare NaN anywhere
    assert data["verdict"]["broken"] is True and data["candidate"]["non_finite"]["target"] > 0
    main_cmp = data["comparison"]["main"]
    assert main_cmp["kl"] is None and main_cmp["non_finite"] == main_cmp["positions"]
    assert main_cmp["top1_agreement"] < 0.5


def test_random_mtp_fails(
    converted: Callable[[str], Path], keep_pair: tuple[ValidationReport, Path, Path], tmp_path: Path
) -> None:
    gen = torch.Generator().manual_seed(0)

    def scramble(name: str, t: torch.Tensor) -> torch.Tensor | None:
        if not name.startswith("mtp.") or t.dtype != torch.bfloat16:
            return None
        return (torch.randn(t.shape, generator=gen) * t.float().std()).to(t.dtype)

    rand = _altered(converted("keep"), tmp_path / "random-mtp", scramble)
    _, hidden, _ = keep_pair  # the same main model as keep: its saved target runs serve
    result = validate(ValidateOptions(ASSET, rand, hidden=hidden, **COMMON))
    verdict = result.report.verdict
    assert verdict.status == "fail" and not verdict.broken and verdict.exit_code == ExitCode.VALIDATE_FAIL
    assert verdict.reasons[0].startswith("candidate MTP is broken: AL 1.0")


def test_context_buckets_are_filled(tmp_path: Path) -> None:
    """--context-buckets: the prompts are planned to fill every bucket, long default prompts included, and the
    per-position acceptance is reported and plotted per bucket."""
    result = validate(
        ValidateOptions(
            ASSET,
            num_prompts=6,
            max_len=64,
            k=2,
            context_buckets=(64, 160, 320),
            device="cpu",
            progress=False,
            report_dir=tmp_path / "r",
        )
    )
    row = result.report.reference.acceptance_by_sampling[0].by_k[-1]
    assert [(b.low, b.high) for b in row.by_context] == [(0, 64), (64, 160), (160, 320)]
    assert all(b.steps > 0 for b in row.by_context)  # two prompts per bucket, each drafting inside it
    assert sum(b.steps for b in row.by_context) == row.num_steps
    assert (tmp_path / "r" / "context.png").is_file()
    profile = json.loads((tmp_path / "r" / "speculation_profile.json").read_text())
    assert [b["context"] for b in profile["by_context"]] == [[0, 64], [64, 160], [160, 320]]
    assert profile["measurement_conditions"]["context_buckets"] == [[0, 64], [64, 160], [160, 320]]
    with pytest.raises(ValidateError, match="supports contexts up to"):
        validate(ValidateOptions(ASSET, context_buckets=(64, 10**7), device="cpu", progress=False))
