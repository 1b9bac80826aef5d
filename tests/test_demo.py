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
