"""Convert, the writing side: main-model shards from modelopt's export and the source, configs, files.

modelopt's export lands in a scratch directory; the output shards are written from it tensor by
tensor (sorted by name, under the byte budget), with three rules for where the bytes come from:

- quantized Linears (and everything modelopt changed) come from the export;
- the vision tower ``model.visual.*`` comes from the source, byte for byte (it is never quantized);
- an unquantized tensor whose dtype the export changed (Qwen3.5 keeps ``linear_attn.A_log`` and the
  gated norm in float32; transformers loads them as bfloat16) comes from the source in its original
  dtype when the export holds exactly the source values rounded to the export dtype.

``config.json`` is the source's, with the MTP declaration set per mode and modelopt's
``quantization_config`` added; ``hf_quant_config.json`` is modelopt's; both get the same exclusions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
from mtpquant.families import TensorClass, is_mtp_name

__all__ = [
    "MainTensorPlan",
    "carry_files",
    "main_tensor_plan",
    "mixed_precision_config",
    "quantized_modules_of",
    "with_progress",
]

log = logging.getLogger(__name__)

_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".weight_scale_inv")


@dataclass
class MainTensorPlan:
    """The main-model tensors to write and where each one's bytes come from."""

    tensors: list[PlannedTensor]
    from_export: int = 0
    from_source: int = 0
    dtype_restored: list[str] = field(default_factory=list)
    carried_vision: int = 0


def quantized_modules_of(names: Iterable[str]) -> list[str]:
    """Modules that have a ``weight_scale`` (quantized Linears), from tensor names."""
    return sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale"))


def _raw(ckpt: Checkpoint, entry: TensorEntry, name: str | None = None) -> PlannedTensor:
    return PlannedTensor(name or entry.name, entry.dtype, entry.shape, lambda: ckpt.read_raw(entry))


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def main_tensor_plan(export: Checkpoint, src: Checkpoint) -> MainTensorPlan:
    """Plan the main-model tensors of the output (no ``mtp.*``), sorted by name."""
    quantized = set(quantized_modules_of(export.tensors))
    plan = MainTensorPlan([])
    chosen: dict[str, PlannedTensor] = {}
    for name in sorted(export.tensors):
        if is_mtp_name(name):
            continue
        entry = export.tensors[name]
        source = src.tensors.get(name)
        cls = src.classify(name)
        if source is not None and cls == TensorClass.VISION and tuple(source.shape) == tuple(entry.shape):
            chosen[name] = _raw(src, source)
            plan.from_source += 1
            continue
        if (
            source is not None
            and _module(name) not in quantized
            and not name.endswith(_SCALE_SUFFIXES)
            and source.dtype != entry.dtype
            and tuple(source.shape) == tuple(entry.shape)
            and _same_values(src, source, export, entry)
        ):
            chosen[name] = _raw(src, source)
            plan.from_source += 1
            plan.dtype_restored.append(name)
            continue
        chosen[name] = _raw(export, entry)
        plan.from_export += 1
    for entry in src.by_class().get(TensorClass.VISION, []):
        if entry.name not in chosen:
            chosen[entry.name] = _raw(src, entry)
            plan.from_source += 1
            plan.carried_vision += 1
    if plan.dtype_restored:
        log.info(
            "%d unquantized tensors keep their source dtype (e.g. %s)", len(plan.dtype_restored), plan.dtype_restored[0]
        )
    plan.tensors = [chosen[n] for n in sorted(chosen)]
    return plan


def _same_values(src: Checkpoint, s: TensorEntry, export: Checkpoint, e: TensorEntry) -> bool:
    """Whether the exported tensor is exactly the source tensor cast to the exported dtype."""
    import torch

    a = src.read_tensor(s.name)
    b = export.read_tensor(e.name)
    return bool(torch.equal(a.to(b.dtype), b)) if a.is_floating_point() and b.is_floating_point() else False


def with_progress(tensors: list[PlannedTensor], bar: Any) -> list[PlannedTensor]:
    """Wrap each tensor's producer so a tqdm bar advances by its bytes."""

    def wrap(t: PlannedTensor) -> PlannedTensor:
        def produce(inner: Callable[[], bytes] = t.produce) -> bytes:
            data = inner()
            bar.update(len(data))
            return data

        return PlannedTensor(t.name, t.dtype, t.shape, produce)

    return [wrap(t) for t in tensors]


def carry_files(od: OutputDir, src_root: Path, files: Iterable[str]) -> list[str]:
    """Copy non-weight source files (tokenizer, chat template, processor configs, ...) unchanged."""
    done = []
    for rel in files:
        od.link_file(src_root / rel, rel, link=False)
        done.append(rel)
    return done


def mixed_precision_config(
    hf_quant_config: Mapping[str, Any], main_modules: Iterable[str], main_algo: str, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """``hf_quant_config.json`` rewritten as MIXED_PRECISION: per-module ``quantized_layers``."""
    import copy

    hfq = copy.deepcopy(dict(hf_quant_config))
    q = hfq.setdefault("quantization", {})
    group = q.get("group_size", 16)
    layers: dict[str, Any] = {m: {"quant_algo": main_algo, "group_size": group} for m in sorted(main_modules)}
    layers.update({k: dict(v) for k, v in extra.items()})
    q["quant_algo"] = "MIXED_PRECISION"
    q["quantized_layers"] = dict(sorted(layers.items()))
    q.pop("group_size", None)
    return hfq
