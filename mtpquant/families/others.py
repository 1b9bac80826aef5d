"""Registry entries beyond the appended layer: Nemotron-H (``mtp.layers.{j}``, sub-layers of one depth), MiMo-7B and
MiMo-V2-Flash (a sub-namespace of ``model.``), and the families mtpquant recognises but does not repair: MiniMax-M2
(an MTP declared and never shipped) and DeepSeek-V4.1 (``mtp.*`` holds a DSpark drafter, not an MTP).

Facts from vLLM 0.32 (``model_executor/models/nemotron_h_mtp.py``, ``mimo_mtp.py``, ``mimo_v2_mtp.py``,
``config/speculative.py``, ``model_executor/models/registry.py``) and transformers 5.19 (``nemotron_h``,
``mimo_v2_flash``, ``minimax_m2``, ``deepseek_v4`` configs); see shared/reference/mtp-families.md §4, 5, 8, 9, 13.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from mtpquant.errors import MtpConfigError
from mtpquant.families.mtp_config import config_int
from mtpquant.families.nextn import AppendedForward
from mtpquant.families.schema import NEVER_SHIPPED, NOT_MTP, EngineRules, Family, MtpGroup, MtpLayout
from mtpquant.families.storage import NAMESPACE, SUBSPACE, MtpStorage

__all__ = ["OTHER_FAMILIES"]

_SUBLAYER_KEYS = ("mtp_hybrid_override_pattern", "mtp_layers_block_type")


def nemotron_h_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """Nemotron-H's MTP, every tensor: per depth, ``enorm`` / ``hnorm`` / ``eh_proj`` on its first sub-layer,
    ``final_layernorm`` on its last, a ``norm`` on each (nemotron_h_mtp.py: has_start_projections / has_end_norm),
    and each sub-layer's mixer by its pattern character (nemotron_h.py): ``*`` attention ``q/k/v/o_proj``; ``E`` the
    ungated MoE (router ``gate`` with its F32 ``e_score_correction_bias``, ``shared_experts.{up,down}_proj``, per-expert
    ``experts.{e}.{up,down}_proj``, with ``moe_latent_size`` the latent ``fc1/fc2_latent_proj``); ``-`` a dense
    ``up/down_proj``. Nemotron-3 Super ("*E", 512 experts, latent MoE): 8 + 1,032 = 1,040 tensors."""
    del per_expert
    H = config_int(text, "hidden_size")
    pattern = next((text[k] for k in _SUBLAYER_KEYS if text.get(k)), "*E")
    if isinstance(pattern, list):  # mtp_layers_block_type: transformers' names
        chars = {"full_attention": "*", "attention": "*", "moe": "E", "mlp": "-"}
        pattern = "".join(chars.get(t, "?") for t in pattern)
    per = len(pattern)
    out: dict[str, tuple[int, ...]] = {}
    for d in range(layers):
        first, last = f"mtp.layers.{d * per}.", f"mtp.layers.{d * per + per - 1}."
        out |= {first + "enorm.weight": (H,), first + "hnorm.weight": (H,), first + "eh_proj.weight": (H, 2 * H)}
        for j, kind in enumerate(pattern):
            p = f"mtp.layers.{d * per + j}."
            out[p + "norm.weight"] = (H,)
            out |= _nemotron_h_mixer(p + "mixer.", kind, text)
        out[last + "final_layernorm.weight"] = (H,)
    return out


def _nemotron_h_mixer(p: str, kind: str, text: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    H = config_int(text, "hidden_size")
    if kind == "*":
        heads, kv = config_int(text, "num_attention_heads"), config_int(text, "num_key_value_heads")
        hd = int(text.get("head_dim") or H // heads)
        return {p + "q_proj.weight": (heads * hd, H), p + "k_proj.weight": (kv * hd, H),
                p + "v_proj.weight": (kv * hd, H), p + "o_proj.weight": (H, heads * hd)}
    if kind == "-":
        inter = config_int(text, "intermediate_size")
        return {p + "up_proj.weight": (inter, H), p + "down_proj.weight": (H, inter)}
    if kind != "E":
        raise MtpConfigError(f"mtp_hybrid_override_pattern: sub-layer {kind!r} is not one vLLM's NemotronH MTP "
                             "builds (nemotron_h_mtp.py: '*' attention, 'E' MoE)")
    E = config_int(text, "n_routed_experts")
    inter = config_int(text, "moe_intermediate_size")
    latent = text.get("moe_latent_size")
    width = int(latent) if latent else H
    # vLLM's shared expert is moe_shared_expert_intermediate_size * n_shared_experts wide (NemotronHMoE)
    shared = config_int(text, "moe_shared_expert_intermediate_size") * int(text.get("n_shared_experts") or 1)
    out: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (E, H),
        p + "gate.e_score_correction_bias": (E,),
        p + "shared_experts.up_proj.weight": (shared, H),
        p + "shared_experts.down_proj.weight": (H, shared),
    }
    if latent:
        out |= {p + "fc1_latent_proj.weight": (width, H), p + "fc2_latent_proj.weight": (H, width)}
    for e in range(E):
        out |= {p + f"experts.{e}.up_proj.weight": (inter, width), p + f"experts.{e}.down_proj.weight": (width, inter)}
    return out


def mimo_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """MiMo-7B's MTP (vLLM mimo_mtp.py MiMoMultiTokenPredictorLayer): two input norms, ``input_proj`` [H, 2H] over
    ``[hidden, embed]``, a Qwen2 decoder layer with QKV bias, ``final_layernorm``: 16 tensors per layer."""
    del per_expert
    H, heads, kv = (config_int(text, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    hd, inter = H // heads, config_int(text, "intermediate_size")
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"model.mtp_layers.{i}."
        out |= {
            p + "token_layernorm.weight": (H,),
            p + "hidden_layernorm.weight": (H,),
            p + "input_proj.weight": (H, 2 * H),
            p + "final_layernorm.weight": (H,),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (heads * hd, H),
            p + "self_attn.q_proj.bias": (heads * hd,),
            p + "self_attn.k_proj.weight": (kv * hd, H),
            p + "self_attn.k_proj.bias": (kv * hd,),
            p + "self_attn.v_proj.weight": (kv * hd, H),
            p + "self_attn.v_proj.bias": (kv * hd,),
            p + "self_attn.o_proj.weight": (H, heads * hd),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        }
    return out


def mimo_v2_shapes(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """MiMo-V2-Flash's MTP glue per layer (vLLM mimo_v2_mtp.py: ``model.mtp.layers.{i}.{enorm, hnorm, eh_proj,
    final_layernorm}``); its sliding-window attention and dense MLP are not enumerated."""
    del per_expert
    H = config_int(text, "hidden_size")
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        p = f"model.mtp.layers.{i}."
        out |= {p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "eh_proj.weight": (H, 2 * H),
                p + "final_layernorm.weight": (H,)}
    return out


def _none(text: Mapping[str, Any], layers: int, per_expert: bool) -> dict[str, tuple[int, ...]]:
    del text, layers, per_expert
    return {}


_MIMO_LAYER = re.compile(r"^model\.mtp_layers\.(\d+)\.")


def _mimo_rename(name: str, num_hidden_layers: int) -> str:
    """vLLM's MiMoMTP builds depth i as ``model.layers.{num_hidden_layers + i}`` (mimo_mtp.py 104-117)."""
    m = _MIMO_LAYER.match(name)
    return name if m is None else f"model.layers.{num_hidden_layers + int(m.group(1))}.{name[m.end() :]}"


