"""Full-size skeleton checkpoints: real names, shapes, dtypes and shards, tensor data as holes.

A skeleton is built from a real-layout table (``shared/fixtures/real-layouts``) and its config:
every tensor of the real checkpoint, in the shard the table names, with a valid safetensors header
per shard and an index whose ``total_size`` is the real one. Tensor data are sparse: each shard is
its header followed by ``truncate()`` to the full size, so a 151 GB checkpoint costs a few MB of
disk and a few seconds to write. Reads of tensor data return zeros.

Two kinds:

- the BF16 source as published (MTP included; ``mtp_data="random"`` gives the MTP tensors real
  pseudo-random bytes, for benchmarks that must measure real I/O on them);
- a "quant" of the same model as ``modelopt.torch.export.export_hf_checkpoint`` writes it after a
  naive load-quantize-export (the failure this project fixes): NVFP4 (uint8 packed weight, fp8
  block scales, fp32 ``weight_scale_2`` and ``input_scale``) for every Linear the family's default
  recipe quantizes, experts per expert even where the source stores them fused 3-D, everything
  else as in the source, no ``mtp.*`` tensor while config.json still declares the MTP, and
  ``hf_quant_config.json`` plus ``config.json`` ``quantization_config`` as modelopt 0.47 writes
  them (checked against real tiny exports made by ``tests/support/naive_export.py``).
"""

from __future__ import annotations

import bisect
import copy
import fnmatch
import json
import logging
import os
import random
import re
import struct
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.header import tensor_nbytes
from mtpquant.checkpoint.index import INDEX_NAME, SINGLE_NAME, check_shard_name
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.families import Family, is_mtp_name, resolve
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.synth.tiny import check_synthetic_replaceable
from tests.support.layouts import LayoutRow, expand_layout

__all__ = [
    "MODELOPT_VERSION",
    "QUANT_MAX_SHARD_BYTES",
    "Layout",
    "SkeletonResult",
    "SkeletonTensor",
    "assign_shards",
    "find_layout",
    "list_layouts",
    "make_skeleton",
    "modelopt_exclusions",
    "normal_fill",
    "plan_quant",
    "plan_source",
    "write_sparse_safetensors",
]

log = logging.getLogger(__name__)

# The modelopt release whose export metadata the skeleton quant reproduces (producer.version).
MODELOPT_VERSION = "0.47.0"
# export_hf_checkpoint's default max_shard_size ("10GB", decimal, as huggingface_hub parses it).
QUANT_MAX_SHARD_BYTES = 10 * 10**9
NVFP4_GROUP = 16
_SHARD_NUMBER = re.compile(r"(\d+)-of-(\d+)")
_DIGITS = re.compile(r"(\d+)")
_FILL_BLOCK = 1 << 22


@dataclass(frozen=True)
class Layout:
    """A real-layout table and the config.json that goes with it."""

    name: str
    table: Path
    config: Path


