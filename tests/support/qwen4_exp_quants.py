"""Qwen3.8-Flash-Next (qwen4_exp) quants in the layouts that are published, built from the tiny BF16 checkpoint.

Header-level fidelity (names, dtypes, shapes, shards, metadata files); tensor bytes are placeholders of the
right size, because inspect and graft read headers and graft copies the MTP from the BF16 source.

- ``nvidia-mixed``: NVIDIA's NVFP4 as published: ModelOpt ``MIXED_PRECISION`` with ``quantized_layers``; routed
  experts NVFP4 (per expert, as ModelOpt exports them), MTP routed experts FP8 per-block weight-only
  (``FP8_PB_WO``, group 128: F8_E4M3 weight + ``weight_scale_inv`` [out/128, in/128]), the PLE n-gram table FP8
  (F8_E4M3 shards + one table ``weight_scale``), everything else BF16;
- ``nvidia-mixed-old-label``: the same with the earlier ``FP8_BLOCK_SCALES`` label on the MTP experts;
- ``nvidia-mixed-refreshed``: after the metadata-only refresh users reported: the MTP experts relabelled
  ``FP8`` (per-tensor) over the same block-scaled tensors;
- ``nvidia-mixed-engine-index``: a refresh that wrote the MTP entries under vLLM's module names
  (``mtp.layers.{num_hidden_layers}...``), which vLLM renames a second time;
- ``nvfp4-mtp-dropped``: a plain ModelOpt NVFP4 export (routed experts NVFP4) that lost the MTP while
  config.json still declares it;
- ``nvfp4-mtp-excluded``: the same quant with the MTP kept in BF16 (fused experts) and ``mtp*`` excluded;
- ``nvfp4-mtp-partly-excluded``: only ``mtp.layers.0*`` excluded (fc_embedding / fc_hidden not) and the n-gram
  table not excluded;
- ``alias``: ``nvfp4-mtp-excluded`` under the day-0 ``qwen3_8_flash_next`` labels.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.families import is_mtp_name

__all__ = ["QUANT_KINDS", "make_qwen4_exp_quant"]

QUANT_KINDS = (
    "nvidia-mixed",
    "nvidia-mixed-old-label",
    "nvidia-mixed-refreshed",
    "nvidia-mixed-engine-index",
    "nvfp4-mtp-dropped",
    "nvfp4-mtp-excluded",
    "nvfp4-mtp-partly-excluded",
    "alias",
)
_PRODUCER = {"name": "modelopt", "version": "0.47.0"}
_NVFP4 = {"quant_algo": "NVFP4", "group_size": 16}
_TABLE = "ple.ple_embedding.ngram_embedding"


def _read(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    config = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index.values())):
        with safe_open(src / shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                tensors[name] = f.get_tensor(name)
    return config, tensors, index


def _nvfp4(module: str, out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    return {
        f"{module}.weight": torch.zeros(out_f, in_f // 2, dtype=torch.uint8),
        f"{module}.weight_scale": torch.ones(out_f, in_f // 16).to(torch.float8_e4m3fn),
        f"{module}.weight_scale_2": torch.tensor(1e-3, dtype=torch.float32),
        f"{module}.input_scale": torch.tensor(1e-2, dtype=torch.float32),
    }


def _fp8_block(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    out_f, in_f = w.shape
    return {
        f"{module}.weight": w.float().clamp(-448, 448).to(torch.float8_e4m3fn),
        f"{module}.weight_scale_inv": torch.ones(math.ceil(out_f / 128), math.ceil(in_f / 128), dtype=torch.float32),
    }


def _per_expert(stem: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    inter = gate_up.shape[1] // 2
    out: dict[str, torch.Tensor] = {}
    for e in range(gate_up.shape[0]):
        out[f"{stem}.{e}.gate_proj"] = gate_up[e, :inter]
        out[f"{stem}.{e}.up_proj"] = gate_up[e, inter:]
        out[f"{stem}.{e}.down_proj"] = down[e]
    return out


def make_qwen4_exp_quant(src: Path, out: Path, kind: str) -> Path:
    """Write the ``kind`` quant of the tiny qwen4_exp checkpoint ``src`` to ``out``; returns ``out``."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    config, tensors, _ = _read(src)
    text = config["text_config"]
    mixed = kind.startswith("nvidia-mixed")
    result: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    # routed experts exported per expert (as ModelOpt writes them); a BF16 MTP keeps its fused pair
    unfused = {
        n[: -len(".gate_up_proj")]
        for n in tensors
        if n.endswith(".mlp.experts.gate_up_proj") and (mixed or not is_mtp_name(n))
    }
    for name, t in tensors.items():
        stem = name.rsplit(".", 1)[0]
        if stem in unfused and name.endswith(".down_proj"):
            continue
        if stem in unfused:
            for module, w in _per_expert(stem, t, tensors[stem + ".down_proj"]).items():
                if is_mtp_name(module):  # mixed only: the MTP experts FP8 per block
                    result |= _fp8_block(module, w)
                    label = "FP8_BLOCK_SCALES" if kind == "nvidia-mixed-old-label" else "FP8_PB_WO"
                    label = "FP8" if kind == "nvidia-mixed-refreshed" else label
                    layers[module] = (
                        {"quant_algo": label} if label == "FP8" else {"quant_algo": label, "group_size": 128}
                    )
                else:
                    result |= _nvfp4(module, *w.shape)
                    layers[module] = dict(_NVFP4)
            continue
        if mixed and f".{_TABLE}.shard_" in name:
            result[name] = t.float().clamp(-448, 448).to(torch.float8_e4m3fn)
            table = name.split(".shard_")[0]
            result[table + ".weight_scale"] = torch.tensor(1.0, dtype=torch.float32)
            layers[table] = {"quant_algo": "FP8"}
            continue
        if kind == "nvfp4-mtp-dropped" and is_mtp_name(name):
            continue
        result[name] = t
    if kind == "nvidia-mixed-engine-index":
        n = text["num_hidden_layers"]
        layers = {k.replace("mtp.layers.0.", f"mtp.layers.{n}.", 1): v for k, v in layers.items()}

    if mixed:
        quantization: dict[str, Any] = {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "quantized_layers": dict(sorted(layers.items())),
        }
        qc = {"quant_method": "modelopt", **quantization, "producer": dict(_PRODUCER)}
    else:
        exclude = [
            "lm_head",
            "model.visual*",
            "*hyper_connection*",
            "*linear_attn*",
            "*self_attn*",
            "*shared_expert*",
            "*mlp.gate",
        ]
        # the PLE: projections, norms, convolution and the n-gram table (which vLLM requires to be excluded)
        # (exact names of the packed key/value projections: vLLM matches packed shards by exact name only)
        ple = sorted(
            {n.rsplit(".", 1)[0] for n in tensors if n.endswith(("ple.key_proj.weight", "ple.value_proj.weight"))}
        )
        exclude += ple if kind == "nvfp4-mtp-partly-excluded" else ["*ple*"]
        exclude.append("mtp.layers.0*" if kind == "nvfp4-mtp-partly-excluded" else "mtp*")
        quantization = {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": exclude,
        }
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": list(exclude), "producer": dict(_PRODUCER)}
    config = dict(config, quantization_config=qc)
    if kind == "alias":
        config["architectures"] = ["Qwen3_8FlashNextForConditionalGeneration"]
        config["model_type"] = "qwen3_8_flash_next"
        config["text_config"] = dict(text, model_type="qwen3_8_flash_next_text")
    names = sorted(result)
    with OutputDir(out) as od:
        half = len(names) // 2
        for i, part in enumerate((names[:half], names[half:])):
            shard = f"model-{i + 1:05d}-of-00002.safetensors"
            od.write_shard(shard, [planned(n, result[n].contiguous()) for n in part], {"format": "pt"})
        od.write_index()
        od.write_json("config.json", config)
        od.write_json("hf_quant_config.json", {"producer": dict(_PRODUCER), "quantization": quantization})
        return od.finalize()
