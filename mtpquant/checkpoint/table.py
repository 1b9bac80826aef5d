"""A checkpoint opened header-first: config, index, and a table of every tensor, no tensor data.

``Checkpoint.open`` reads ``config.json``, the index and each shard's header (two small reads per
shard) and classifies every tensor. Tensor data is read only on request, one shard at a time.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.header import ShardHeader, TensorEntry, bulk_parse, parse_header, read_header_length
from mtpquant.checkpoint.index import INDEX_NAME, SINGLE_NAME, Problem, check_shard_name, parse_index, validate_index
from mtpquant.checkpoint.source import CheckpointSource, open_source, read_json
from mtpquant.errors import CheckpointError, ConfigError
from mtpquant.families import ModelSpec, is_mtp_name, resolve, tensor_classifier
from mtpquant.formats.quant_config import HF_QUANT_CONFIG, QuantMetadata, read_quant_metadata

if TYPE_CHECKING:
    import torch

__all__ = ["PICKLE_SUFFIXES", "Checkpoint"]

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclass
class Checkpoint:
    """Header-level view of one checkpoint: its config, family, shards and tensor table."""

    source: CheckpointSource
    config: dict[str, Any]
    spec: ModelSpec
    shards: list[str]
    headers: dict[str, ShardHeader]
    tensors: dict[str, TensorEntry]
    index: dict[str, Any] | None
    problems: list[Problem] = field(default_factory=list)
    main_prefix: str = ""
    # (device, inode, size, mtime_ns) of each local shard, taken before its header was read (empty for Hub
    # sources): lets a later open of a directory holding hard links to these shards reuse their
    # parsed headers (``Checkpoint.open(..., reuse=...)``).
    fingerprints: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    _mtp_names: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    # ---- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        ref: str | os.PathLike[str] | CheckpointSource,
        *,
        revision: str | None = None,
        token: str | None = None,
        strict: bool = True,
        reuse: Checkpoint | None = None,
    ) -> Checkpoint:
        """Open a checkpoint from a path, a Hub repo id or a source.

        With ``strict`` a fatal index defect (one loaders enforce) raises ``CheckpointError``; every defect,
        fatal or advisory, is collected in ``problems`` (inspect reports them all). Malformed headers always
        raise.

        ``reuse``: an already-open local checkpoint whose validated shard headers may stand in for
        re-parsing a shard of the same name that is the very same file, unchanged (same device, inode,
        size and mtime as when ``reuse`` read it: a hard link graft made). Every other shard is read and
        parsed; the index and every cross-shard check run in full either way.
        """
        source: CheckpointSource = open_source(ref, revision, token) if isinstance(ref, (str, os.PathLike)) else ref
        with bulk_parse():  # the whole table at once, without the collector's passes over it
            return cls._open(source, strict, reuse)

    @classmethod
    def _open(cls, source: CheckpointSource, strict: bool, reuse: Checkpoint | None) -> Checkpoint:
        files = source.list_files()
        _refuse_pickles(source.label, files)
        if "config.json" not in files:
            raise ConfigError(f"{source.label}: config.json is missing")
        config = read_json(source, "config.json")
        if not isinstance(config, dict):
            raise ConfigError("config.json: top level must be a JSON object")
        spec = resolve(config)

        index: dict[str, Any] | None = None
        if INDEX_NAME in files:
            raw_index = read_json(source, INDEX_NAME)
            weight_map, total_size = parse_index(raw_index)
            index = raw_index
            shards = sorted(set(weight_map.values()))
        elif SINGLE_NAME in files:
            weight_map, total_size = {}, None
            shards = [SINGLE_NAME]
        else:
            raise CheckpointError(f"{source.label}: no {INDEX_NAME} and no {SINGLE_NAME}")

        present = set(files)
        missing = {s for s in shards if s not in present}
        headers: dict[str, ShardHeader] = {}
        fingerprints: dict[str, tuple[int, int, int, int]] = {}
        for shard in shards:
            if shard in missing:
                continue
            fp = shard_fingerprint(source, shard)
            if fp is not None:
                fingerprints[shard] = fp
            known = _reusable_header(reuse, shard, fp)
            headers[shard] = known if known is not None else read_shard_header(source, shard)
        if index is None:
            weight_map = dict.fromkeys(headers[SINGLE_NAME].tensors, SINGLE_NAME)

        problems = validate_index(weight_map, total_size, headers, missing)
        if index is not None:
            stray = sorted(f for f in files if f.endswith(".safetensors") and f not in set(shards) and "/" not in f)
            problems += [
                Problem("stray_shard", f"{s}: shard exists but {INDEX_NAME} does not reference it") for s in stray
            ]
        fatal = [p for p in problems if p.fatal]
        if strict and fatal:
            raise CheckpointError(fatal[0].message)

        tensors: dict[str, TensorEntry] = {}
        for header in headers.values():
            tensors.update(header.tensors)
        if len(tensors) != sum(len(h.tensors) for h in headers.values()):  # a name in several shards: the index's
            tensors = {}
            for shard, header in headers.items():
                for name, entry in header.tensors.items():
                    if weight_map.get(name, shard) == shard:
                        tensors[name] = entry
        ckpt = cls(source, config, spec, shards, headers, tensors, index, problems, fingerprints=fingerprints)
        ckpt.main_prefix = spec.main_prefix_for(tensors)
        _check_config_matches_tensors(ckpt)
        log.debug("opened %s: %d tensors in %d shards", source.label, len(tensors), len(shards))
        return ckpt

    # ---- queries ------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """Path or repo id of the checkpoint."""
        return self.source.label

    def classify(self, name: str) -> str:
        """Class of a tensor: main / mtp / vision / embed / lm_head / other."""
        return self.spec.classify(name, self.main_prefix)

    def by_class(self) -> dict[str, list[TensorEntry]]:
        """Tensors grouped by class, each group sorted by name."""
        classify = tensor_classifier(self.main_prefix or self.spec.main_prefix, self.spec.family.has_vision)
        groups: dict[str, list[TensorEntry]] = defaultdict(list)
        tensors = self.tensors
        for name in sorted(tensors):
            groups[classify(name)].append(tensors[name])
        return dict(groups)

    @property
    def mtp_only(self) -> bool:
        """An MTP sidecar: every tensor is ``mtp.*`` (``convert --mtp extract``'s MTP directory, say)."""
        return bool(self.tensors) and len(self._mtp()) == len(self.tensors)

    def _mtp(self) -> list[str]:
        # classify() answers MTP exactly for the names is_mtp_name() accepts (its first test): filter with that,
        # then sort the few MTP names only, not the whole table; once (the table does not change after open)
        if self._mtp_names is None:
            self._mtp_names = sorted(n for n in self.tensors if is_mtp_name(n))
        return self._mtp_names

    def mtp_tensors(self) -> list[TensorEntry]:
        """Every ``mtp.*`` tensor present, sorted by name."""
        return [self.tensors[n] for n in self._mtp()]

    @property
    def total_bytes(self) -> int:
        """Sum of tensor bytes."""
        if len(self.tensors) == sum(len(h.tensors) for h in self.headers.values()):
            # every header's tensors are in the table, and they tile its data region exactly
            return sum(h.file_size - h.data_start for h in self.headers.values())
        return sum(e.nbytes for e in self.tensors.values())

    # ---- data ---------------------------------------------------------------------------------
    def read_raw(self, entry: TensorEntry) -> bytes:
        """The tensor's bytes exactly as stored."""
        return self.source.read_range(entry.shard, entry.start, entry.end)

    def local_range(self, entry: TensorEntry) -> tuple[Path, int, int] | None:
        """(file, start, end) of a tensor on a local disk, counted as read; None for remote sources."""
        return self.source.local_extent(entry.shard, entry.start, entry.end)

    def copy_observer(self, entry: TensorEntry) -> Callable[[memoryview], None] | None:
        """What must see a local tensor's bytes as they are copied (a checksum), if anything."""
        return self.source.copy_observer(entry.shard, entry.start, entry.end)

    # ---- quantization metadata (the one reader) ----------------------------------------------------
    @cached_property
    def hf_quant_config(self) -> dict[str, Any] | None:
        """``hf_quant_config.json`` (ModelOpt's), or None when the checkpoint has none."""
        if not self.source.exists(HF_QUANT_CONFIG):
            return None
        raw = read_json(self.source, HF_QUANT_CONFIG)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{self.label}: {HF_QUANT_CONFIG} is not a JSON object")
        return raw

    @cached_property
    def quant_metadata(self) -> QuantMetadata | None:
        """The quantization the checkpoint declares (config.json first, as vLLM reads it); None: unquantized."""
        return read_quant_metadata(self.config, self.hf_quant_config)

    def read_tensor(self, name: str) -> torch.Tensor:
        """One tensor, decoded by safetensors from its stored bytes."""
        from safetensors.torch import load

        entry = self.tensors[name]
        return load(_single_tensor_blob(entry, self.read_raw(entry)))[name]

    def prefetch(self, names: Iterable[str]) -> dict[str, list[TensorEntry]]:
        """Tell the source which tensors are about to be read (a remote one merges adjacent ones into one
        request); returns them by shard, in file order."""
        by_shard: dict[str, list[TensorEntry]] = defaultdict(list)
        for name in names:
            entry = self.tensors[name]
            by_shard[entry.shard].append(entry)
        for shard, entries in by_shard.items():
            entries.sort(key=lambda e: e.start)
            self.source.plan_reads(shard, [(e.start, e.end) for e in entries])
        return by_shard

    def iter_raw(self, names: Iterable[str]) -> Iterator[tuple[TensorEntry, bytes]]:
        """Stored bytes of many tensors, grouped by shard and in file order (one shard at a time)."""
        by_shard = self.prefetch(names)
        for shard in sorted(by_shard):
            for entry in sorted(by_shard[shard], key=lambda e: e.start):
                yield entry, self.read_raw(entry)


def read_shard_header(source: CheckpointSource, shard: str) -> ShardHeader:
    """Parse one shard's header with exactly two reads: the length prefix, then the JSON."""
    check_shard_name(shard, where=source.label)
    size = source.file_size(shard)
    n = read_header_length(shard, source.read_range(shard, 0, min(size, 8)), size)
    return parse_header(shard, source.read_range(shard, 8, 8 + n), size)


def shard_fingerprint(source: CheckpointSource, shard: str) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime_ns) of a local shard (the file a symlink points to); None for a remote one."""
    check_shard_name(shard, where=source.label)
    return source.fingerprint(shard)


def _reusable_header(reuse: Checkpoint | None, shard: str, fp: tuple[int, int, int, int] | None) -> ShardHeader | None:
    """``reuse``'s parsed header of ``shard`` when this file is the one it parsed, unchanged."""
    if reuse is None or fp is None:
        return None
    header = reuse.headers.get(shard)
    if header is None or reuse.fingerprints.get(shard) != fp or header.file_size != fp[2]:
        return None
    return header


