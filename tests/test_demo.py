"""The README's main job: convert --keep-mtp, validate and inspect the embedded trained tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpquant.cli import main as cli


def test_demo_main_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["-q", "demo", "--workdir", str(tmp_path), "--num-prompts", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "MTP on identical inputs: top-1 agreement 100.00 %, KL(ref||cand) mean 0" in out
    assert "vLLM: MTP loads (BF16)" in out and "verdict: healthy" in out
    report = json.loads((tmp_path / "tiny-qwen3_5-nvfp4" / "validation" / "report.json").read_text())
    # 4 prompts cannot tell the target-side AL drop from the allowed one: the demo says so instead of guessing
    assert report["verdict"]["status"] == "inconclusive"
    assert "verdict: INCONCLUSIVE: sample too small" in out and "MTP +0.000 [+0.000, +0.000]" in out
    # the report's notes are printed, every one of them
    assert [f"note: {n}" for n in report["notes"]] == [line for line in out.splitlines() if line.startswith("note: ")]
    assert any(n.startswith("Activations were not quantized (--activations off)") for n in report["notes"])
    assert (tmp_path / "tiny-qwen3_5-nvfp4" / "validation" / "report.md").exists()


@pytest.mark.slow
def test_demo_qwen4_exp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same job on the trained tiny Qwen3.8-Flash-Next: the kept MTP drafts exactly as the source's; 4 prompts
    are too few to decide the target's part, and the verdict says so."""
    argv = ["-q", "demo", "--family", "qwen4_exp", "--workdir", str(tmp_path), "--num-prompts", "4", "--device", "cpu"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert "MTP on identical inputs: top-1 agreement 100.00 %, KL(ref||cand) mean 0" in out
    assert "vLLM: MTP loads (BF16)" in out and "verdict: healthy" in out
    report = json.loads((tmp_path / "tiny-qwen4_exp-nvfp4" / "validation" / "report.json").read_text())
    assert report["verdict"]["status"] == "inconclusive"
    assert "verdict: INCONCLUSIVE: sample too small" in out and "MTP +0.000 [+0.000, +0.000]" in out
    assert report["reference"]["acceptance"]["by_k"][0]["acceptance_rate"] >= 0.4


def test_qwen4_exp_asset_layout() -> None:
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.families import TensorClass
    from mtpquant.synth.train import TINY_MTP_ASSETS

    asset = TINY_MTP_ASSETS["qwen4_exp"]
    ckpt = Checkpoint.open(asset, strict=True)
    assert sum(p.stat().st_size for p in asset.iterdir()) <= 8 * 1024 * 1024
    assert ckpt.config["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    groups = ckpt.by_class()
    mtp = groups[TensorClass.MTP]
    assert len(mtp) == 31 and {e.dtype for e in mtp} == {"BF16"} and len({e.shard for e in mtp}) == 2
    names = set(ckpt.tensors)
    assert any(".ple.ple_embedding.ngram_embedding.shard_" in n for n in names)
    assert not any(n.endswith("ngram_embedding.weight") for n in names)
    assert {ckpt.tensors[n].dtype for n in names if "ngram_heads" in n or "layer_multipliers" in n} == {"I64"}
    training = json.loads((asset / "training.json").read_text())
    assert training["spec"]["family"] == "qwen4_exp"
    # measured by scripts/train_tiny_mtp.py (32 held-out prompts)
    assert training["acceptance"]["by_k"][0]["acceptance_rate"] >= 0.4
