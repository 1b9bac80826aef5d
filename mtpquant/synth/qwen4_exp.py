"""Qwen3.8-Flash-Next (``qwen4_exp``) checkpoints in the real layout, written by our own code.

transformers has the family from 5.16; mtpquant's environment pins an older one, so the tiny checkpoint and
the full-size skeleton are built from the layout facts (shared/fixtures/real-layouts/
Qwen3.8-Flash-Next_qwen4_exp_layout.md, checked against transformers 5.19 ``modeling_qwen4_exp.py`` and vLLM
0.32 ``vllm/models/qwen4_exp``): ``qwen4_exp_config`` gives a config.json, ``main_tensors`` every main-model
tensor with its shape and dtype (hyper-connections, gated-DeltaNet and QSA layers, fused 3-D experts, PLE with
its n-gram table in ``split_ngram_parts`` shards and three int64 buffers, the final hyper-connection mixer,
no final norm), and the MTP comes from the registry's inventory. ``ngram_buffers`` computes the int64 buffers
exactly as transformers does (``_build_layer_multipliers``, ``_find_nth_prime_after``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "FULL_TEXT_CONFIG",
    "ROPE_PARAMETERS",
    "TINY_TEXT_CONFIG",
    "main_tensors",
    "ngram_buffers",
    "ngram_table_rows",
    "qwen4_exp_config",
]

# Qwen3.5's RoPE (interleaved M-RoPE over a quarter of each head), Qwen4-Exp's too
ROPE_PARAMETERS: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
}
_QSA = {"indexer_budget": 8192, "indexer_compress_ratio": 4}  # vLLM requires budget / ratio in {512, 2048}

# The released text config (layout facts: hidden 2560, 48 layers = 36 gated-DeltaNet + 12 QSA, 24 heads / 2 KV /
# head_dim 256, 512 experts top-10, 640 expert and shared-expert widths, hc 4 / 320, indexer 4 / 1 / 128). The
# public facts give no ple_layer_ids; the skeleton puts PLE on the first two (linear) layers.
FULL_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 48,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "vocab_size": 248320,
    "hc_count": 4,
    "hc_lowrank": 320,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    **_QSA,
    "ple_layer_ids": [1, 2],
    "ple_embed_dim": 2560,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 512,
    "seed": 1234,
    "mtp_num_hidden_layers": 1,
}

# The tiny variant: real head dims where kernels care (linear 128 is what vLLM's CPU GDN kernel accepts),
# everything else small; every Linear input dimension a multiple of 16 (NVFP4 blocks).
TINY_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,  # vLLM's M-RoPE needs sum(mrope_section) == rotary_dim / 2: the real 256 x 0.25
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "vocab_size": 512,
    "hc_count": 4,
    "hc_lowrank": 32,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 64,  # covers the rotary dims (transformers and vLLM check it)
    **_QSA,
    "ple_layer_ids": [1],
    "ple_embed_dim": 32,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 97,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 4,
    "seed": 1234,
    "mtp_num_hidden_layers": 1,
}


def qwen4_exp_config(
    text: Mapping[str, Any], vision: Mapping[str, Any], *, alias: bool = False, tied: bool = False
) -> dict[str, Any]:
    """A wrapper config.json for a Qwen4-Exp text config (``alias``: the day-0 ``qwen3_8_flash_next`` labels)."""
    t = copy.deepcopy(dict(text))
    n = t["num_hidden_layers"]
    # released configs write QSA layers as "full_attention" (transformers >= 5.18 reads it as indexed attention)
    t.setdefault("layer_types", ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    vocab = t["vocab_size"]
    t |= {
        "model_type": "qwen3_8_flash_next_text" if alias else "qwen4_exp_text",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "attention_bias": False,
        "norm_topk_prob": True,
        "rope_parameters": dict(ROPE_PARAMETERS),
        "tie_word_embeddings": tied,
        "eos_token_id": 2 if vocab < 4096 else 248046,
        "dtype": "bfloat16",
    }
    vis = dict(vision)
    vis |= {"out_hidden_size": t["hidden_size"], "model_type": "qwen4_exp_vision"}
    return {
        "architectures": ["Qwen3_8FlashNextForConditionalGeneration" if alias else "Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen3_8_flash_next" if alias else "qwen4_exp",
        "text_config": t,
        "vision_config": vis,
        "tie_word_embeddings": tied,
        "image_token_id": vocab - 4,
        "video_token_id": vocab - 3,
        "vision_start_token_id": vocab - 2,
        "vision_end_token_id": vocab - 1,
    }


# ---- the PLE n-gram table (transformers 5.19 Qwen4ExpTextNGramEmbedding) ---------------------------------------
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PRIME_1 = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def ngram_buffers(text: Mapping[str, Any], ple_index: int) -> dict[str, list[int]]:
    """The three int64 buffers of the ``ple_index``-th PLE layer: layer_multipliers, head vocab sizes, offsets."""
    heads = (text["ngram_size"] - 1) * text["heads_per_ngram"]
    half = max(1, ((1 << 63) - 1) // max(text["vocab_size"], 1) // 2)
    base = text["seed"] + _PRIME_1 * ple_index
    multipliers = [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(text["ngram_size"])]
    sizes, offsets, total = [], [], 0
    prime = text["ngram_vocab_size_base"] - 1
    for _ in range(ple_index * heads):  # every earlier PLE layer's heads took the primes before ours
        prime += 1
        while not _is_prime(prime):
            prime += 1
    for _ in range(heads):
        prime += 1
        while not _is_prime(prime):
            prime += 1
        sizes.append(prime)
        offsets.append(total)
        total += prime
    return {"layer_multipliers": multipliers, "ngram_heads_vocab_sizes": sizes, "ngram_heads_offsets": offsets}


def ngram_table_rows(text: Mapping[str, Any], ple_index: int) -> list[int]:
    """Rows of each ``ngram_embedding.shard_{i}`` (vLLM ngram_embedding.py 449-456: ceil(padded / parts) each)."""
    total = sum(ngram_buffers(text, ple_index)["ngram_heads_vocab_sizes"])
    div = text["make_ngram_vocab_size_divisible_by"]
    padded = math.ceil(total / div) * div
    parts = text["split_ngram_parts"]
    size = (padded + parts - 1) // parts
    return [max(0, min(size, padded - i * size)) for i in range(parts)]


def _hyper(prefix: str, H: int, hc: int, r: int, combine: bool) -> list[tuple[str, tuple[int, ...]]]:  # noqa: N803
    out = [
        (f"{prefix}.hc_norm.weight", (hc * H,)),
        (f"{prefix}.input_mix_weight_down.weight", (r, hc * H)),
        (f"{prefix}.input_mix_weight_up.weight", (hc * H, r)),
    ]
    if combine:
        out.append((f"{prefix}.block_inject_weight.weight", (hc, hc * H)))
    return out


def main_tensors(
    config: Mapping[str, Any], prefix: str = "model.language_model."
) -> list[tuple[str, tuple[int, ...], str]]:
    """Every main-model tensor (name, shape, safetensors dtype) of a Qwen4-Exp config, in layer order; no vision,
    no MTP. ``lm_head.weight`` is included unless the embeddings are tied."""
    t = config.get("text_config", config)
    H, V, hc, r = t["hidden_size"], t["vocab_size"], t["hc_count"], t["hc_lowrank"]
    R = hc * H
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    nk, nv, dk, dv = (
        t["linear_num_key_heads"],
        t["linear_num_value_heads"],
        t["linear_key_head_dim"],
        t["linear_value_head_dim"],
    )
    E, inter, shared = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    ple_ids = sorted(set(t.get("ple_layer_ids") or []))
    ngram_heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    out: list[tuple[str, tuple[int, ...], str]] = [(f"{prefix}embed_tokens.weight", (V, H), "BF16")]
    for i, kind in enumerate(t["layer_types"]):
        p = f"{prefix}layers.{i}."
        rows: list[tuple[str, tuple[int, ...]]] = []
        if i + 1 in ple_ids:
            k = t["ple_conv_kernel_size"]
            d = t["ple_embed_dim"]
            rows += [
                (p + "ple.key_proj.weight", (R, d)),
                (p + "ple.value_proj.weight", (H, d)),
                (p + "ple.norm_key.weight", (R,)),
                (p + "ple.norm_query.weight", (R,)),
                (p + "ple.norm_conv.weight", (R,)),
                (p + "ple.conv1d.weight", (R, 1, k)),
            ]
            table = ngram_table_rows(t, ple_ids.index(i + 1))
            rows += [
                (f"{p}ple.ple_embedding.ngram_embedding.shard_{j}.weight", (n, d // ngram_heads))
                for j, n in enumerate(table)
            ]
        rows += _hyper(p + "attn_hyper_connection", H, hc, r, True) + _hyper(p + "mlp_hyper_connection", H, hc, r, True)
        if kind == "linear_attention":
            conv = 2 * nk * dk + nv * dv
            rows += [
                (p + "linear_attn.in_proj_qkv.weight", (conv, H)),
                (p + "linear_attn.in_proj_z.weight", (nv * dv, H)),
                (p + "linear_attn.in_proj_b.weight", (nv, H)),
                (p + "linear_attn.in_proj_a.weight", (nv, H)),
                (p + "linear_attn.out_proj.weight", (H, nv * dv)),
                (p + "linear_attn.conv1d.weight", (conv, 1, t["linear_conv_kernel_dim"])),
                (p + "linear_attn.dt_bias", (nv,)),
            ]
        else:
            ih, ikv, ihd = t["indexer_n_heads"], t["indexer_kv_heads"], t["indexer_head_dim"]
            rows += [
                (p + "self_attn.q_proj.weight", (2 * heads * hd, H)),
                (p + "self_attn.k_proj.weight", (kv * hd, H)),
                (p + "self_attn.v_proj.weight", (kv * hd, H)),
                (p + "self_attn.o_proj.weight", (H, heads * hd)),
                (p + "self_attn.q_norm.weight", (hd,)),
                (p + "self_attn.k_norm.weight", (hd,)),
                (p + "self_attn.indexer.index_qk_proj.weight", ((ih + ikv) * ihd, H)),
                (p + "self_attn.indexer.q_layernorm.weight", (ihd,)),
                (p + "self_attn.indexer.k_layernorm.weight", (ihd,)),
            ]
        rows += [
            (p + "mlp.gate.weight", (E, H)),
            (p + "mlp.experts.gate_up_proj", (E, 2 * inter, H)),
            (p + "mlp.experts.down_proj", (E, H, inter)),
            (p + "mlp.shared_expert.gate_proj.weight", (shared, H)),
            (p + "mlp.shared_expert.up_proj.weight", (shared, H)),
            (p + "mlp.shared_expert.down_proj.weight", (H, shared)),
            (p + "mlp.shared_expert_gate.weight", (1, H)),
        ]
        out += [(n, s, "BF16") for n, s in rows]
        if kind == "linear_attention":  # the gated-DeltaNet decay and gated norm stay float32, as in Qwen3.5
            out += [(p + "linear_attn.A_log", (nv,), "F32"), (p + "linear_attn.norm.weight", (dv,), "F32")]
        if i + 1 in ple_ids:
            out += [(f"{p}ple.ple_embedding.{b}", (n,), "I64") for b, n in _buffer_lengths(t).items()]
    out += [(n, s, "BF16") for n, s in _hyper(f"{prefix}hyper_connection_mixer", H, hc, r, False)]
    if not (config.get("tie_word_embeddings") or t.get("tie_word_embeddings")):
        out.append(("lm_head.weight", (V, H), "BF16"))
    return out


def _buffer_lengths(t: Mapping[str, Any]) -> dict[str, int]:
    heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    return {"layer_multipliers": t["ngram_size"], "ngram_heads_vocab_sizes": heads, "ngram_heads_offsets": heads}
