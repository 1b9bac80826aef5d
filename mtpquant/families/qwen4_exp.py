"""Registry entry: Qwen3.8-Flash-Next, published as ``model_type: qwen4_exp`` (day-0 label ``qwen3_8_flash_next``).

Facts from vLLM 0.32 (``vllm/models/qwen4_exp/nvidia/{mtp,model,qsa,hyperconnection,ngram_embedding}.py``,
``vllm/config/speculative.py``) and transformers 5.19 (``models/qwen4_exp``); see
shared/fixtures/real-layouts/Qwen3.8-Flash-Next_qwen4_exp_layout.md.

Its MTP (31 tensors at depth 1, routed experts fused 3-D; a per-expert bank loads too): ``mtp.fc_embedding``
and ``mtp.fc_hidden`` [H, H] instead of ``mtp.fc``, ``mtp.pre_fc_norm_hidden`` over all ``hc_count`` streams
[hc_count * H], a ``hyper_connection_mixer`` instead of ``mtp.norm``, and per layer two hyper-connections, a
QSA attention with its indexer, and the MoE block. vLLM names the MTP's modules ``mtp.layers.{num_hidden_layers
+ i}`` and renames ``mtp.*`` entries of ignore / exclude / quantized_layers lists the same way (mtp.py 68-160).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtpquant.errors import MtpConfigError
from mtpquant.families.mtp_config import config_int
from mtpquant.families.qwen3 import (
    EXPERTS_GROUP,
    SHARED_EXPERT_GROUP,
    attention_shapes,
    expert_bank_shapes,
    shared_expert_shapes,
)
from mtpquant.families.schema import EngineRules, Family, ForcedUnquantized, MtpGroup, MtpLayout

__all__ = ["QWEN4_EXP"]


def _hyper_connection(prefix: str, hidden: int, hc: int, rank: int, combine: bool) -> dict[str, tuple[int, ...]]:
    """A GatedResidual's tensors (transformers Qwen4ExpTextGatedResidual): norm over all streams, low-rank mixer,
    and (with ``combine``) the per-stream injection weights."""
    R = hc * hidden
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.hc_norm.weight": (R,),
        f"{prefix}.input_mix_weight_down.weight": (rank, R),
        f"{prefix}.input_mix_weight_up.weight": (R, rank),
    }
    if combine:
        shapes[f"{prefix}.block_inject_weight.weight"] = (hc, R)
    return shapes


def qwen4_exp_mtp_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """Every ``mtp.*`` tensor of a Qwen4-Exp text config with ``layers`` MTP layers (31 at depth 1, fused experts)."""
    H = config_int(text, "hidden_size")
    hc, rank = config_int(text, "hc_count"), config_int(text, "hc_lowrank")
    E, inter = config_int(text, "num_experts"), config_int(text, "moe_intermediate_size")
    shared = config_int(text, "shared_expert_intermediate_size")
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc_embedding.weight": (H, H),
        "mtp.fc_hidden.weight": (H, H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (hc * H,),
        **_hyper_connection("mtp.hyper_connection_mixer", H, hc, rank, combine=False),
    }
    indexed = text.get("indexer_n_heads") is not None  # vLLM builds QSA only when the indexer is configured
    for i in range(layers):
        p = f"mtp.layers.{i}."
        shapes |= _hyper_connection(p + "attn_hyper_connection", H, hc, rank, combine=True)
        shapes |= _hyper_connection(p + "mlp_hyper_connection", H, hc, rank, combine=True)
        shapes |= attention_shapes(p, text, gate=2)  # q_proj: Q and its sigmoid output gate, always
        if indexed:
            ih, ikv = config_int(text, "indexer_n_heads"), config_int(text, "indexer_kv_heads")
            ihd = config_int(text, "indexer_head_dim")
            shapes |= {
                p + "self_attn.indexer.index_qk_proj.weight": ((ih + ikv) * ihd, H),
                p + "self_attn.indexer.q_layernorm.weight": (ihd,),
                p + "self_attn.indexer.k_layernorm.weight": (ihd,),
            }
        shapes[p + "mlp.gate.weight"] = (E, H)
        if per_expert:
            shapes |= expert_bank_shapes(p, E, inter, H)
        else:
            shapes |= {p + "mlp.experts.gate_up_proj": (E, 2 * inter, H), p + "mlp.experts.down_proj": (E, H, inter)}
        shapes |= shared_expert_shapes(p, H, shared)
    return shapes


_QSA_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")


def qwen4_exp_mtp_check(text: Mapping[str, Any]) -> None:
    """What the reference forward (``mtpquant.mtp.qwen4_exp``: transformers' Qwen4-Exp classes) needs beyond the
    common MTP dimensions, refused in one line before anything loads: a QSA MTP layer (vLLM builds plain attention
    without ``indexer_n_heads``, another layout), transformers' QSA rules, two or more hyper-connection streams."""
    missing = [k for k in _QSA_KEYS if text.get(k) is None]
    if missing:
        raise MtpConfigError(
            f"the Qwen4-Exp MTP forward needs a QSA layer; the text config lacks {', '.join(missing)}"
        )
    for key in (*_QSA_KEYS, "hc_count", "hc_lowrank"):
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise MtpConfigError(f"text config key {key!r} must be a positive integer, got {value!r}")
    if text["indexer_kv_heads"] != 1:
        raise MtpConfigError(f"indexer_kv_heads must be 1 (transformers' QSA), got {text['indexer_kv_heads']}")
    if text["indexer_budget"] % text["indexer_compress_ratio"]:
        raise MtpConfigError("indexer_budget must be a multiple of indexer_compress_ratio")
    if text["hc_count"] < 2:
        raise MtpConfigError(f"hc_count must be at least 2, got {text['hc_count']}")


_MTP = MtpLayout(
    # speculative.py 845-864: mtp_num_hidden_layers, else num_nextn_predict_layers; the predictor builds
    # getattr(config, "mtp_num_hidden_layers", 1) layers (mtp.py 190), so an absent key means one layer
    depth_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
    default_layers=1,
    setting_keys=("index_share_for_mtp_iteration",),
    shapes=qwen4_exp_mtp_shapes,
    per_expert=False,
    either_expert_form=True,
    # mtp.py 205-229: fc_embedding / fc_hidden are ColumnParallelLinear with the draft quant config; the layer's
    # o_proj, shared expert and routed experts take it too (qsa.py 421-426, Qwen3NextSparseMoeBlock)
    engine_linears=(
        "mtp.fc_embedding",
        "mtp.fc_hidden",
        "mtp.layers.*.self_attn.o_proj",
        "mtp.layers.*.mlp.shared_expert.*_proj",
        "mtp.layers.*.mlp.experts",
        "mtp.layers.*.mlp.experts.*_proj",  # a per-expert bank
    ),
    unquantized=(
        "mtp.layers.*.self_attn.q_proj",
        "mtp.layers.*.self_attn.k_proj",
        "mtp.layers.*.self_attn.v_proj",
        "mtp.layers.*.self_attn.indexer.*",
        "mtp.*hyper_connection*",
        "mtp.layers.*.mlp.gate",
        "mtp.layers.*.mlp.shared_expert_gate",
    ),
    fused_groups=(("gate_proj", "up_proj"),),
    engine_layer_offset=True,
    # model.py 636-642: the drafter reads the multi-stream state the final mixer collapses
    hidden_source="hyper_connection_mixer",
    config_check=qwen4_exp_mtp_check,
    # the precision groups: the two input projections, the attention's o_proj (q/k/v and the indexer stay BF16: QSA
    # builds its qkv projection without modelopt_fp4), the shared expert and the routed experts
    groups=(
        MtpGroup("input", "input projections (mtp.fc_embedding, mtp.fc_hidden)", ("mtp.fc_embedding", "mtp.fc_hidden")),
        MtpGroup("attention", "attention output projection", ("mtp.layers.*.self_attn.o_proj",)),
        SHARED_EXPERT_GROUP,
        EXPERTS_GROUP,
    ),
)

_ENGINE = EngineRules(
    # model.py 703-716 (Qwen4ExpForCausalLM.packed_modules_mapping; the VL wrapper's adds the same, 954-962)
    packed={
        "qkv_proj": ("q_proj", "k_proj", "v_proj", "indexer.index_qk_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
        "kv_proj": ("key_proj", "value_proj"),
        "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
    },
    # hyperconnection.py 100-135: every hyper-connection Linear is built with quant_config=None
    built_unquantized=("*.mlp.gate", "*.mlp.shared_expert_gate", "*hyper_connection*"),
    forced_unquantized=(
        # model.py 104-110 without_modelopt_fp4, used for the QSA qkv(+indexer) projection (qsa.py 411-417, 502-506)
        ForcedUnquantized(
            "modelopt_fp4", "*.self_attn.qkv_proj", "vLLM's Qwen4Exp QSA (without_modelopt_fp4)", workaround=False
        ),
    ),
    # ngram_embedding.py: the PLE n-gram table is an embedding looked up, with its own quantization rule
    embedding_tables=("*.ple.ple_embedding.ngram_embedding",),
    # registry.py: vLLM 0.32 knows these labels only (not the day-0 qwen3_8_flash_next ones)
    known_architectures=frozenset(
        {"Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM", "qwen4_exp", "qwen4_exp_text"}
    ),
)

QWEN4_EXP = Family(
    key="qwen4_exp",
    display="Qwen3.8-Flash-Next (Qwen4-Exp)",
    model_types=frozenset({"qwen4_exp", "qwen4_exp_text", "qwen3_8_flash_next", "qwen3_8_flash_next_text"}),
    architectures=frozenset(
        {
            "Qwen4ExpForConditionalGeneration",
            "Qwen4ExpForCausalLM",
            "Qwen3_8FlashNextForConditionalGeneration",
            "Qwen3_8FlashNextForCausalLM",
        }
    ),
    moe=True,
    wrapper_prefix="model.language_model.",
    text_only_prefixes=("model.language_model.", "model."),
    has_vision=True,
    mtp=_MTP,
    engine=_ENGINE,
    wrapper_class="Qwen4ExpForConditionalGeneration",
    text_class="Qwen4ExpForCausalLM",
    fused_groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.indexer.index_qk_proj"),
        ("shared_expert.gate_proj", "shared_expert.up_proj"),
        ("gate_proj", "up_proj"),
        ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
        ("ple.key_proj", "ple.value_proj"),
    ),
    unquantized=(
        "lm_head",
        "*embed_tokens",
        "*.mlp.gate",
        "*.shared_expert_gate",
        "*linear_attn.conv1d",
        "*linear_attn.in_proj_a",
        "*linear_attn.in_proj_b",
        "*hyper_connection*",
        "*self_attn.q_proj",
        "*self_attn.k_proj",
        "*self_attn.v_proj",
        "*self_attn.indexer*",
        "*ple.conv1d",
        "*ple.ple_embedding*",
        "model.visual*",
        "mtp*",
    ),
    fused_main_experts=True,
    aliases={
        "qwen3_8_flash_next": "qwen4_exp",
        "qwen3_8_flash_next_text": "qwen4_exp_text",
        "Qwen3_8FlashNextForConditionalGeneration": "Qwen4ExpForConditionalGeneration",
        "Qwen3_8FlashNextForCausalLM": "Qwen4ExpForCausalLM",
    },
    lineage_keys=(
        "hc_count",
        "hc_lowrank",
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "ple_layer_ids",
        "ple_embed_dim",
        "layer_types",
    ),
    sglang_mixed_mtp=True,
    vllm_drafters=("Qwen4ExpMTP",),
    vllm_remap="mtp.layers.{i} -> mtp.layers.{N+i}, in module names and in ignore / exclude / quantized_layers entries",
    sources=("models/qwen4_exp/nvidia/mtp.py", "config/speculative.py"),
)
