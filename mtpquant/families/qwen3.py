"""Registry entries: Qwen3.5 / Qwen3.6 dense and MoE (Qwen3.8-27B is ``qwen3_5`` too) and Qwen3-Next.

Their MTP: ``mtp.fc`` [H, 2H] over the concatenated normed embedding and hidden state, ``mtp.norm``, one
decoder layer per depth (gated attention, dense MLP or MoE with per-expert routed experts). vLLM builds it
in ``qwen3_5_mtp.py`` / ``qwen3_next_mtp.py`` under the checkpoint's own names (``mtp.layers.0...``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtpquant.families.mtp_config import config_int
from mtpquant.families.schema import EngineRules, Family, ForcedUnquantized, MtpGroup, MtpLayout

__all__ = [
    "ATTENTION_GROUP",
    "EXPERTS_GROUP",
    "INPUT_GROUP",
    "MLP_GROUP",
    "QWEN3_FAMILIES",
    "SHARED_EXPERT_GROUP",
    "attention_shapes",
    "expert_bank_shapes",
    "qwen3_mtp_shapes",
    "shared_expert_shapes",
]


def attention_shapes(p: str, text: Mapping[str, Any], gate: int) -> dict[str, tuple[int, ...]]:
    """The gated attention's tensors under ``p`` (``gate`` 2: q_proj also holds the output gate)."""
    H = config_int(text, "hidden_size")
    heads, kv = config_int(text, "num_attention_heads"), config_int(text, "num_key_value_heads")
    hd = config_int(text, "head_dim")
    return {
        p + "self_attn.q_proj.weight": (gate * heads * hd, H),
        p + "self_attn.k_proj.weight": (kv * hd, H),
        p + "self_attn.v_proj.weight": (kv * hd, H),
        p + "self_attn.o_proj.weight": (H, heads * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
    }


def shared_expert_shapes(p: str, hidden: int, shared: int) -> dict[str, tuple[int, ...]]:
    """The MoE block's shared expert and its sigmoid gate under ``p``."""
    return {
        p + "mlp.shared_expert.gate_proj.weight": (shared, hidden),
        p + "mlp.shared_expert.up_proj.weight": (shared, hidden),
        p + "mlp.shared_expert.down_proj.weight": (hidden, shared),
        p + "mlp.shared_expert_gate.weight": (1, hidden),
    }


def expert_bank_shapes(p: str, experts: int, inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Routed experts stored per expert under ``p`` (gate, up, down for each expert in turn)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for e in range(experts):
        q = f"{p}mlp.experts.{e}."
        shapes[q + "gate_proj.weight"] = (inter, hidden)
        shapes[q + "up_proj.weight"] = (inter, hidden)
        shapes[q + "down_proj.weight"] = (hidden, inter)
    return shapes


def qwen3_mtp_shapes(text: Mapping[str, Any], layers: int, moe: bool) -> dict[str, tuple[int, ...]]:
    """The exact ``mtp.*`` tensor names and shapes of a Qwen3.5 / Qwen3-Next config with ``layers`` MTP layers."""
    H = config_int(text, "hidden_size")
    gate = 2 if text.get("attn_output_gate", True) else 1
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
    }
    for i in range(layers):
        p = f"mtp.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            **attention_shapes(p, text, gate),
        }
        if moe:
            E, inter = config_int(text, "num_experts"), config_int(text, "moe_intermediate_size")
            shared = config_int(text, "shared_expert_intermediate_size")
            shapes |= {
                p + "mlp.gate.weight": (E, H),
                **shared_expert_shapes(p, H, shared),
            }
            shapes |= expert_bank_shapes(p, E, inter, H)
        else:
            inter = config_int(text, "intermediate_size")
            shapes |= {
                p + "mlp.gate_proj.weight": (inter, H),
                p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter),
            }
    return shapes


def _dense_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    del per_expert
    return qwen3_mtp_shapes(text, layers, moe=False)


def _moe_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    del per_expert  # the Qwen3 MTPs store routed experts per expert only
    return qwen3_mtp_shapes(text, layers, moe=True)


# The precision groups (``convert --mtp auto``): the input projection, the attention projections (q/k/v are packed
# into vLLM's qkv_proj), then the dense MLP (gate/up packed) or the MoE's shared expert and routed experts (one fused
# MoE module in the engines). The router mlp.gate and shared_expert_gate are in none: engines never quantize them.
INPUT_GROUP = MtpGroup("input", "input projection (mtp.fc)", ("mtp.fc",))
ATTENTION_GROUP = MtpGroup("attention", "attention projections", ("mtp.layers.*.self_attn.*_proj",))
MLP_GROUP = MtpGroup(
    "mlp", "dense MLP", ("mtp.layers.*.mlp.gate_proj", "mtp.layers.*.mlp.up_proj", "mtp.layers.*.mlp.down_proj")
)
SHARED_EXPERT_GROUP = MtpGroup("shared_expert", "shared expert", ("mtp.layers.*.mlp.shared_expert.*_proj",))
EXPERTS_GROUP = MtpGroup("experts", "routed experts", ("mtp.layers.*.mlp.experts.*_proj",))
_DENSE_GROUPS = (INPUT_GROUP, ATTENTION_GROUP, MLP_GROUP)
_MOE_GROUPS = (INPUT_GROUP, ATTENTION_GROUP, SHARED_EXPERT_GROUP, EXPERTS_GROUP)


