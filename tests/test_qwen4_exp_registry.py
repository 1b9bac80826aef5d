"""Qwen3.8-Flash-Next (qwen4_exp) as registry data: recognition, the MTP inventory, depth keys, the engine's
layer remap, the tiny checkpoint in the real layout, and the torch-free MTP config parse refusing at plan time."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import ExitCode, MtpConfigError, MtpModeError
from mtpquant.families import FAMILIES, family, mtp_config, resolve
from mtpquant.synth.qwen4_exp import FULL_TEXT_CONFIG, TINY_TEXT_CONFIG, ngram_buffers, qwen4_exp_config
from mtpquant.synth.tiny import TINY_VISION

pytestmark = pytest.mark.dev


def _full() -> dict:
    return qwen4_exp_config(FULL_TEXT_CONFIG, TINY_VISION)


def test_four_families_one_schema() -> None:
    assert [f.key for f in FAMILIES][:4] == ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp"]
    spec = resolve(_full())
    assert spec.family.key == "qwen4_exp" and spec.architecture == "Qwen4ExpForConditionalGeneration"
    assert spec.mtp.describe() == "text_config.mtp_num_hidden_layers = 1"


def test_full_size_mtp_inventory_is_31_tensors_with_real_shapes() -> None:
    shapes = resolve(_full()).expected_mtp_shapes()
    assert len(shapes) == 31
    H, R = 2560, 4 * 2560
    assert shapes["mtp.fc_embedding.weight"] == shapes["mtp.fc_hidden.weight"] == (H, H)
    assert shapes["mtp.pre_fc_norm_embedding.weight"] == (H,)
    assert shapes["mtp.pre_fc_norm_hidden.weight"] == (R,)
    assert shapes["mtp.hyper_connection_mixer.input_mix_weight_down.weight"] == (320, R)
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in shapes  # the mixer has no combine
    assert shapes["mtp.layers.0.attn_hyper_connection.block_inject_weight.weight"] == (4, R)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 24 * 256, H)
    assert shapes["mtp.layers.0.self_attn.o_proj.weight"] == (H, 24 * 256)
    assert shapes["mtp.layers.0.self_attn.indexer.index_qk_proj.weight"] == ((4 + 1) * 128, H)
    assert shapes["mtp.layers.0.mlp.experts.gate_up_proj"] == (512, 2 * 640, H)
    assert shapes["mtp.layers.0.mlp.experts.down_proj"] == (512, H, 640)
    assert not any(n in shapes for n in ("mtp.fc.weight", "mtp.norm.weight"))


def test_per_expert_bank_is_the_other_valid_form() -> None:
    spec = resolve(_full())
    bank = spec.expected_mtp_shapes(["mtp.layers.0.mlp.experts.7.down_proj.weight"])
    assert len(bank) == 29 + 3 * 512
    assert bank["mtp.layers.0.mlp.experts.511.gate_proj.weight"] == (640, 2560)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" not in bank


def test_depth_keys_fallback_and_engine_default() -> None:
    cfg = _full()
    del cfg["text_config"]["mtp_num_hidden_layers"]
    spec = resolve(cfg)
    assert spec.mtp.layers == 1 and spec.mtp.describe() == "not in config (engines default to 1 layer)"
    cfg["text_config"]["num_nextn_predict_layers"] = 2
    assert resolve(cfg).mtp.describe() == "text_config.num_nextn_predict_layers = 2"
    assert len(resolve(cfg).expected_mtp_shapes()) == 7 + 2 * 24


@pytest.mark.parametrize(
    ("label", "model_type"),
    [("Qwen3_8FlashNextForConditionalGeneration", "qwen3_8_flash_next"), (None, "qwen3_8_flash_next_text")],
)
def test_day0_aliases_are_recognised(label: str | None, model_type: str) -> None:
    cfg = qwen4_exp_config(FULL_TEXT_CONFIG, TINY_VISION, alias=True)
    if label is None:
        cfg = dict(cfg["text_config"])
    spec = resolve(cfg)
    assert spec.family.key == "qwen4_exp"
    assert (label or spec.architecture) == spec.architecture
    assert ("model_type" if label is None else "architectures[0]", label or model_type) in [
        (w, a) for w, a, _ in spec.aliases()
    ]


def test_engine_layer_remap_mirrors_vllm() -> None:
    layout = family("qwen4_exp").mtp
    # vllm/models/qwen4_exp/nvidia/mtp.py _remap_ignored_layers: only names starting with "mtp.", every number
    # after ".layers." offset by num_hidden_layers; `mtp*` and main-model names are unchanged
    assert layout.engine_name("mtp.layers.0.mlp.experts.3.down_proj", 48) == "mtp.layers.48.mlp.experts.3.down_proj"
    assert layout.engine_name("mtp.layers.0*", 48) == "mtp.layers.48*"
    assert layout.engine_name("mtp*", 48) == "mtp*"
    assert layout.engine_name("mtp.fc_hidden", 48) == "mtp.fc_hidden"
    assert layout.engine_name("model.language_model.layers.0.mlp.gate", 48) == "model.language_model.layers.0.mlp.gate"
    assert family("qwen3_5").mtp.engine_name("mtp.layers.0.mlp.gate", 40) == "mtp.layers.0.mlp.gate"


def test_tiny_qwen4_exp_is_the_real_layout(tiny_factory: Callable[[str], Path]) -> None:
    ckpt = Checkpoint.open(tiny_factory("qwen4_exp"))
    spec = ckpt.spec
    assert spec.family.key == "qwen4_exp" and spec.wrapped
    mtp = {e.name: e.shape for e in ckpt.mtp_tensors()}
    assert mtp == spec.expected_mtp_shapes() and len(mtp) == 31
    t = spec.text
    names = set(ckpt.tensors)
    # PLE on layer 1 (1-indexed): n-gram table in split_ngram_parts shards plus the three int64 buffers
    shards = [n for n in names if ".ple.ple_embedding.ngram_embedding.shard_" in n]
    assert len(shards) == t["split_ngram_parts"] == 4
    p = "model.language_model.layers.0.ple.ple_embedding."
    assert {
        ckpt.tensors[p + b].dtype for b in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    } == {"I64"}
    sizes = ckpt.read_tensor(p + "ngram_heads_vocab_sizes").tolist()
    assert sizes == ngram_buffers(t, 0)["ngram_heads_vocab_sizes"] == [97, 101, 103, 107]  # the first primes from 97
    assert ckpt.read_tensor(p + "ngram_heads_offsets").tolist() == [0, 97, 198, 301]
    rows = sum(ckpt.tensors[n].shape[0] for n in shards)
    assert rows == 512  # 408 rows padded to a multiple of 128
    # no final norm: the final hyper-connection mixer; fused 3-D experts; QSA indexer on the full-attention layer
    assert "model.language_model.norm.weight" not in names
    assert "model.language_model.hyper_connection_mixer.hc_norm.weight" in names
    assert ckpt.tensors["model.language_model.layers.3.mlp.experts.gate_up_proj"].shape == (4, 128, 128)
    assert "model.language_model.layers.3.self_attn.indexer.index_qk_proj.weight" in names
    assert any(n.startswith("model.visual.") for n in names)
    assert TINY_TEXT_CONFIG["hidden_size"] == t["hidden_size"]


def test_mtp_forward_refusals_are_torch_free_and_typed() -> None:
    full = _full()
    assert mtp_config(full).hidden_size == 2560  # mtpquant.mtp.qwen4_exp computes this MTP
    no_qsa = copy.deepcopy(full)
    del no_qsa["text_config"]["indexer_n_heads"]  # vLLM builds plain attention then: another MTP layout
    with pytest.raises(MtpConfigError, match="needs a QSA layer; the text config lacks indexer_n_heads"):
        mtp_config(no_qsa)
    q35 = json.loads((Path(__file__).parent / "fixtures/real-layouts/Qwen3.5-4B_config.json").read_text())
    assert mtp_config(q35).hidden_size == 2560
    bad = copy.deepcopy(q35)
    bad["text_config"]["attn_output_gate"] = False
    with pytest.raises(MtpConfigError, match="attn_output_gate false") as err:
        mtp_config(bad)
    assert isinstance(err.value, ValueError) and err.value.exit_code == ExitCode.CHECKPOINT


def test_quantize_refuses_attn_output_gate_false_at_plan_time(
    tiny_factory: Callable[[str], Path], tmp_path: Path
) -> None:
    """Before: --mtp quantize accepted the plan and failed after load and calibration with a traceback."""
    from safetensors.torch import load_file, save_file

    from mtpquant.convert.run import ConvertOptions, convert

    src = tmp_path / "src"
    src.mkdir()
    base = tiny_factory("qwen3_5-tied")
    for f in base.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["attn_output_gate"] = False
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    q = "mtp.layers.0.self_attn.q_proj.weight"
    tensors[q] = tensors[q][: tensors[q].shape[0] // 2].contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MtpModeError, match="--mtp quantize cannot calibrate this MTP: attn_output_gate false") as err:
        convert(ConvertOptions(src=str(src), out=tmp_path / "out", mtp="quantize", dry_run=True, device="cpu"))
    assert err.value.exit_code == ExitCode.MTP_MODE
    assert not (tmp_path / "out").exists()


def test_quantizable_mtp_modules_are_registry_data() -> None:
    """What a quantized MTP may quantize: the engine's quantizable Linears less those kept BF16 (Qwen3.5: every
    Linear but mtp.fc and the gates, as before; Qwen4-Exp: fc_embedding, fc_hidden, o_proj, the experts)."""
    from mtpquant.checkpoint.modules import linear_modules
    from mtpquant.mtp.quantize import mtp_quantized_modules

    q4 = resolve(_full()).expected_mtp_shapes(["mtp.layers.0.mlp.experts.0.up_proj.weight"])
    quantized = mtp_quantized_modules(linear_modules(q4), family("qwen4_exp").mtp)
    assert [m for m in quantized if ".experts." not in m] == [
        "mtp.fc_embedding",
        "mtp.fc_hidden",
        "mtp.layers.0.mlp.shared_expert.down_proj",
        "mtp.layers.0.mlp.shared_expert.gate_proj",
        "mtp.layers.0.mlp.shared_expert.up_proj",
        "mtp.layers.0.self_attn.o_proj",
    ]
    assert sum(".experts." in m for m in quantized) == 3 * 512
    q35 = json.loads((Path(__file__).parent / "fixtures/real-layouts/Qwen3.5-4B_config.json").read_text())
    modules = linear_modules(resolve(q35).expected_mtp_shapes())
    assert sorted(set(modules) - set(mtp_quantized_modules(modules))) == ["mtp.fc"]
