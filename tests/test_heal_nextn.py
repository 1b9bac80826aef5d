"""heal on the appended-layer layout: the trained tiny GLM-4.5-layout model's ``--mtp keep`` quant (its BF16 MTP
``model.layers.2``) trained through the family's MTP forward (``mtp/nextn.py``: transformers' ``MtpLayer`` with
GLM's decoder block, the chain reading the pre-norm stream as vLLM's ``Glm4MoeMTP`` does), written back under the
checkpoint's names (routed experts per expert, the router's ``e_score_correction_bias`` F32), and measured better on
held-out prompts; the same for the tiny DeepSeek-V3-layout model (its MLA block on the CPU through transformers'
``DeepseekV3DecoderLayer``, the chain reading ``shared_head.norm``'s output as vLLM's ``DeepSeekMTP`` does; no
trained asset: its random MTP accepts nothing before the heal); the trained DeepSeek-V3 asset's NVFP4 MTP
(``--mtp quantize``) heals with modelopt's fake quantization and goes back NVFP4."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.heal.options import HealOptions
from mtpquant.heal.run import heal
from mtpquant.synth.train import TINY_MTP_ASSETS

pytestmark = pytest.mark.slow

SOURCE = TINY_MTP_ASSETS["glm4_moe"]
CALIB = {"calib_samples": 8, "calib_seq_len": 64, "device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def quants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The GLM source's keep convert (the one quant the GLM test heals)."""
    out = {"keep": tmp_path_factory.mktemp("heal-nextn") / "keep"}
    convert(ConvertOptions(src=str(SOURCE), out=out["keep"], mtp="keep", **CALIB))  # type: ignore[arg-type]
    return out


