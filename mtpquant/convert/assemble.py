"""Convert, the writing side: main-model shards from modelopt's export and the source, configs, files.

modelopt exports into a scratch directory inside OUT's temporary directory. Each exported shard is
then either moved into place (a rename: its bytes are written once) or, when some tensor in it must
change, rewritten; three rules say where each tensor's bytes come from:

- quantized Linears (and everything modelopt changed) come from the export;
- the vision tower ``model.visual.*`` comes from the source, byte for byte (it is never quantized);
- an unquantized tensor whose dtype the export changed (Qwen3.5 keeps ``linear_attn.A_log`` and the
  gated norm in float32; transformers loads them as bfloat16) comes from the source in its original
  dtype when the export holds exactly the source values rounded to the export dtype.

- a table the source stores in row shards (Qwen4-Exp's PLE n-gram table, ``X.shard_{i}.weight``; transformers
  concatenates them into ``X.weight`` on load) is written as the source's shards, byte for byte, never as the one
  tensor modelopt would export (``sharded_tables``; the export leaves it out: ``model.export_quantized``).

The export already applies the dtype rule itself (``model.export_quantized``), so on the Qwen3.5 and Qwen3-Next
families every shard is final as exported and moved. ``config.json`` is the source's, with the MTP
declaration set per mode and modelopt's ``quantization_config`` added; ``hf_quant_config.json`` is
modelopt's; both get the same exclusions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.dtypes import planned_copy
from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.sharded import sharded_tables
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
from mtpquant.families import TensorClass

__all__ = [
    "MainShards",
    "carry_files",
    "packed_exclusions",
    "place_main_shards",
    "quantized_modules_of",
]

log = logging.getLogger(__name__)

_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".weight_scale_inv")


@dataclass
class MainShards:
    """The main-model shards of the output and how each one got there."""

    moved: list[str] = field(default_factory=list)  # exported shards renamed into place
    rewritten: list[str] = field(default_factory=list)  # exported shards written again with changed tensors
    extra: list[str] = field(default_factory=list)  # shards of source tensors the export lacks (vision)
    dtype_restored: list[str] = field(default_factory=list)
    from_source: int = 0
    bytes_written: int = 0  # by this step (not the export)

    @property
    def shards(self) -> list[str]:
        """Every main-model shard name."""
        return sorted([*self.moved, *self.rewritten, *self.extra])


def quantized_modules_of(names: Iterable[str]) -> list[str]:
    """Modules that have a ``weight_scale`` (quantized Linears), from tensor names."""
    return sorted(n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale"))


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _wanted_from_source(export: Checkpoint, src: Checkpoint, name: str, quantized: set[str]) -> TensorEntry | None:
    """The source entry whose bytes the output must hold instead of the export's, if any."""
    entry = export.tensors[name]
    source = src.tensors.get(name)
    if source is None or tuple(source.shape) != tuple(entry.shape):
        return None
    if src.classify(name) == TensorClass.VISION:
        return source
    if (
        _module(name) not in quantized
        and not name.endswith(_SCALE_SUFFIXES)
        and source.dtype != entry.dtype
        and _same_values(src, source, export, entry)
    ):
        return source
    return None


