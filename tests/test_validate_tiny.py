"""validate on the trained tiny model (the embedded default), before vs after ``convert``.

``convert`` runs once per MTP mode (keep, quantize, drop) with two short calibration rows. The keep
pair runs both target models and saves their hidden states; the quantize and drop candidates have
the same main model (checked byte for byte), so they reuse that file instead of re-running targets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.cli import main
from mtpquant.errors import ExitCode
from mtpquant.families import TensorClass
from mtpquant.synth.train import TINY_MTP_ASSET
from mtpquant.validate.run import ValidateOptions, validate
from mtpquant.validate.schema import ValidationReport

pytestmark = pytest.mark.slow

ASSET = TINY_MTP_ASSET
CALIB: dict[str, Any] = {"calib_samples": 2, "calib_seq_len": 32}
COMMON: dict[str, Any] = {"num_prompts": 3, "max_len": 48, "k": 3, "device": "cpu", "progress": False}


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
    assert data["verdict"]["status"] in {"pass", "warn"}
    assert {p.name for p in report_dir.iterdir()} == {"report.json", "report.md", "acceptance.png", "kl.png"}


def _main_bytes(path: Path) -> str:
    ckpt = Checkpoint.open(path)
    h = hashlib.sha256()
    for name in sorted(n for n in ckpt.tensors if ckpt.classify(n) != TensorClass.MTP):
        h.update(name.encode() + ckpt.read_raw(ckpt.tensors[name]))
    return h.hexdigest()


def test_quantize_mode_reports_a_measured_difference(
    converted: Callable[[str], Path], keep_pair: tuple[ValidationReport, Path, Path]
) -> None:
    _, hidden, _ = keep_pair
    quant = converted("quantize")
    assert _main_bytes(quant) == _main_bytes(converted("keep"))  # so the saved targets are this quant's
    data = validate(ValidateOptions(ASSET, quant, hidden=hidden, **COMMON)).to_json()
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