def test_heal_trains_the_glm_mtp_and_the_held_out_al_rises(quants: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "healed"
    # --force: written whatever the check says (at k = 2 and 3 its interval on 24 prompts may still hold 0)
    opts = HealOptions(quant=str(quants["keep"]), source=str(SOURCE), out=out, samples=32, check_prompts=24,
                       force=True, device="cpu", progress=False)  # fmt: skip
    result = heal(opts)
    assert result.check is not None and result.training is not None
    assert result.training.last_loss < result.training.first_loss
    k1 = result.check.by_k[0]
    assert k1.k == 1 and k1.change > 0.02 and k1.low > 0, result.check  # better beyond noise at k = 1
    before, after = Checkpoint.open(quants["keep"], strict=True), Checkpoint.open(out, strict=True)
    assert sorted(before.tensors) == sorted(after.tensors)
    assert {n: (e.dtype, e.shape) for n, e in before.tensors.items()} == {
        n: (e.dtype, e.shape) for n, e in after.tensors.items()
    }
    mtp = [e.name for e in before.mtp_tensors()]
    changed = {n for n in mtp if before.read_raw(before.tensors[n]) != after.read_raw(after.tensors[n])}
    # the trained Linears and norms changed; the router's correction bias (a buffer) and every trunk tensor did not
    assert "model.layers.2.eh_proj.weight" in changed and "model.layers.2.mlp.experts.3.down_proj.weight" in changed
    assert "model.layers.2.mlp.gate.e_score_correction_bias" not in changed
    assert after.tensors["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == "F32"
    trunk = [n for n in before.tensors if n not in set(mtp)]
    assert all(before.read_raw(before.tensors[n]) == after.read_raw(after.tensors[n]) for n in trunk)
    assert inspect_checkpoint(out).healthy


def test_heal_trains_the_quantized_deepseek_mtp_and_writes_it_back_nvfp4(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trained DeepSeek-V3-layout asset's ``--mtp quantize`` quant (its routed and shared experts NVFP4 W4A4,
    eh_proj / MLA / router BF16) heals through modelopt's fake quantization on exactly its NVFP4 Linears (the
    appended layer's names mapped by the layer itself), trains from SRC's BF16 MTP, and goes back in the same
    layout: every MTP tensor in QUANT's dtype and shape, the NVFP4 Linears re-quantized (their input scales QUANT's
    own bytes, gate and up of each expert sharing one global scale as modelopt exports them), the copies and the
    router's correction bias unchanged, every tensor outside the MTP and the quant config byte for byte."""
    source = TINY_MTP_ASSETS["deepseek_v3"]
    quant = tmp_path / "quantize"
    convert(ConvertOptions(src=str(source), out=quant, mtp="quantize", **CALIB))  # type: ignore[arg-type]
    before = Checkpoint.open(quant, strict=True)
    nvfp4 = sorted(e.name[: -len(".weight")] for e in before.mtp_tensors() if e.dtype == "U8")
    assert len(nvfp4) == 15  # 4 routed experts and the shared expert, gate / up / down each
    out = tmp_path / "healed"
    # --force: written whatever the check says (a quant whose MTP is barely hurt may not heal beyond noise)
    opts = HealOptions(quant=str(quant), source=str(source), out=out, samples=32, check_prompts=24, steps=40,
                       force=True, device="cpu", progress=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mtpquant.heal.qat"):
        result = heal(opts)
    assert f"modelopt fake quantization on {len(nvfp4)} MTP Linears (NVFP4 (W4A4))" in caplog.text
    assert result.plan.storage.fmt == "nvfp4" and result.plan.master == "SRC"
    assert sorted(result.plan.storage.quantized) == nvfp4
    assert result.check is not None and result.training is not None
    assert result.training.last_loss < result.training.first_loss
    after = Checkpoint.open(out, strict=True)
    assert {n: (e.dtype, e.shape) for n, e in before.tensors.items()} == {
        n: (e.dtype, e.shape) for n, e in after.tensors.items()
    }
    changed = {n for n in before.tensors if before.read_raw(before.tensors[n]) != after.read_raw(after.tensors[n])}
    mtp = {e.name for e in before.mtp_tensors()}
    assert changed <= mtp  # the trunk byte for byte
    for m in nvfp4:
        assert {m + ".weight", m + ".weight_scale"} <= changed, m  # re-quantized from the trained weights
        assert m + ".input_scale" not in changed  # QUANT's own activation scale, which training used
    untouched = {"model.layers.2.shared_head.head.weight", "model.layers.2.embed_tokens.weight",
                 "model.layers.2.mlp.gate.e_score_correction_bias"}  # fmt: skip
    assert not untouched & changed
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.self_attn.q_a_proj.weight"} <= changed
    for name in ("config.json", "hf_quant_config.json"):
        assert (out / name).read_bytes() == (quant / name).read_bytes()
    # the format as declared: every NVFP4 Linear decodes with its scales; one global scale per modelopt group (gate
    # and up of one MLP, down alone) = the group's max|W| / (6 x 448), so the group's largest block scale is E4M3's 448
    from mtpquant.formats.nvfp4 import dequantize_nvfp4

    groups: dict[str, list[str]] = {}
    for m in nvfp4:
        stem, _, proj = m.rpartition(".")
        groups.setdefault(f"{stem}.{'down' if proj == 'down_proj' else 'gate_up'}", []).append(m)
    for group, members in groups.items():
        scales_2 = {after.read_raw(after.tensors[m + ".weight_scale_2"]) for m in members}
        assert len(scales_2) == 1, group
        largest = 0.0
        for m in members:
            packed, scale = after.read_tensor(m + ".weight"), after.read_tensor(m + ".weight_scale")
            w = dequantize_nvfp4(packed, scale, after.read_tensor(m + ".weight_scale_2"))
            assert w.shape == (packed.shape[0], 2 * packed.shape[1]) and bool(w.isfinite().all()), m
            largest = max(largest, float(scale.float().max()))
        assert 416 <= largest <= 448, (group, largest)  # E4M3's two largest values: rounding of 448
    report = inspect_checkpoint(out)
    assert report.healthy and report.mtp_precision == inspect_checkpoint(quant).mtp_precision


def test_heal_trains_the_deepseek_mtp_and_writes_back_only_its_trained_tensors(
    tiny_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """DeepSeek-V3's appended layer heals as GLM's does: its whole block (MLA included) and glue train, ``eh_proj``
    and every other MTP tensor go back in their stored dtype (BF16, the router's correction bias F32, unchanged),
    the head and embedding copies (the drafter reads the target's) and every trunk tensor byte for byte."""
    source = tiny_factory("deepseek_v3")
    keep = tmp_path / "keep"
    convert(ConvertOptions(src=str(source), out=keep, mtp="keep", **CALIB))  # type: ignore[arg-type]
    out = tmp_path / "healed"
    opts = HealOptions(quant=str(keep), source=str(source), out=out, samples=32, check_prompts=24, force=True,
                       device="cpu", progress=False)  # fmt: skip
    result = heal(opts)
    assert result.check is not None and result.training is not None
    assert result.training.last_loss < 0.6 * result.training.first_loss
    k1 = result.check.by_k[0]
    # a random MTP drafts next to nothing; the healed one is better beyond noise at k = 1
    assert k1.k == 1 and k1.before < 1.01 and k1.change > 0.02 and k1.low > 0, result.check
    before, after = Checkpoint.open(keep, strict=True), Checkpoint.open(out, strict=True)
    assert {n: (e.dtype, e.shape) for n, e in before.tensors.items()} == {
        n: (e.dtype, e.shape) for n, e in after.tensors.items()
    }
    changed = {n for n in before.tensors if before.read_raw(before.tensors[n]) != after.read_raw(after.tensors[n])}
    mtp = {e.name for e in before.mtp_tensors()}
    untrained = {"model.layers.2.shared_head.head.weight", "model.layers.2.embed_tokens.weight",
                 "model.layers.2.mlp.gate.e_score_correction_bias"}  # fmt: skip
    assert len(mtp) == 32 and untrained <= mtp
    assert changed == mtp - untrained  # every trained tensor (eh_proj, MLA, experts, norms) and nothing else
    assert after.tensors["model.layers.2.eh_proj.weight"].dtype == "BF16"
    assert after.tensors["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert inspect_checkpoint(out).healthy