def _layout(storage: MtpStorage, shapes: Any, inventory: str, **kw: Any) -> MtpLayout:
    return MtpLayout(
        depth_keys=kw.pop("depth_keys", ("num_nextn_predict_layers",)),
        default_layers=kw.pop("default_layers", 0),
        setting_keys=kw.pop("setting_keys", ()),
        shapes=shapes,
        per_expert=True,
        either_expert_form=False,
        engine_linears=("*_proj", "*.experts"),
        unquantized=("*.eh_proj", "*.input_proj", "*norm*", "*.gate"),
        fused_groups=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        storage=storage,
        inventory=inventory,
        **kw,
    )


def _family(key: str, display: str, model_types: set[str], archs: set[str], mtp: MtpLayout, **kw: Any) -> Family:
    engine = EngineRules(
        packed=kw.pop("packed", {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}),
        built_unquantized=kw.pop("built_unquantized", ("*.mlp.gate",)),
        sglang_plain=kw.pop("sglang_plain", ()),
        drafters=kw.pop("drafters"),
    )
    return Family(
        key=key,
        display=display,
        model_types=frozenset(model_types),
        architectures=frozenset(archs),
        moe=kw.pop("moe", True),
        wrapper_prefix=kw.pop("wrapper_prefix", "model."),
        text_only_prefixes=kw.pop("text_only_prefixes", ("model.",)),
        has_vision=False,
        mtp=mtp,
        engine=engine,
        wrapper_class=None,
        text_class=kw.pop("text_class", next(iter(archs))),
        fused_groups=(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("gate_proj", "up_proj")),
        unquantized=("lm_head", "*embed_tokens", "*.mlp.gate", "*norm*"),
        fused_main_experts=False,
        mtp_forward=kw.pop("mtp_forward", False),
        mtp_heal=False,
        convert=kw.pop("convert", False),
        **kw,
    )


