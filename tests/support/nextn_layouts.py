"""The full-size configs of the families beyond Qwen, as their releases publish them (the keys the registry and
vLLM read; deepseek-ai/DeepSeek-V3 and -R1, zai-org/GLM-4.5 / 4.6, zai-org/GLM-5, stepfun-ai/Step-3.5-Flash), for the
registry's counts and the header-only skeletons (``tests/support/nextn_skeleton.py``)."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["FULL_CONFIGS", "full_config"]

_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
_GLM45: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "n_shared_experts": 1,
    "n_routed_experts": 160,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "use_qk_norm": True,
    "attention_bias": True,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
_GLM5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_share_for_mtp_iteration": True,
    "first_k_dense_replace": 3,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
}
FULL_CONFIGS: dict[str, dict[str, Any]] = {
    "DeepSeek-V3": _DEEPSEEK_V3,
    "DeepSeek-V3.2": {
        **_DEEPSEEK_V3,
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
    },
    "GLM-4.5": _GLM45,
    # zai-org/GLM-4.5-Air: 46 layers (the first dense), 128 routed experts, no QK norm
    "GLM-4.5-Air": {
        **_GLM45,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 46,
        "n_routed_experts": 128,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "use_qk_norm": False,
    },
    "GLM-5": _GLM5,
}


def full_config(name: str) -> dict[str, Any]:
    """A copy of the full-size config called ``name``."""
    return copy.deepcopy(FULL_CONFIGS[name])