@dataclass(frozen=True)
class SkeletonTensor:
    """One tensor of a skeleton: header facts and the shard that holds it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return tensor_nbytes(self.dtype, self.shape)


@dataclass
class SkeletonResult:
    """What ``make_skeleton`` wrote."""

    path: Path
    layout: str
    kind: str  # "source" | "quant"
    tensors: int
    shards: list[str]
    total_bytes: int  # sum of tensor bytes (= index total_size)
    file_bytes: int  # logical size of every file
    disk_bytes: int  # blocks actually allocated (st_blocks * 512)
    mtp_tensors: int
    mtp_bytes: int
    largest_mtp_tensor: int
    seconds: float
    exclusions: list[str] = field(default_factory=list)

    @classmethod
    def of(
        cls, path: Path, layout: str, kind: str, tensors: list[SkeletonTensor], t0: float, exclusions: list[str]
    ) -> SkeletonResult:
        """The result of a skeleton written to ``path`` from ``tensors``, started at ``t0`` (perf_counter)."""
        files = [p for p in path.iterdir() if p.is_file()]
        mtp = [t for t in tensors if is_mtp_name(t.name)]
        return cls(
            path=path,
            layout=layout,
            kind=kind,
            tensors=len(tensors),
            shards=sorted({t.shard for t in tensors}),
            total_bytes=sum(t.nbytes for t in tensors),
            file_bytes=sum(p.stat().st_size for p in files),
            disk_bytes=sum(p.stat().st_blocks * 512 for p in files),
            mtp_tensors=len(mtp),
            mtp_bytes=sum(t.nbytes for t in mtp),
            largest_mtp_tensor=max((t.nbytes for t in mtp), default=0),
            seconds=time.perf_counter() - t0,
            exclusions=exclusions,
        )


# ---------------------------------------------------------------------------------------------- layouts


def list_layouts(directory: Path) -> dict[str, Layout]:
    """Every ``NAME_weights_table.md`` with a ``NAME_config*.json`` beside it, by NAME."""
    out: dict[str, Layout] = {}
    for table in sorted(Path(directory).glob("*_weights_table.md")):
        name = table.name[: -len("_weights_table.md")]
        configs = sorted(Path(directory).glob(f"{glob_escape(name)}_config*.json"))
        if configs:
            out[name] = Layout(name, table, configs[0])
    return out


def glob_escape(text: str) -> str:
    """``text`` with glob metacharacters escaped."""
    return re.sub(r"([*?\[])", r"[\1]", text)


def find_layout(name: str, directory: Path) -> Layout:
    """The layout called ``name`` (exact, or a unique prefix such as ``Qwen3-Next-80B-A3B``)."""
    layouts = list_layouts(directory)
    if name in layouts:
        return layouts[name]
    matches = [k for k in layouts if k.startswith(name)]
    if len(matches) == 1:
        return layouts[matches[0]]
    known = ", ".join(sorted(layouts)) or "none"
    raise ValueError(f"layout {name!r} not found in {directory} (known: {known})")


def _natural(name: str) -> tuple[Any, ...]:
    # layers.2 before layers.10, as a model's state dict orders them
    return tuple(int(p) if i % 2 else p for i, p in enumerate(_DIGITS.split(name)))


# ---------------------------------------------------------------------------------------------- source plan


def assign_shards(rows: Sequence[LayoutRow]) -> list[SkeletonTensor]:
    """Put every row in a shard: the table's shard where it names one, else a balanced choice.

    Rows the table lists as "Multi Files" are taken in state-dict order (layer by layer) and laid
    out contiguously over the shards, so that every shard ends up close to the mean size. Shards
    whose named tensors are all ``mtp.*`` (Qwen3-Next's last shard) receive nothing else; MTP
    tensors always stay where the table puts them.
    """
    pinned = [r for r in rows if r.shard is not None]
    if not pinned:
        raise ValueError("the layout names no shard at all; cannot infer the shard names")
    sample = str(pinned[0].shard)
    m = _SHARD_NUMBER.search(sample)
    if m is None:
        names = sorted({str(r.shard) for r in pinned})
    else:
        count, width = int(m.group(2)), len(m.group(1))

        def shard_name(i: int) -> str:
            return f"{sample[: m.start()]}{i:0{width}d}-of-{m.group(2)}{sample[m.end() :]}"

        names = [shard_name(i + 1) for i in range(count)]
    unknown = {str(r.shard) for r in pinned} - set(names)
    if unknown:
        raise ValueError(f"the layout names shards outside the {len(names)}-shard sequence: {sorted(unknown)}")

    fixed: dict[str, int] = defaultdict(int)
    mtp_only: dict[str, bool] = {}
    for r in pinned:
        shard = str(r.shard)
        fixed[shard] += tensor_nbytes(r.dtype, r.shape)
        mtp_only[shard] = mtp_only.get(shard, True) and is_mtp_name(r.name)
    open_shards = [s for s in names if not mtp_only.get(s, False)] or names

    multi = sorted((r for r in rows if r.shard is None), key=lambda r: _natural(r.name))
    multi_bytes = sum(tensor_nbytes(r.dtype, r.shape) for r in multi)
    target = (sum(fixed[s] for s in open_shards) + multi_bytes) / len(open_shards)
    capacity = [max(0.0, target - fixed[s]) for s in open_shards]
    scale = multi_bytes / sum(capacity) if sum(capacity) > 0 else 0.0
    bounds: list[float] = []
    acc = 0.0
    for c in capacity:
        acc += c * scale
        bounds.append(acc)
    bounds[-1] = float("inf")

    out = [SkeletonTensor(r.name, r.dtype, r.shape, str(r.shard)) for r in pinned]
    placed, k = 0, 0
    for r in multi:
        size = tensor_nbytes(r.dtype, r.shape)
        middle = placed + size / 2
        while bounds[k] <= middle:
            k += 1
        out.append(SkeletonTensor(r.name, r.dtype, r.shape, open_shards[k]))
        placed += size
    return sorted(out, key=lambda t: (t.shard, _natural(t.name)))


def plan_source(layout: Layout) -> tuple[dict[str, Any], list[SkeletonTensor]]:
    """The BF16 checkpoint of a layout: its config and every tensor with its shard."""
    config = json.loads(layout.config.read_text())
    rows = expand_layout(layout.table, config)
    return config, assign_shards(rows)


# ---------------------------------------------------------------------------------------------- quant plan


def modelopt_exclusions(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """``exclude_modules`` as modelopt summarises it: prefix wildcards where no quantized module matches.

    Mirrors ``_prefix_wildcard_summarize_exclude_modules`` in
    ``modelopt/torch/export/quant_utils.py`` (0.47), sorted as ``process_layer_quant_config`` does.
    Negative wildcards are answered by prefix search over the sorted quantized names instead of
    materialising every prefix of every name (hundreds of thousands of experts in Qwen3-Next).
    """
    q_sorted = sorted(set(quantized))
    q_set = set(q_sorted)

    def negative(wildcard: str) -> bool:
        if wildcard.endswith("*"):
            prefix = wildcard[:-1]
            i = bisect.bisect_left(q_sorted, prefix)
            return i < len(q_sorted) and q_sorted[i].startswith(prefix)
        return wildcard in q_set

    def candidates(name: str) -> Iterable[list[str]]:
        for i, ch in enumerate(name):
            if ch == ".":
                yield [name[:i] + "*"]
                yield [name[:i], name[:i] + ".*"]
        yield [name]

    summary: set[str] = set()
    for layer in unquantized:
        chosen: list[str] = []
        for wildcards in candidates(layer):
            if any(negative(w) for w in wildcards):
                continue
            if not all(w in summary for w in wildcards):
                chosen = wildcards
            break
        if len(chosen) == 2 and chosen[1] == chosen[0] + ".*":
            summary.add(chosen[1])
        else:
            summary.update(chosen)
    return sorted(summary)


def _unquantized(family: Family, module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in family.unquantized)


def _nvfp4(module: str, out_f: int, in_f: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [
        (f"{module}.weight", "U8", (out_f, in_f // 2)),
        (f"{module}.weight_scale", "F8_E4M3", (out_f, in_f // NVFP4_GROUP)),
        (f"{module}.weight_scale_2", "F32", ()),
        (f"{module}.input_scale", "F32", ()),
    ]


def plan_quant(
    layout: Layout, max_shard_bytes: int = QUANT_MAX_SHARD_BYTES
) -> tuple[dict[str, Any], dict[str, Any], list[SkeletonTensor]]:
    """The naive modelopt NVFP4 export of a layout: config.json, hf_quant_config.json, tensors."""
    config = json.loads(layout.config.read_text())
    spec = resolve(config)
    family = spec.family
    rows = expand_layout(layout.table, config)
    planned: list[tuple[str, str, tuple[int, ...]]] = []
    quantized: list[str] = []
    unquantized: list[str] = ["lm_head"]  # the module exists even when tied (no tensor on disk)

    def linear(module: str, out_f: int, in_f: int, dtype: str) -> None:
        if not _unquantized(family, module) and in_f % NVFP4_GROUP == 0:
            planned.extend(_nvfp4(module, out_f, in_f))
            quantized.append(module)
        else:
            planned.append((f"{module}.weight", dtype, (out_f, in_f)))
            unquantized.append(module)

    for r in rows:
        if is_mtp_name(r.name):
            continue  # transformers never builds the MTP, so a naive export has none
        if family.fused_main_experts and len(r.shape) == 3 and r.name.endswith(".mlp.experts.gate_up_proj"):
            base = r.name[: -len(".gate_up_proj")]
            experts, two_i, hidden = r.shape
            for e in range(experts):  # modelopt exports fused experts per expert
                linear(f"{base}.{e}.gate_proj", two_i // 2, hidden, r.dtype)
                linear(f"{base}.{e}.up_proj", two_i // 2, hidden, r.dtype)
            continue
        if family.fused_main_experts and len(r.shape) == 3 and r.name.endswith(".mlp.experts.down_proj"):
            base = r.name[: -len(".down_proj")]
            experts, hidden, inter = r.shape
            for e in range(experts):
                linear(f"{base}.{e}.down_proj", hidden, inter, r.dtype)
            continue
        if r.name.endswith(".weight") and len(r.shape) == 2:
            linear(r.name[: -len(".weight")], r.shape[0], r.shape[1], r.dtype)
            continue
        if r.name.endswith(".weight") and len(r.shape) > 2:
            unquantized.append(r.name[: -len(".weight")])  # conv1d, patch_embed: quantizer-bearing, skipped
        planned.append((r.name, r.dtype, r.shape))

    if "lm_head.weight" in {p[0] for p in planned}:
        unquantized.remove("lm_head")
    exclusions = modelopt_exclusions(unquantized, quantized)
    planned.sort(key=lambda p: _natural(p[0]))
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for p in planned:  # huggingface_hub's split_torch_state_dict_into_shards: greedy, in order
        n = tensor_nbytes(p[1], p[2])
        if groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += n
    count = len(groups)
    tensors: list[SkeletonTensor] = []
    for i, group in enumerate(groups):
        shard = SINGLE_NAME if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        tensors += [SkeletonTensor(name, dtype, shape, shard) for name, dtype, shape in group]

    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    hf_quant_config = {
        "producer": producer,
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": NVFP4_GROUP,
            "exclude_modules": exclusions,
        },
    }
    block = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
    quant_config = copy.deepcopy(config)
    quant_config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": dict(block), "weights": dict(block), "targets": ["Linear"]}},
        "ignore": list(exclusions),
        "quant_algo": "NVFP4",
        "producer": dict(producer),
        "quant_method": "modelopt",
    }
    return quant_config, hf_quant_config, tensors


# ---------------------------------------------------------------------------------------------- writing


def _header(tensors: Sequence[SkeletonTensor], metadata: Mapping[str, str] | None) -> tuple[bytes, list[int]]:
    # Same serialisation as checkpoint.writer.write_safetensors: compact JSON, space-padded to 8.
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets = []
    offset = 0
    for t in tensors:
        n = t.nbytes
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offsets.append(offset)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    offsets.append(offset)
    return raw, offsets


def write_sparse_safetensors(
    path: Path,
    tensors: Sequence[SkeletonTensor],
    metadata: Mapping[str, str] | None = None,
    fill: Callable[[SkeletonTensor], bytes | None] | None = None,
) -> int:
    """A safetensors file whose data region is a hole, except tensors ``fill`` gives bytes for.

    Returns the file size. ``fill`` may return None (leave a hole), the tensor's exact bytes, or fewer:
    the tensor's first bytes, the rest of it a hole (reads as zeros).
    """
    raw, offsets = _header(tensors, metadata)
    data_start = 8 + len(raw)
    size = data_start + offsets[-1]
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        if fill is not None:
            for t, off in zip(tensors, offsets):
                data = fill(t)
                if data is None:
                    continue
                if len(data) > t.nbytes:
                    raise ValueError(f"{path.name}: fill gave {len(data)} bytes for {t.name!r}, at most {t.nbytes}")
                fh.seek(data_start + off)
                fh.write(data)
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())
    return size


def _random_fill(seed: int, head: int | None = None) -> Callable[[SkeletonTensor], bytes | None]:
    """Pseudo-random bytes in every MTP tensor: all of it, or (``head``) only its first ``head`` bytes."""
    block = random.Random(seed).randbytes(_FILL_BLOCK)

    def fill(t: SkeletonTensor) -> bytes | None:
        if not is_mtp_name(t.name):
            return None
        n = t.nbytes if head is None else min(head, t.nbytes)
        start = sum(t.name.encode()) % 4096  # a different phase per tensor, so tensors differ
        reps = (start + n) // len(block) + 1
        return (block * reps)[start : start + n] if reps > 1 else block[start : start + n]

    return fill


def normal_fill(seed: int) -> Callable[[SkeletonTensor], bytes | None]:
    """Every tensor random-normal (std 0.02) in its own dtype: a model that runs, for measuring real bytes."""
    import torch

    from mtpquant.checkpoint.dtypes import tensor_bytes, torch_dtype

    gen = torch.Generator().manual_seed(seed)

    def fill(t: SkeletonTensor) -> bytes:
        n = 1
        for d in t.shape:
            n *= d
        return tensor_bytes((torch.randn(n, generator=gen) * 0.02).to(torch_dtype(t.dtype)))

    return fill


def make_skeleton(
    layout: Layout,
    out: Path | str,
    *,
    quant: bool = False,
    mtp_data: str = "sparse",
    seed: int = 0,
    overwrite: bool = False,
) -> SkeletonResult:
    """Write the skeleton (or, with ``quant``, the skeleton naive NVFP4 quant) of ``layout`` to ``out``.

    ``mtp_data``: ``"sparse"`` (holes, reads as zeros), ``"random"`` (real pseudo-random bytes in every
    ``mtp.*`` tensor; the rest stays sparse), ``"stamped"`` (pseudo-random bytes in the first 4 KiB of
    every ``mtp.*`` tensor, the rest of it a hole: distinct tensors for a few MB of disk), or ``"normal"``
    (every tensor random-normal in its dtype: a full-size model that converts and runs, for measuring
    memory and bytes on real data; source only; it also gets the trained tiny model's tokenizer).
    """
    if mtp_data not in ("sparse", "random", "stamped", "normal"):
        raise ValueError(f"mtp_data must be 'sparse', 'random', 'stamped' or 'normal', not {mtp_data!r}")
    if mtp_data == "normal" and quant:
        raise ValueError("random-normal weights are for the BF16 source, not the quant skeleton")
    t0 = time.perf_counter()
    hf_quant_config: dict[str, Any] | None = None
    if quant:
        config, hf_quant_config, tensors = plan_quant(layout)
    else:
        config, tensors = plan_source(layout)
    fill = (
        normal_fill(seed)
        if mtp_data == "normal"
        else _random_fill(seed)
        if mtp_data == "random" and not quant
        else _random_fill(seed, head=4096)
        if mtp_data == "stamped" and not quant
        else None
    )
    by_shard: dict[str, list[SkeletonTensor]] = defaultdict(list)
    for t in tensors:
        by_shard[t.shard].append(t)
    with OutputDir(Path(out), overwrite=overwrite, replace_check=check_synthetic_replaceable) as od:
        for shard in sorted(by_shard):
            check_shard_name(shard, where=str(od.final))
            write_sparse_safetensors(od.path / shard, by_shard[shard], {"format": "pt"}, fill)
        if len(by_shard) > 1 or SINGLE_NAME not in by_shard:
            # The same form as checkpoint.index.build_index, from the plan: re-reading 300k header
            # entries to rebuild it would double the time; finalize() re-opens everything anyway.
            weight_map = {t.name: t.shard for t in sorted(tensors, key=lambda t: t.name)}
            if len(weight_map) != len(tensors):
                raise ValueError(f"layout {layout.name}: duplicate tensor names")
            od.write_json(
                INDEX_NAME, {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
            )
        od.write_json("config.json", config)
        if hf_quant_config is not None:
            od.write_json(HF_QUANT_CONFIG, hf_quant_config)
        if mtp_data == "normal":  # a model that converts: the trained tiny model's tokenizer (ids < every vocab)
            from mtpquant.synth.train import TINY_MTP_ASSET

            for name in ("tokenizer.json", "tokenizer_config.json"):
                od.link_file(TINY_MTP_ASSET / name, name, link=False)
        final = od.finalize()
    result = SkeletonResult.of(
        final,
        layout.name,
        "quant" if quant else "source",
        tensors,
        t0,
        list(hf_quant_config["quantization"]["exclude_modules"]) if hf_quant_config else [],
    )
    log.info(
        "%s skeleton %s: %d tensors in %d shards, %.2f GB logical, %.1f MB on disk, %.1f s",
        result.kind,
        final,
        result.tensors,
        len(result.shards),
        result.total_bytes / 1e9,
        result.disk_bytes / 1e6,
        result.seconds,
    )
    return result
