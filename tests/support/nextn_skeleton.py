"""Header-only checkpoints of the families beyond Qwen, full size and tiny: the published releases and quant layouts
(real names, dtypes, shapes and shards; tensor data a hole, as ``tests/support/skeleton.py`` writes them).

Every tensor comes from the registry's own shape functions (the MTP layer exactly; each trunk layer as the
family's MoE / dense layer), then the release's precision is applied:

- ``deepseek-v3-fp8``: deepseek-ai/DeepSeek-V3 / R1 as released: block-FP8 (F8_E4M3 + ``weight_scale_inv``
  [ceil(out/128), ceil(in/128)] F32) on every Linear but ``eh_proj``, the router, the head and the embeddings;
  163 shards, the whole MTP (layer 61) alone in the last: 91,991 tensors;
- ``deepseek-r1-nvfp4``: nvidia/DeepSeek-R1-FP4's layout: routed and shared experts and dense MLPs NVFP4, attention
  BF16 and excluded layer by layer, the MTP (layer 61) BF16 and excluded as ``model.layers.61*``
  (NVIDIA/Model-Optimizer examples/deepseek/ptq.py);
- ``glm-4.5``: zai-org/GLM-4.5 as released (BF16, the MTP at layer 92 with its head and embedding copies).

``make_nextn_normal`` writes a model that converts and runs instead: a full-size config's dimensions with only its
first layers (GLM-4.5-Air's dense layer and first MoE layer, then the MTP with its copies), every tensor random-normal
in its dtype (``tests/support/skeleton.py``'s ``mtp_data="normal"``), and the trained tiny model's tokenizer: real bytes
for the bounded-memory convert benchmark (``scripts/bench_nextn.py --full-convert``).

The same layouts on the tiny configs (``synth.nextn.NEXTN_CONFIGS``) make the small published-quant fixtures
(``tests/support/nextn_quants.py``).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.families import resolve
from mtpquant.families.nextn import mla_shapes, moe_shapes
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.synth.tiny import check_synthetic_replaceable
from tests.support.nextn_layouts import full_config
from tests.support.skeleton import SkeletonTensor, modelopt_exclusions, normal_fill, write_sparse_safetensors

__all__ = [
    "FULL_LAYOUTS",
    "Planned",
    "fp8_block",
    "make_nextn_normal",
    "make_nextn_skeleton",
    "nvfp4",
    "trunk_and_mtp",
    "write_layout",
]

Planned = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape)


def _dense_or_attention(p: str, text: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """One trunk layer's attention (MLA or GQA, as the family's MTP layer has it) and norms."""
    H = text["hidden_size"]
    out = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if "kv_lora_rank" in text:
        return out | mla_shapes(p, text, indexer="index_n_heads" in text)
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    hd = text.get("head_dim") or H // heads
    a = p + "self_attn."
    out |= {a + "q_proj.weight": (heads * hd, H), a + "k_proj.weight": (kv * hd, H), a + "v_proj.weight": (kv * hd, H),
            a + "o_proj.weight": (H, heads * hd)}
    if text.get("attention_bias"):
        out |= {a + "q_proj.bias": (heads * hd,), a + "k_proj.bias": (kv * hd,), a + "v_proj.bias": (kv * hd,)}
    if text.get("use_qk_norm"):
        out |= {a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
    return out


def trunk_and_mtp(config: Mapping[str, Any], mtp: bool = True) -> tuple[Planned, Planned]:
    """Every BF16 tensor of an appended-layer family's release: (trunk, MTP), in state-dict order; the MTP exactly
    the registry's inventory (copies where the family's releases carry them)."""
    spec = resolve(config)
    text = spec.text
    prefix = spec.appended_prefix()
    H, V, n = text["hidden_size"], text["vocab_size"], text["num_hidden_layers"]
    trunk: dict[str, tuple[int, ...]] = {prefix + "embed_tokens.weight": (V, H)}
    dense = text.get("first_k_dense_replace", 0)
    for i in range(n):
        p = f"{prefix}layers.{i}."
        trunk |= _dense_or_attention(p, text)
        if i < dense:
            inter = text["intermediate_size"]
            trunk |= {p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                      p + "mlp.down_proj.weight": (H, inter)}
        else:
            trunk |= moe_shapes(p, text)
    trunk |= {prefix + "norm.weight": (H,), "lm_head.weight": (V, H)}
    present = [f"{prefix}layers.{n}.shared_head.head.weight"] if spec.family.mtp.copies and spec.family.key in (
        "deepseek_v3", "deepseek_v32", "glm4_moe") else []
    mtp_shapes = spec.expected_mtp_shapes(present) if mtp else {}
    if spec.family.mtp.inventory == "glue":  # the block as an MLA / GQA + MoE layer of the trunk's kind
        for i in range(spec.mtp.layers if mtp else 0):
            p = f"{prefix}layers.{n + i}."
            mtp_shapes |= _dense_or_attention(p, text) | moe_shapes(p, text)
    bias = "e_score_correction_bias"
    return (
        [(k, "F32" if k.endswith(bias) else "BF16", s) for k, s in trunk.items()],
        [(k, "F32" if k.endswith(bias) else "BF16", s) for k, s in mtp_shapes.items()],
    )


_NOT_FP8 = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "eh_proj.weight", "mlp.gate.weight",
            "indexer.weights_proj.weight")


def fp8_block(planned: Planned) -> Planned:
    """DeepSeek's block-FP8 release: every 2-D Linear weight F8_E4M3 with its ``weight_scale_inv`` (128 x 128 blocks)
    but the head, the embeddings, ``eh_proj``, the router and the indexer's ``weights_proj``."""
    out: Planned = []
    for name, dtype, shape in planned:
        if len(shape) == 2 and name.endswith(".weight") and not name.endswith(_NOT_FP8) and "norm" not in name:
            out.append((name, "F8_E4M3", shape))
            out.append((name[: -len("weight")] + "weight_scale_inv", "F32",
                        (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))))
        else:
            out.append((name, dtype, shape))
    return out