# Nemotron-H: eh_proj is a ColumnParallelLinear with the draft quant config (quantizable); the draft's
# hf_to_vllm_mapper drops "language_model." so the checkpoint's own names match (nemotron_h_mtp.py 336-339).
# What NVFP4 leaves BF16 follows NVIDIA's Nemotron-3 releases (docs/families.md): the routed and shared experts are
# quantized; attention, the Mamba mixers (in_proj, out_proj, conv1d), the latent MoE projections, the router (a
# GateLinear without a quantization config, nemotron_h.py NemotronHMoE), norms, embeddings and lm_head stay BF16.
_NEMOTRON_H_BF16 = ("*.mixer.q_proj", "*.mixer.k_proj", "*.mixer.v_proj", "*.mixer.o_proj", "*.mixer.in_proj",
                    "*.mixer.out_proj", "*.mixer.conv1d", "*.mixer.fc1_latent_proj", "*.mixer.fc2_latent_proj")
NEMOTRON_H = replace(
    _family(
        "nemotron_h",
        "Nemotron-H / Nemotron-3",
        {"nemotron_h", "nemotron_h_puzzle"},
        {"NemotronHForCausalLM", "NemotronHPuzzleForCausalLM"},
        replace(
            _layout(MtpStorage(NAMESPACE, sublayers_key=_SUBLAYER_KEYS), nemotron_h_shapes, "exact",
                    setting_keys=(*_SUBLAYER_KEYS, "mtp_n_routed_experts"),
                    groups=(MtpGroup("shared_expert", "shared expert", ("*.mixer.shared_experts.*_proj",)),
                            MtpGroup("experts", "routed experts", ("*.mixer.experts.*_proj",)))),
            # the MTP as the trunk: its attention BF16, eh_proj BF16 as every family's (vLLM could quantize it)
            unquantized=("*.eh_proj", "*norm*", "*.mixer.gate", *_NEMOTRON_H_BF16),
            fused_groups=(("q_proj", "k_proj", "v_proj"),),
        ),
        packed={"qkv_proj": ("q_proj", "k_proj", "v_proj")},  # the experts and shared experts are ungated (up, down)
        built_unquantized=("*.mixer.gate",),
        text_class="NemotronHForCausalLM",  # transformers has no NemotronHPuzzle class
        drafters={"vllm": "NemotronHMTPModel", "sglang": "NemotronHForCausalLMMTP"},
        sources=("model_executor/models/nemotron_h_mtp.py", "config/speculative.py"),
        vllm_remap="mtp.layers. -> model.layers., embeddings -> embed_tokens, language_model. dropped "
        "(hf_to_vllm_mapper)",
        # the releases store the trunk under backbone. (transformers' conversion_mapping renames it to model.)
        wrapper_prefix="backbone.",
        text_only_prefixes=("backbone.", "model."),
    ),
    fused_groups=(("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),),
    unquantized=("lm_head", "*embeddings", "*embed_tokens", "*.mixer.gate", "*norm*", *_NEMOTRON_H_BF16),
    mtp_forward=True,  # mtp/nemotron_h.py
    mtp_heal=False,
    convert=True,
)
MIMO = _family(
    "mimo",
    "MiMo-7B",
    {"mimo"},
    {"MiMoForCausalLM"},
    _layout(MtpStorage(SUBSPACE, root="model.mtp_layers.", layer=""), mimo_shapes, "exact", engine_rename=_mimo_rename),
    moe=False,
    built_unquantized=("*.input_proj",),  # a plain nn.Linear (mimo_mtp.py 56)
    drafters={"vllm": "MiMoMTPModel", "sglang": "MiMoMTP"},
    sources=("model_executor/models/mimo_mtp.py", "config/speculative.py"),
    vllm_remap="model.mtp_layers.{i} -> model.layers.{N+i}, the block under mtp_block.",
)
# MiMo-V2-Flash ships 3 MTP layers; vLLM (_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1) builds the first, eh_proj a
# ReplicatedLinear without a quant config (mimo_v2_mtp.py 75)
# MiMo-V2-Flash ships 3 MTP layers; vLLM (_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1) builds the first, eh_proj a
# ReplicatedLinear without a quant config (mimo_v2_mtp.py 75), the attention and the dense MLP with it; its forward is
# mtp/mimo_v2.py (the first layer at every draft step, final_layernorm's output recycled, the target's head)
MIMO_V2_FLASH = _family(
    "mimo_v2_flash",
    "MiMo-V2-Flash / V2.5",
    {"mimo_v2_flash", "mimo_v2"},
    {"MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM"},
    _layout(MtpStorage(SUBSPACE, root="model.mtp."), mimo_v2_shapes, "glue", default_layers=1,
            appended=AppendedForward("mimo_v2_flash", "MiMoV2Flash", recycle_normed=True, mask_position_zero=False)),
    built_unquantized=("*.mlp.gate", "*.eh_proj"),
    drafters={"vllm": "MiMoV2MTPModel", "sglang": "MiMoV2MTP"},
    sources=("model_executor/models/mimo_v2_mtp.py", "config/speculative.py"),
    vllm_remap="the checkpoint's own names (model.mtp.layers.{i}); vLLM builds the first layer only",
    text_class="MiMoV2FlashForCausalLM",
    hf_renames=((".self_attn.attention_sink_bias", ".self_attn.sinks"),),  # conversion_mapping "mimo_v2_flash"
    mtp_forward=True,
    convert=True,
)
MINIMAX_M2 = _family(
    "minimax_m2",
    "MiniMax-M2 / M2.1 / M2.5 / M2.7",
    {"minimax_m2"},
    {"MiniMaxM2ForCausalLM"},
    _layout(MtpStorage(NAMESPACE), _none, "none", depth_keys=("num_mtp_modules",)),
    drafters={"vllm": "", "sglang": ""},
    sources=("config/speculative.py",),
    status=NEVER_SHIPPED,
    status_note=(
        "MiniMax-M2 configs declare num_mtp_modules (use_mtp: true), but MiniMax never published MTP weights for "
        "M2 (MiniMax-AI/MiniMax-M2#47): declared, never shipped, so there is nothing to inspect, graft or repair; "
        "vLLM serves MTP only for MiniMax-M3"
    ),
)
DEEPSEEK_V41 = _family(
    "deepseek_v41",
    "DeepSeek-V4.1",
    {"deepseek_v41"},
    {"DeepseekV41ForCausalLM"},
    _layout(MtpStorage(NAMESPACE, layer=""), _none, "none"),
    drafters={"vllm": "", "sglang": "DSPARK"},
    sources=("config/speculative.py", "model_executor/models/registry.py"),
    status=NOT_MTP,
    status_note=(
        "DeepSeek-V4.1 keeps a DSpark drafter under mtp.* (dspark_block_size), not an MTP: vLLM 0.32 refuses "
        'method="mtp" for deepseek_v41 (config/speculative.py); serve it with SGLang --speculative-algorithm DSPARK'
    ),
)

OTHER_FAMILIES: tuple[Family, ...] = (NEMOTRON_H, MIMO, MIMO_V2_FLASH, MINIMAX_M2, DEEPSEEK_V41)
