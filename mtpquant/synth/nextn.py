"""Tiny checkpoints of the families beyond Qwen, in their real on-disk layouts (``mtpquant tiny --variant V``).

The trunk comes from the family's transformers 5.19 class (random weights), built with the MTP's layers appended
(``num_hidden_layers + depth`` layers, the extra ones of the MTP's kind), so the MTP's decoder block is exactly the
trunk's layer as transformers builds it; the block is then moved where the family stores its MTP (DeepSeek / GLM:
it stays at ``model.layers.{N+i}``; Nemotron-H: ``mtp.layers.{j}``; MiMo-V2-Flash: ``model.mtp.layers.{i}``; MiMo-7B:
``model.mtp_layers.{i}``) and the glue the registry names (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.*``,
MiMo's ``input_proj``) is added with the registry's shapes. Routed experts are stored per expert (transformers keeps
them fused in memory), Nemotron-H's trunk under ``backbone.``, as the published checkpoints store them. The written
config declares the trunk's layer count and the MTP depth, as the releases do.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from mtpquant.families import resolve

__all__ = ["NEXTN_CONFIGS", "nextn_config", "nextn_tensors", "per_expert"]

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "bfloat16",
}
_DEEPSEEK = {
    **_COMMON,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "num_nextn_predict_layers": 1,
}
# The configs as the releases write them (num_hidden_layers: the trunk; the MTP depth key), per family key.
NEXTN_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **_DEEPSEEK},
    "deepseek_v32": {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        **_DEEPSEEK,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 16,
    },
    # GLM-5-like: DeepSeek-V3.2's MLA and indexer (the indexer's RoPE interleaved), the MTP sharing its first
    # step's token selection with the later ones (index_share_for_mtp_iteration, as GLM-5 ships it)
    "glm_moe_dsa": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        **_DEEPSEEK,
        "rms_norm_eps": 1e-5,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 16,
        "index_share_for_mtp_iteration": True,
    },
    # GLM-4.5-like: head_dim 32 (vLLM's CPU attention refuses 16), partial rotary, QK norm, QKV bias
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **_COMMON,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "use_qk_norm": True,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "num_nextn_predict_layers": 1,
    },
    # Nemotron-3 Super-like: a Mamba layer, an attention layer and an MoE layer (transformers' hybrid cache needs one
    # attention layer to count its length); the MTP one depth of two sub-layers ("*E")
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        **{k: v for k, v in _COMMON.items() if k not in ("intermediate_size", "n_shared_experts")},
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "hybrid_override_pattern": "M*E",
        "mtp_hybrid_override_pattern": "*E",
        "num_nextn_predict_layers": 1,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "chunk_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": 1e-5,
    },
    # MiMo-V2-Flash-like: full + sliding attention, a dense first layer; the MTP a sliding, dense layer
    "mimo_v2_flash": {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        **{k: v for k, v in _COMMON.items() if k != "n_shared_experts"},
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "v_head_dim": 64,
        "sliding_window": 64,
        "layer_types": ["full_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "n_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-5,
        "add_swa_attention_sink_bias": True,  # the sliding layers' (and the MTP's) attention_sink_bias
        "num_nextn_predict_layers": 1,
    },
    # Step-3.5-Flash-like (text-only Step3p5ForCausalLM): full + sliding attention with the head-wise gate, a dense
    # first layer then MoE; three appended MTP layers (sliding, dense), each with its own head (shared_head.output)
    "step3p5": {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        **{k: v for k, v in _COMMON.items() if k not in ("n_routed_experts", "n_shared_experts")},
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "n_routed_experts": 4,
        "share_expert_dim": 64,
        "sliding_window": 64,
        # the releases' legacy per-layer forms: layer_types padded with the three MTP layers' (sliding), the MoE layers
        # by index (moe_layers_enum: the MTP layers, not listed, are dense), as vLLM's Step3p5Config reads them
        "layer_types": ["full_attention", "sliding_attention", *["sliding_attention"] * 3],
        "moe_layers_enum": "1",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "num_nextn_predict_layers": 3,
    },
    # MiMo-7B-like: a Qwen2 trunk (the release loads with trust_remote_code; vLLM's MiMoForCausalLM)
    "mimo": {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "dtype": "bfloat16",
        "num_nextn_predict_layers": 1,
    },
}
# transformers class and config model_type that build each family's trunk (MiMo-7B's is Qwen2's)
_TRUNK = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "deepseek_v32": ("DeepseekV32ForCausalLM", "deepseek_v32"),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "glm_moe_dsa"),
    "glm4_moe": ("Glm4MoeForCausalLM", "glm4_moe"),
    "nemotron_h": ("NemotronHForCausalLM", "nemotron_h"),
    "mimo_v2_flash": ("MiMoV2FlashForCausalLM", "mimo_v2_flash"),
    "mimo": ("Qwen2ForCausalLM", "qwen2"),
    "step3p5": ("Step3p7TextModel", "step3p5"),  # transformers has no text-only Step head: lm_head added here
}
# per family: config keys the trunk builder needs beyond the release's, for N + depth layers
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def nextn_config(family: str, mtp: bool = True) -> dict[str, Any]:
    """The release-style config.json of family ``family``'s tiny checkpoint (``mtp=False``: depth 0)."""
    config = copy.deepcopy(NEXTN_CONFIGS[family])
    if not mtp:
        config["num_nextn_predict_layers"] = 0
        for key in ("layer_types",):  # Step's padded list loses the MTP layers' entries too
            if key in config and family == "step3p5":
                config[key] = config[key][: config["num_hidden_layers"]]
    return config