def place_main_shards(export: Checkpoint, src: Checkpoint, od: OutputDir, scratch: Path, bar: Any = None) -> MainShards:
    """Put the exported main-model shards into ``od``: moved when final, rewritten when a tensor must change.

    A shard needs rewriting when it holds an ``mtp.*`` tensor (never part of the main model) or a
    tensor whose output bytes must come from the source and differ from the exported ones. Source
    vision tensors the export lacks get shards of their own. Afterwards ``scratch`` holds no shard.
    """
    quantized = set(quantized_modules_of(export.tensors))
    tables = sharded_tables(src.tensors)
    result = MainShards()
    for shard in sorted(export.headers):
        header = export.headers[shard]
        planned: list[PlannedTensor] = []
        changed = False
        for name in sorted(header.tensors, key=lambda n: header.tensors[n].start):
            if src.is_mtp(name) or name in tables:  # never the main model's / written from the source's shards
                changed = True
                continue
            entry = export.tensors[name]
            source = _wanted_from_source(export, src, name, quantized)
            if source is None:
                planned.append(planned_copy(export, entry))
                continue
            result.from_source += 1
            if source.dtype != entry.dtype:
                result.dtype_restored.append(name)
            if source.dtype != entry.dtype or src.read_raw(source) != export.read_raw(entry):
                changed = True
            planned.append(planned_copy(src, source))
        if not changed:
            od.adopt_file(scratch / shard, shard)
            result.moved.append(shard)
        else:
            before = od.bytes_written
            od.write_shard(shard, planned, header.metadata or None)
            result.bytes_written += od.bytes_written - before
            (scratch / shard).unlink()
            result.rewritten.append(shard)
        if bar is not None:
            bar.update(1)
    max_bytes = max(1, max(h.file_size - h.data_start for h in export.headers.values()))
    missing = [e for e in src.by_class().get(TensorClass.VISION, []) if e.name not in export.tensors]
    table_shards = [src.tensors[n] for names in tables.values() for n in names]
    for entries, pattern in (
        (missing, "model-vision-{index:05d}-of-{count:05d}.safetensors"),
        (table_shards, "model-tables-{index:05d}-of-{count:05d}.safetensors"),
    ):
        if not entries:
            continue
        before = od.bytes_written
        result.extra += od.write_shards(
            [planned_copy(src, e) for e in sorted(entries, key=lambda e: e.name)],
            max_bytes=max_bytes,
            pattern=pattern,
            metadata={"format": "pt"},
        )
        result.bytes_written += od.bytes_written - before
        result.from_source += len(entries)
    if result.dtype_restored:
        log.info(
            "%d unquantized tensors keep their source dtype (e.g. %s)", len(result.dtype_restored),
            result.dtype_restored[0],
        )
    if result.rewritten:
        log.info("%d exported shard(s) rewritten (a tensor had to change), %d moved", len(result.rewritten),
                 len(result.moved))
    return result


def _same_values(src: Checkpoint, s: TensorEntry, export: Checkpoint, e: TensorEntry) -> bool:
    """Whether the exported tensor is exactly the source tensor cast to the exported dtype."""
    import torch

    a = src.read_tensor(s.name)
    b = export.read_tensor(e.name)
    return bool(torch.equal(a.to(b.dtype), b)) if a.is_floating_point() and b.is_floating_point() else False


def packed_exclusions(
    names: Iterable[str], exclusions: Iterable[str], packed: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """Exact module names to add to a modelopt exclusion list so that every packed group (vLLM's
    ``packed_modules_mapping``, e.g. Qwen4-Exp's ``qkv_proj = q, k, v, indexer.index_qk_proj``) that stays
    unquantized is listed member by member: vLLM resolves a packed module by the exact names of its shards and
    refuses a group only partly listed (modelopt writes ``...self_attn.indexer*`` for the indexer)."""
    names = set(names)
    listed = set(exclusions)
    quantized = set(quantized_modules_of(names))
    modules = {n[: -len(".weight")] for n in names if n.endswith(".weight")}
    extra: set[str] = set()
    for shards in packed.values():
        first = f".{shards[0]}"
        for module in modules:
            if not module.endswith(first):
                continue
            base = module[: -len(first)]
            members = [f"{base}.{s}" for s in shards]
            if all(m in modules and m not in quantized for m in members):
                extra.update(m for m in members if m not in listed)
    return sorted(extra)


def carry_files(od: OutputDir, src_root: Path, files: Iterable[str]) -> list[str]:
    """Copy non-weight source files (tokenizer, chat template, processor configs, ...) unchanged."""
    done = []
    for rel in files:
        od.link_file(src_root / rel, rel, link=False)
        done.append(rel)
    return done
