"""Full-size header-only skeletons of Qwen3.8-Flash-Next (hidden 2560, 48 layers, 512 experts): sparse files with
the real names, shapes and dtypes, for inspect's speed at the family's real tensor counts.

- ``source``: the BF16 release (fused 3-D experts, the 31-tensor MTP, PLE n-gram tables in 512 shards each);
- ``nvidia-mixed``: NVIDIA's NVFP4 as published (ModelOpt MIXED_PRECISION: routed experts NVFP4 per expert, the
  MTP's routed experts FP8 per-block weight-only, the n-gram tables FP8, the rest BF16), ~300,000 tensors.

Shards are filled in name order under a 5 GB budget (the release's own shard names are not public).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.header import tensor_nbytes
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.families import is_mtp_name, resolve
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.synth.qwen4_exp import FULL_TEXT_CONFIG, main_tensors, qwen4_exp_config
from tests.support.skeleton import SkeletonResult, SkeletonTensor, write_sparse_safetensors

__all__ = ["QWEN4_EXP_SKELETONS", "make_qwen4_exp_skeleton"]

QWEN4_EXP_SKELETONS = ("source", "nvidia-mixed")
_SHARD_BYTES = 5 * 10**9
_VISION: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": [],
}


def _vision(H: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The Qwen3-VL vision tower's tensors (transformers Qwen3_5VisionModel naming), 27 blocks."""
    v = _VISION
    d, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    d_merge = d * int(v["spatial_merge_size"]) ** 2
    p = "model.visual."
    out: list[tuple[str, tuple[int, ...]]] = [
        (p + "patch_embed.proj.weight", (d, 3, 2, 16, 16)),
        (p + "patch_embed.proj.bias", (d,)),
        (p + "pos_embed.weight", (int(v["num_position_embeddings"]), d)),
    ]
    for b in range(int(v["depth"])):
        q = f"{p}blocks.{b}."
        out += [
            (q + "norm1.weight", (d,)),
            (q + "norm1.bias", (d,)),
            (q + "norm2.weight", (d,)),
            (q + "norm2.bias", (d,)),
            (q + "attn.qkv.weight", (3 * d, d)),
            (q + "attn.qkv.bias", (3 * d,)),
            (q + "attn.proj.weight", (d, d)),
            (q + "attn.proj.bias", (d,)),
            (q + "mlp.linear_fc1.weight", (inter, d)),
            (q + "mlp.linear_fc1.bias", (inter,)),
            (q + "mlp.linear_fc2.weight", (d, inter)),
            (q + "mlp.linear_fc2.bias", (d,)),
        ]
    out += [
        (p + "merger.norm.weight", (d,)),
        (p + "merger.norm.bias", (d,)),
        (p + "merger.linear_fc1.weight", (d_merge, d_merge)),
        (p + "merger.linear_fc1.bias", (d_merge,)),
        (p + "merger.linear_fc2.weight", (H, d_merge)),
        (p + "merger.linear_fc2.bias", (H,)),
    ]
    return [(n, s, "BF16") for n, s in out]


def _nvfp4(module: str, out_f: int, in_f: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (f"{module}.weight", (out_f, in_f // 2), "U8"),
        (f"{module}.weight_scale", (out_f, in_f // 16), "F8_E4M3"),
        (f"{module}.weight_scale_2", (), "F32"),
        (f"{module}.input_scale", (), "F32"),
    ]


def _per_expert(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """A fused expert tensor as ModelOpt exports it: (module, out, in) per expert Linear."""
    stem, _, leaf = name.rpartition(".")
    E = shape[0]
    if leaf == "gate_up_proj":
        inter, H = shape[1] // 2, shape[2]
        return [(f"{stem}.{e}.{p}", inter, H) for e in range(E) for p in ("gate_proj", "up_proj")]
    return [(f"{stem}.{e}.down_proj", shape[1], shape[2]) for e in range(E)]


def _plan(kind: str) -> tuple[dict[str, Any], dict[str, Any] | None, list[tuple[str, tuple[int, ...], str]]]:
    config = qwen4_exp_config(FULL_TEXT_CONFIG, _VISION)
    mtp = resolve(config).expected_mtp_shapes()
    rows = main_tensors(config) + _vision(FULL_TEXT_CONFIG["hidden_size"])
    rows += [(n, s, "BF16") for n, s in mtp.items()]
    if kind == "source":
        return config, None, rows
    layers: dict[str, dict[str, Any]] = {}
    out: list[tuple[str, tuple[int, ...], str]] = []
    for name, shape, dtype in rows:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            for module, o, i in _per_expert(name, shape):
                if is_mtp_name(module):
                    out += [(f"{module}.weight", (o, i), "F8_E4M3")]
                    out += [(f"{module}.weight_scale_inv", (math.ceil(o / 128), math.ceil(i / 128)), "F32")]
                    layers[module] = {"quant_algo": "FP8_PB_WO", "group_size": 128}
                else:
                    out += _nvfp4(module, o, i)
                    layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
        elif ".ple_embedding.ngram_embedding.shard_" in name:
            out.append((name, shape, "F8_E4M3"))
            table = name.split(".shard_")[0]
            if table not in layers:
                out.append((table + ".weight_scale", (), "F32"))
                layers[table] = {"quant_algo": "FP8"}
        else:
            out.append((name, shape, dtype))
    quantization = {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "quantized_layers": dict(sorted(layers.items())),
    }
    producer = {"name": "modelopt", "version": "0.47.0"}
    config["quantization_config"] = {"quant_method": "modelopt", **quantization, "producer": producer}
    return config, {"producer": producer, "quantization": quantization}, out


def make_qwen4_exp_skeleton(out: Path | str, kind: str = "source", *, overwrite: bool = False) -> SkeletonResult:
    """Write the full-size ``kind`` skeleton (``source`` or ``nvidia-mixed``) to ``out``."""
    if kind not in QWEN4_EXP_SKELETONS:
        raise ValueError(f"kind must be one of {', '.join(QWEN4_EXP_SKELETONS)}")
    t0 = time.perf_counter()
    config, hfq, rows = _plan(kind)
    rows.sort(key=lambda r: r[0])
    tensors: list[SkeletonTensor] = []
    shard, size = 1, 0
    for name, shape, dtype in rows:
        n = tensor_nbytes(dtype, shape)
        if size and size + n > _SHARD_BYTES:
            shard, size = shard + 1, 0
        tensors.append(SkeletonTensor(name, dtype, shape, f"model-{shard:05d}"))
        size += n
    count = shard
    tensors = [SkeletonTensor(t.name, t.dtype, t.shape, f"{t.shard}-of-{count:05d}.safetensors") for t in tensors]
    by_shard: dict[str, list[SkeletonTensor]] = defaultdict(list)
    for t in tensors:
        by_shard[t.shard].append(t)
    with OutputDir(Path(out), overwrite=overwrite) as od:
        for name, part in sorted(by_shard.items()):
            write_sparse_safetensors(od.path / name, part, {"format": "pt"})
        od.write_json(
            INDEX_NAME,
            {
                "metadata": {"total_size": sum(t.nbytes for t in tensors)},
                "weight_map": {t.name: t.shard for t in tensors},
            },
        )
        od.write_json("config.json", config)
        if hfq is not None:
            od.write_json(HF_QUANT_CONFIG, hfq)
        final = od.finalize()
    return SkeletonResult.of(final, "Qwen3.8-Flash-Next", kind, tensors, t0, [])