def _trunk_config(family: str, config: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """The transformers config of the trunk with the MTP's ``depth`` layers appended (of the MTP's kind)."""
    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")}
    n = cfg["num_hidden_layers"]
    if family == "nemotron_h":
        pattern = cfg.pop("hybrid_override_pattern") + cfg.pop("mtp_hybrid_override_pattern") * depth
        kinds = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}
        cfg["layers_block_type"] = [kinds[c] for c in pattern]
        cfg["num_hidden_layers"] = len(pattern)
        cfg["num_nextn_predict_layers"] = 0
        return cfg
    if family == "mimo_v2_flash":
        cfg["layer_types"] = [*cfg["layer_types"], *["sliding_attention"] * depth]
        cfg["mlp_layer_types"] = [*cfg["mlp_layer_types"], *["dense"] * depth]
    if family == "step3p5":  # the release's padded lists: the trunk's entries, then the MTP layers' (as many as built)
        cfg["layer_types"] = cfg["layer_types"][: n + depth]
    cfg["num_hidden_layers"] = n + depth
    cfg.pop("num_nextn_predict_layers", None)
    return cfg


def per_expert(name: str, t: Any) -> dict[str, Any]:
    """transformers' fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.up_proj`` / ``down_proj``
    [E, out, in]) as the checkpoints store them, one Linear per expert."""
    stem, _, leaf = name.rpartition(".")
    if leaf == "gate_up_proj":
        inter = t.shape[1] // 2
        return {
            **{f"{stem}.{e}.gate_proj.weight": t[e, :inter].contiguous() for e in range(t.shape[0])},
            **{f"{stem}.{e}.up_proj.weight": t[e, inter:].contiguous() for e in range(t.shape[0])},
        }
    return {f"{stem}.{e}.{leaf}.weight": t[e].contiguous() for e in range(t.shape[0])}