def nvfp4(planned: Planned, quantize: Callable[[str], bool]) -> tuple[Planned, list[str], list[str]]:
    """ModelOpt's NVFP4 export of the 2-D Linears ``quantize`` accepts (module name): U8 packed weight, F8_E4M3 block
    scale per 16, F32 ``weight_scale_2`` and ``input_scale``; returns the tensors and the quantized and the unquantized
    Linear modules (for ModelOpt's exclusion summary)."""
    out: Planned = []
    quantized, plain = [], []
    for name, dtype, shape in planned:
        if len(shape) == 2 and name.endswith(".weight") and "norm" not in name:
            module = name[: -len(".weight")]
            if quantize(module) and shape[1] % 16 == 0:
                quantized.append(module)
                out += [(module + ".weight", "U8", (shape[0], shape[1] // 2)),
                        (module + ".weight_scale", "F8_E4M3", (shape[0], shape[1] // 16)),
                        (module + ".weight_scale_2", "F32", ()), (module + ".input_scale", "F32", ())]
                continue
            if not module.endswith("embed_tokens"):
                plain.append(module)
        out.append((name, dtype, shape))
    return out, quantized, plain


def modelopt_nvfp4_metadata(
    config: Mapping[str, Any], exclude: list[str], kv: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json with ModelOpt's ``quantization_config`` and ``hf_quant_config.json`` as modelopt 0.47 writes them."""
    producer = {"name": "modelopt", "version": "0.47.0"}
    hfq = {"producer": producer, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": kv, "group_size": 16,
                                                  "exclude_modules": list(exclude)}}
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    block = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": dict(block), "weights": dict(block), "targets": ["Linear"]}},
        "ignore": list(exclude),
        "quant_algo": "NVFP4",
        "producer": dict(producer),
        "quant_method": "modelopt",
    }
    return cfg, hfq


def shard_names(count: int, width: int = 5) -> list[str]:
    """``model-00001-of-00003.safetensors`` ... (DeepSeek's releases: ``of-000163``, ``width`` 6)."""
    return [f"model-{i + 1:05d}-of-{count:0{width}d}.safetensors" for i in range(count)]


def spread(planned: Planned, shards: list[str]) -> list[SkeletonTensor]:
    """The tensors over ``shards`` in order, each shard about the same number of bytes."""
    from mtpquant.checkpoint.header import tensor_nbytes

    total = sum(tensor_nbytes(d, s) for _, d, s in planned) or 1
    out, acc = [], 0
    for name, dtype, shape in planned:
        i = min(len(shards) - 1, acc * len(shards) // total)
        out.append(SkeletonTensor(name, dtype, shape, shards[i]))
        acc += tensor_nbytes(dtype, shape)
    return out


def write_layout(
    out: Path, config: Mapping[str, Any], tensors: list[SkeletonTensor], hfq: Mapping[str, Any] | None = None,
    *, index: bool = True, unindexed: frozenset[str] = frozenset(), overwrite: bool = False,
    fill: Callable[[SkeletonTensor], bytes | None] | None = None, tokenizer: Path | None = None,
) -> Path:
    """Write a header-only checkpoint: one sparse file per shard, the index (leaving out ``unindexed`` shards), the
    configs; with ``fill``, the bytes it gives each tensor, and with ``tokenizer``, that directory's tokenizer."""
    by_shard: dict[str, list[SkeletonTensor]] = defaultdict(list)
    for t in tensors:
        by_shard[t.shard].append(t)
    with OutputDir(Path(out), overwrite=overwrite, replace_check=check_synthetic_replaceable) as od:
        for shard, group in sorted(by_shard.items()):
            write_sparse_safetensors(od.path / shard, group, {"format": "pt"}, fill)
        for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer is not None else ():
            od.link_file(tokenizer / name, name, link=False)
        if index:
            weight_map = {t.name: t.shard for t in sorted(tensors, key=lambda t: t.name) if t.shard not in unindexed}
            total = sum(t.nbytes for t in tensors if t.shard not in unindexed)
            od.write_json(INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        od.write_json("config.json", dict(config))
        if hfq is not None:
            od.write_json(HF_QUANT_CONFIG, dict(hfq))
        return od.finalize()


FULL_LAYOUTS = ("deepseek-v3-fp8", "deepseek-r1-nvfp4", "glm-4.5")


def make_nextn_skeleton(kind: str, out: Path, *, overwrite: bool = False) -> Path:
    """Write the full-size skeleton ``kind`` (``FULL_LAYOUTS``) to ``out``."""
    if kind == "glm-4.5":
        config = full_config("GLM-4.5")
        trunk, mtp = trunk_and_mtp(config)
        shards = shard_names(93)
        tensors = spread(trunk, shards[:-1]) + [SkeletonTensor(n, d, s, shards[-1]) for n, d, s in mtp]
        return write_layout(out, config, tensors, overwrite=overwrite)
    config = full_config("DeepSeek-V3")
    trunk, mtp = trunk_and_mtp(config)
    if kind == "deepseek-v3-fp8":
        shards = shard_names(163, width=6)
        tensors = spread(fp8_block(trunk), shards[:-1]) + [
            SkeletonTensor(n, d, s, shards[-1]) for n, d, s in fp8_block(mtp)
        ]
        return write_layout(out, config, tensors, overwrite=overwrite)
    if kind != "deepseek-r1-nvfp4":
        raise ValueError(f"unknown layout {kind!r}; known: {', '.join(FULL_LAYOUTS)}")
    config.pop("quantization_config")
    planned, quantized, plain = nvfp4(trunk, lambda m: ".mlp." in m and not m.endswith(".mlp.gate"))
    _, _, mtp_plain = nvfp4(mtp, lambda m: False)
    exclude = sorted({*modelopt_exclusions(["lm_head", *plain], quantized), "model.layers.61*"})
    del mtp_plain
    cfg, hfq = modelopt_nvfp4_metadata(config, exclude, kv="FP8")
    tensors = spread(planned, shard_names(163, width=6)[:-1]) + [
        SkeletonTensor(n, d, s, shard_names(163, width=6)[-1]) for n, d, s in mtp
    ]
    return write_layout(out, cfg, tensors, hfq, overwrite=overwrite)


def make_nextn_normal(name: str, out: Path, *, layers: int, shard_bytes: int = 5 * 10**9, seed: int = 0,
                      overwrite: bool = False, sparse: bool = False) -> Path:  # fmt: skip
    """The full-size config ``name`` (``nextn_layouts.FULL_CONFIGS``) cut to its first ``layers`` layers, the MTP
    appended after them, with random-normal weights and the trained tiny GLM model's tokenizer (ids below every
    vocabulary): the trunk in shards of about ``shard_bytes``, the MTP alone in the last (as the release has it).
    ``sparse``: headers only (sparse files; for plans and dry runs)."""
    from mtpquant.checkpoint.header import tensor_nbytes
    from mtpquant.synth.train import TINY_MTP_ASSETS

    config = full_config(name) | {"num_hidden_layers": layers}
    trunk, mtp = trunk_and_mtp(config)
    count = max(1, math.ceil(sum(tensor_nbytes(d, s) for _, d, s in trunk) / shard_bytes))
    shards = shard_names(count + 1)
    tensors = spread(trunk, shards[:-1]) + [SkeletonTensor(n, d, s, shards[-1]) for n, d, s in mtp]
    return write_layout(out, config, tensors, overwrite=overwrite, fill=None if sparse else normal_fill(seed),
                        tokenizer=TINY_MTP_ASSETS["glm4_moe"])  # fmt: skip


def main() -> None:  # pragma: no cover - a helper for benchmarks: python -m tests.support.nextn_skeleton KIND OUT
    import sys

    print(json.dumps({"path": str(make_nextn_skeleton(sys.argv[1], Path(sys.argv[2]), overwrite=True))}))


if __name__ == "__main__":  # pragma: no cover
    main()
