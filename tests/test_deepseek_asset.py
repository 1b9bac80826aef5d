"""The trained tiny DeepSeek-V3-layout model (mtpquant/assets/tiny-deepseek_v3-mtp, scripts/train_tiny_mtp.py
--family deepseek_v3): MLA, its MTP at model.layers.2 with the head and embedding copies its drafter loads, alone in
the last shard, and a measured acceptance (so DeepSeek's numbers are real, not a random MTP's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.families import TensorClass
from mtpquant.synth.train import TINY_MTP_ASSETS

pytestmark = pytest.mark.dev

ASSET = TINY_MTP_ASSETS["deepseek_v3"]


def test_the_asset_is_a_healthy_deepseek_v3_checkpoint() -> None:
    ckpt = Checkpoint.open(ASSET, strict=True)
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 4 * 1024 * 1024
    assert ckpt.config["architectures"] == ["DeepseekV3ForCausalLM"] and ckpt.config["vocab_size"] == 2048
    assert ckpt.config["kv_lora_rank"] and ckpt.config["q_lora_rank"]  # MLA
    mtp = {e.name: e for e in ckpt.by_class()[TensorClass.MTP]}
    assert {e.shard for e in mtp.values()} == {"model-00002-of-00002.safetensors"}
    assert all(n.startswith("model.layers.2.") for n in mtp) and ckpt.config["num_hidden_layers"] == 2
    # the copies are the trunk's head and embedding, byte for byte (as DeepSeek's releases ship them)
    for copy, of in (("model.layers.2.shared_head.head.weight", "lm_head.weight"),
                     ("model.layers.2.embed_tokens.weight", "model.embed_tokens.weight")):
        assert ckpt.read_raw(mtp[copy]) == ckpt.read_raw(ckpt.tensors[of])
    assert inspect_checkpoint(ASSET).exit_code(strict=True) == 0


def test_the_asset_records_its_measured_acceptance() -> None:
    training = json.loads((ASSET / "training.json").read_text())
    assert training["spec"]["family"] == "deepseek_v3"
    by_k = training["acceptance"]["by_k"]
    assert by_k[0]["mean_acceptance_length"] >= 1.3  # measured by scripts/train_tiny_mtp.py (validate, k = 1..3)


@pytest.mark.slow
def test_the_asset_has_the_tiny_variants_tensor_set(tiny_factory: Callable[[str], Path]) -> None:
    ckpt = Checkpoint.open(ASSET, strict=True)
    tiny = Checkpoint.open(tiny_factory("deepseek_v3"), strict=True)
    assert sorted(ckpt.tensors) == sorted(tiny.tensors)
    assert {n: e.dtype for n, e in ckpt.tensors.items()} == {n: e.dtype for n, e in tiny.tensors.items()}


@pytest.mark.slow
def test_validate_measures_the_asset_and_its_nvfp4_quant_above_1_3(tmp_path: Path) -> None:
    """``mtpquant validate ASSET QUANT`` (the built-in replay, greedy, vLLM's rule) on the asset's
    ``convert --mtp quantize`` quant: AL at k = 1 of at least 1.3 on both sides, measured now from the weights (not
    the number training.json recorded), so a regressed asset fails here (docs/BENCHMARKS.md: 1.590 / 1.526 on 32
    prompts)."""
    from mtpquant.convert.run import ConvertOptions, convert
    from mtpquant.validate.run import ValidateOptions, validate

    quant = tmp_path / "quantize"
    convert(ConvertOptions(src=str(ASSET), out=quant, mtp="quantize", calib_samples=8, calib_seq_len=64, device="cpu",
                           progress=False))  # fmt: skip
    report = validate(ValidateOptions(ASSET, quant, num_prompts=16, k=1, device="cpu", progress=False)).to_json()
    al = {side: report[side]["acceptance"]["by_k"][0] for side in ("reference", "candidate")}
    assert all(row["k"] == 1 for row in al.values())
    assert al["reference"]["mean_acceptance_length"] >= 1.3, al
    assert al["candidate"]["mean_acceptance_length"] >= 1.3, al