def _glue(shapes: Mapping[str, tuple[int, ...]], have: Mapping[str, Any], gen: Any) -> dict[str, Any]:
    """The MTP tensors the registry names that the trunk's layer does not give: the head and embedding copies the
    trunk's own (as the releases ship them: DeepSeek-V3's layer 61 copies ``lm_head`` and ``embed_tokens``), norms 1
    (plain RMSNorm), the projections (Step's own heads too) random, scaled by their input width."""
    import torch

    # Step's shared_head.output is each layer's own head (vLLM's Step3p5MTP drafts with it): random, not a copy
    copies = {".shared_head.head.weight": "lm_head.weight", ".embed_tokens.weight": "model.embed_tokens.weight"}
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        if name in have:
            continue
        source = next((have[t] for s, t in copies.items() if name.endswith(s) and t in have), None)
        if source is not None and tuple(source.shape) == tuple(shape):
            out[name] = source.clone()
        elif len(shape) == 1:
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            out[name] = (torch.randn(shape, generator=gen) * (1.0 / shape[-1] ** 0.5)).to(torch.bfloat16)
    return out


def nextn_tensors(family: str, config: Mapping[str, Any], seed: int = 0, copies: bool = True) -> dict[str, Any]:
    """Every tensor of family ``family``'s tiny checkpoint, under its on-disk names; ``copies``: the MTP carries the
    head and embedding copies where the family may (GLM-4.5: yes; GLM-4.6+: no)."""
    import torch
    import transformers

    spec = resolve(config)
    depth = spec.mtp.layers
    cls_name, model_type = _TRUNK[family]
    torch.manual_seed(seed)
    hf_config = transformers.CONFIG_MAPPING[model_type](**_trunk_config(family, config, depth))
    model = getattr(transformers, cls_name)(hf_config)
    tensors: dict[str, Any] = {}
    state = model.state_dict()
    if family == "step3p5":  # the text model alone: its names under model., the LM head its own (untied)
        state = {f"model.{n}": t for n, t in state.items()}
        state["lm_head.weight"] = torch.randn(config["vocab_size"], config["hidden_size"]) * 0.02
    for name, t in state.items():
        keep_f32 = name.endswith(("e_score_correction_bias", ".A_log", ".D", ".dt_bias"))
        t = t.detach().to(torch.float32 if keep_f32 else torch.bfloat16).contiguous()
        if t.dim() == 3 and ".experts." in name:
            tensors |= per_expert(name, t)
        elif name.endswith(".sinks") and family == "mimo_v2_flash":  # the release's name (transformers renames it)
            tensors[name.removesuffix(".sinks") + ".attention_sink_bias"] = t
        elif not name.endswith(".sinks"):
            tensors[name] = t
    n = config["num_hidden_layers"]
    if family == "nemotron_h":  # the trunk under backbone.; the MTP sub-layers under mtp.layers.{j}
        moved: dict[str, Any] = {}
        for name, t in tensors.items():
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= n:
                moved[f"mtp.layers.{int(m.group(1)) - n}.{name[m.end() :]}"] = t
            else:
                moved[name.replace("model.", "backbone.", 1) if name.startswith("model.") else name] = t
        tensors = moved
    elif family in ("mimo_v2_flash", "mimo"):
        root = "model.mtp.layers." if family == "mimo_v2_flash" else "model.mtp_layers."
        moved = {}
        for name, t in tensors.items():
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= n:
                rest = name[m.end() :]
                if family == "mimo_v2_flash":
                    rest = rest.replace("post_attention_layernorm", "pre_mlp_layernorm")
                moved[f"{root}{int(m.group(1)) - n}.{rest}"] = t
            else:
                moved[name] = t
        tensors = moved
    gen = torch.Generator().manual_seed(seed + 1)
    layout = spec.family.mtp
    shapes = layout.shapes(spec.text, depth, True)  # every tensor the registry names, the copies included
    if not copies and not layout.copies_required:
        drop = tuple("." + c for c in layout.copies)
        shapes = {name: shape for name, shape in shapes.items() if not name.endswith(drop)}
    tensors |= _glue(shapes, tensors, gen)
    return tensors