def _single_tensor_blob(entry: TensorEntry, data: bytes) -> bytes:
    import json
    import struct

    header = json.dumps(
        {entry.name: {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [0, len(data)]}}
    )
    raw = header.encode() + b" " * (-len(header) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _refuse_pickles(label: str, files: list[str]) -> None:
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    if pickles and not has_safetensors:
        raise CheckpointError(
            f"{label}: {pickles[0]} is a pickle checkpoint; mtpquant never loads pickles (convert it to safetensors)"
        )
    for f in pickles:
        log.warning("%s: ignoring pickle file %s (never loaded)", label, f)


_UNQUANTIZED_DTYPES = ("BF16", "F16", "F32")


def _check_config_matches_tensors(ckpt: Checkpoint) -> None:
    """Refuse a config that contradicts the tensors (hidden size, vocabulary, MTP shapes)."""
    spec = ckpt.spec
    embed = ckpt.tensors.get(ckpt.main_prefix + "embed_tokens.weight")
    if embed is not None and embed.dtype in _UNQUANTIZED_DTYPES and len(embed.shape) == 2:
        want = (spec.text.get("vocab_size"), spec.text.get("hidden_size"))
        if want != embed.shape:
            raise ConfigError(
                f"config.json: vocab_size {want[0]} / hidden_size {want[1]} contradict "
                f"{embed.name} of shape {list(embed.shape)} in {embed.shard}"
            )
    try:
        expected = spec.expected_mtp_shapes(ckpt._mtp())
    except ConfigError:
        if ckpt._mtp():
            raise
        return
    for name, shape in expected.items():
        entry = ckpt.tensors.get(name)
        if entry is not None and entry.dtype in _UNQUANTIZED_DTYPES and entry.shape != shape:
            raise ConfigError(
                f"config.json implies {name} of shape {list(shape)}, but {entry.shard} holds {list(entry.shape)}"
            )