def _layout(shapes: Any, keys: tuple[str, ...], default: int, groups: tuple[MtpGroup, ...]) -> MtpLayout:
    return MtpLayout(
        depth_keys=keys,
        default_layers=default,
        setting_keys=(),
        shapes=shapes,
        per_expert=True,
        either_expert_form=False,
        engine_linears=(
            "mtp.fc",
            "mtp.layers.*.self_attn.*_proj",
            "mtp.layers.*.mlp.*_proj",
            "mtp.layers.*.mlp.experts",
        ),
        # quantize mode keeps the input projection and the MoE gates in BF16 (SGLang and vLLM's modelopt_fp4
        # workaround build mtp.fc unquantized; the gates are never quantized by vLLM)
        unquantized=("mtp.fc", "mtp.layers.*.mlp.gate", "mtp.layers.*.mlp.shared_expert_gate"),
        fused_groups=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        groups=groups,
    )


# vLLM 0.32 packed_modules_mapping of Qwen3_5(Moe)ForConditionalGeneration and Qwen3NextForCausalLM.
_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
# vLLM's Qwen3.5 / Qwen3-Next MTP builds mtp.fc unquantized for modelopt_fp4 (a workaround for NVIDIA's first
# 397B export, which excluded only mtp.layers.0*); not for compressed-tensors or MIXED_PRECISION.
_FC_WORKAROUND = ForcedUnquantized("modelopt_fp4", "mtp.fc", "vLLM's Qwen3.5 MTP mtp.fc workaround", workaround=True)
_ENGINE = EngineRules(
    packed=_PACKED,
    built_unquantized=("*.mlp.gate", "*.mlp.shared_expert_gate"),
    forced_unquantized=(_FC_WORKAROUND,),
    # TensorRT-LLM drafts Qwen3.5 and Qwen3-Next with Qwen3NextMTP (_torch/models/modeling_qwen3_next.py)
    drafters={"trtllm": "Qwen3NextMTP"},
)

_COMMON_UNQUANTIZED = (
    "lm_head",
    "*embed_tokens",
    "*.mlp.gate",
    "*.shared_expert_gate",
    "*linear_attn.conv1d",
    "model.visual*",
    "mtp*",
)
_LINEAR_ATTN_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "full_attention_interval",
    "attn_output_gate",
    "layer_types",
)

# vLLM 0.32 config/speculative.py hf_config_override -> registry.py _SPECULATIVE_DECODING_MODELS (qwen3_5_mtp.py,
# qwen3_next_mtp.py): the drafter class each family's MTP loads as
_SOURCES = ("model_executor/models/qwen3_5_mtp.py", "config/speculative.py")


def _qwen3_5(key: str, display: str, stem: str, moe: bool) -> Family:
    """A Qwen3.5 / Qwen3.6 entry (dense or MoE): the wrapper with vision and its text-only re-export."""
    shapes, groups = (_moe_shapes, _MOE_GROUPS) if moe else (_dense_shapes, _DENSE_GROUPS)
    mlp = (("shared_expert.gate_proj", "shared_expert.up_proj"), ("gate_proj", "up_proj")) if moe else ()
    return Family(
        key=key,
        display=display,
        model_types=frozenset({key, key + "_text"}),
        architectures=frozenset({stem + "ForConditionalGeneration", stem + "ForCausalLM"}),
        moe=moe,
        wrapper_prefix="model.language_model.",
        text_only_prefixes=("model.language_model.", "model."),
        has_vision=True,
        mtp=_layout(shapes, ("mtp_num_hidden_layers",), 0, groups),
        engine=_ENGINE,
        wrapper_class=stem + "ForConditionalGeneration",
        text_class=stem + "ForCausalLM",
        fused_groups=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            *(mlp or (("mlp.gate_proj", "mlp.up_proj"),)),
            ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
        ),
        unquantized=(*_COMMON_UNQUANTIZED, "*linear_attn.in_proj_a", "*linear_attn.in_proj_b"),
        fused_main_experts=moe,
        lineage_keys=_LINEAR_ATTN_KEYS,
        vllm_drafters=("Qwen3_5MoeMTP",) if moe else ("Qwen3_5MTP",),
        vllm_remap="mtp. -> model. (the drafter's module; its quantization prefix stays mtp.)",
        sources=_SOURCES,
    )


QWEN3_FAMILIES: tuple[Family, ...] = (
    _qwen3_5("qwen3_5", "Qwen3.5 / Qwen3.6 dense", "Qwen3_5", moe=False),
    _qwen3_5("qwen3_5_moe", "Qwen3.5 / Qwen3.6 MoE", "Qwen3_5Moe", moe=True),
    Family(
        key="qwen3_next",
        display="Qwen3-Next",
        model_types=frozenset({"qwen3_next"}),
        architectures=frozenset({"Qwen3NextForCausalLM"}),
        moe=True,
        wrapper_prefix="model.",
        text_only_prefixes=("model.",),
        has_vision=False,
        mtp=_layout(_moe_shapes, (), 1, _MOE_GROUPS),
        engine=_ENGINE,
        wrapper_class=None,
        text_class="Qwen3NextForCausalLM",
        fused_groups=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("shared_expert.gate_proj", "shared_expert.up_proj"),
            ("gate_proj", "up_proj"),
        ),
        unquantized=(*_COMMON_UNQUANTIZED, "*linear_attn.in_proj_ba"),
        fused_main_experts=False,
        lineage_keys=_LINEAR_ATTN_KEYS,
        vllm_drafters=("Qwen3NextMTP",),
        vllm_remap="mtp. -> model. (the drafter's module; its quantization prefix stays mtp.)",
        sources=("model_executor/models/qwen3_next_mtp.py", "config/speculative.py"),
    ),
)
