"""A checkpoint opened header-first: config, index, and a table of every tensor, no tensor data.

``Checkpoint.open`` reads ``config.json``, the index and each shard's header (two small reads per
shard) and classifies every tensor. Tensor data is read only on request, one shard at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.header import (
    FLOAT_DTYPES,
    ShardHeader,
    TensorEntry,
    bulk_parse,
    parse_header,
    read_header_length,
)
from mtpquant.checkpoint.index import INDEX_NAME, SINGLE_NAME, Problem, check_shard_name, parse_index, validate_index
from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.precision import module_precision
from mtpquant.checkpoint.source import CheckpointSource, open_source, read_json
from mtpquant.errors import CheckpointError, ConfigError, MtpquantError
from mtpquant.families import APPENDED, UNKNOWN, ModelSpec, MtpNames, TensorClass, group_by_class, resolve
from mtpquant.formats.quant_config import HF_QUANT_CONFIG, QuantMetadata, read_quant_metadata

if TYPE_CHECKING:
    import torch

__all__ = ["PICKLE_SUFFIXES", "Checkpoint", "TableClasses"]

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@dataclass(frozen=True)
class TableClasses:
    """A tensor table by class (``ModelSpec.classify``: main, mtp, vision, ...): each class's entries in table order
    (``groups``), and each class's Linear modules (``modules.linear_modules``) with their precision on disk
    (``precision.module_precision``), sorted by module name (``linears``). Read-only: shared by a checkpoint and its
    amended views."""

    groups: Mapping[str, dict[str, TensorEntry]]
    linears: Mapping[str, dict[str, str]]

    @classmethod
    def of(
        cls, tensors: Mapping[str, TensorEntry], main_prefix: str, has_vision: bool, names: MtpNames
    ) -> TableClasses:
        """Classify every tensor of ``tensors`` (``families.group_by_class``)."""
        groups = group_by_class(tensors, main_prefix, has_vision, names)
        return cls(groups, {c: _linears(tensors, group) for c, group in groups.items()})

    def with_mtp(self, tensors: Mapping[str, TensorEntry], mtp: dict[str, TensorEntry]) -> TableClasses:
        """These classes for ``tensors``: this table's entries less its MTP, plus ``mtp`` (MTP entries)."""
        groups = {c: g for c, g in self.groups.items() if c != TensorClass.MTP}
        linears = {c: p for c, p in self.linears.items() if c != TensorClass.MTP}
        if mtp:
            groups[TensorClass.MTP] = mtp
            linears[TensorClass.MTP] = _linears(tensors, mtp)
        return TableClasses(groups, linears)


def _linears(tensors: Mapping[str, TensorEntry], group: Mapping[str, TensorEntry]) -> dict[str, str]:
    """The Linear modules of ``group`` (one class of ``tensors``) -> their precision on disk, sorted by name."""
    return {m: module_precision(tensors, m) for m in linear_modules(group)}


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
    _forgotten: dict[str, dict[str, TensorEntry]] | None = field(default=None, init=False, repr=False, compare=False)
    _classes: TableClasses | None = field(default=None, init=False, repr=False, compare=False)
    # an amended view: the checkpoint whose table it shares but for the MTP entries, and those entries' names (None:
    # the very same table), so that its classes, Linear precisions and byte total are derived, not recomputed
    _base: Checkpoint | None = field(default=None, init=False, repr=False, compare=False)
    _base_mtp: list[str] | None = field(default=None, init=False, repr=False, compare=False)

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
        name_errors: bool = False,
    ) -> Checkpoint:
        """Open a checkpoint from a path, a Hub repo id or a source.

        With ``strict`` a fatal index defect (one loaders enforce) raises ``CheckpointError``; every defect,
        fatal or advisory, is collected in ``problems`` (inspect reports them all). Malformed headers always
        raise.

        ``reuse``: an already-open local checkpoint whose validated shard headers may stand in for
        re-parsing a shard of the same name that is the very same file, unchanged (same device, inode,
        size and mtime as when ``reuse`` read it: a hard link graft made). Every other shard is read and
        parsed; the index and every cross-shard check run in full either way.

        ``name_errors``: an error that names a file alone (``config.json: not valid JSON``) names its checkpoint
        first, for commands that read two checkpoints (graft, validate).
        """
        source: CheckpointSource = open_source(ref, revision, token) if isinstance(ref, (str, os.PathLike)) else ref
        try:
            with bulk_parse():  # the whole table at once, without the collector's passes over it
                return cls._open(source, strict, reuse)
        except MtpquantError as exc:
            if not name_errors or str(exc).startswith(source.label):
                raise
            raise type(exc)(f"{source.label}: {exc}") from exc.__cause__

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
        _check_config_bounds(spec)

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

        if len(weight_map) > MAX_TENSORS:
            raise CheckpointError(f"{INDEX_NAME}: maps {len(weight_map)} tensors, more than the {MAX_TENSORS} "
                                  "mtpquant reads of one checkpoint")
        present = set(files)
        missing = {s for s in shards if s not in present}
        headers: dict[str, ShardHeader] = {}
        fingerprints: dict[str, tuple[int, int, int, int]] = {}
        count = 0
        for shard in shards:
            if shard in missing:
                continue
            fp = shard_fingerprint(source, shard)
            if fp is not None:
                fingerprints[shard] = fp
            known = _reusable_header(reuse, shard, fp)
            headers[shard] = known if known is not None else read_shard_header(source, shard)
            count += len(headers[shard].tensors)
            if count > MAX_TENSORS:
                raise CheckpointError(f"{shard}: brings the checkpoint to {count} tensors, more than the "
                                      f"{MAX_TENSORS} mtpquant reads of one checkpoint")
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
        if spec.family.status == UNKNOWN:  # an unknown MTP family: its tensors show where the MTP is
            spec = resolve(config, tensors)
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
        groups = {c: [g[n] for n in sorted(g)] for c, g in self.classes().groups.items()}
        return dict(sorted(groups.items(), key=lambda cg: cg[1][0].name))  # each class where its first name sorts

    def classes(self) -> TableClasses:
        """The table by class, with each class's Linear modules and their precisions (once per table: an amended view
        that keeps this table's classifier and all but its MTP entries derives them from this one's)."""
        if self._classes is None:
            base = self._base
            if base is not None and base._classifier_key() == self._classifier_key():
                if self._base_mtp is None:
                    self._classes = base.classes()
                else:
                    mtp = {n: self.tensors[n] for n in self._base_mtp}
                    self._classes = base.classes().with_mtp(self.tensors, mtp)
            else:
                self._classes = TableClasses.of(self.tensors, *self._classifier_key())
        return self._classes

    def _classifier_key(self) -> tuple[str, bool, MtpNames]:
        return self.main_prefix or self.spec.main_prefix, self.spec.family.has_vision, self.spec.mtp_names

    def linear_precisions(self) -> dict[str, str]:
        """Every Linear module of the table -> its precision on disk, sorted by module name: what
        ``checkpoint.precision.linear_precisions`` gives for ``tensors``, from the classes (a new dict)."""
        merged = {m: p for linears in self.classes().linears.values() for m, p in linears.items()}
        return dict(sorted(merged.items()))

    def is_mtp(self, name: str) -> bool:
        """Whether a tensor or module name belongs to the MTP, by the family's storage (``ModelSpec.is_mtp``)."""
        return self.spec.is_mtp(name)

    @property
    def mtp_only(self) -> bool:
        """An MTP sidecar: every tensor is an MTP tensor (``convert --mtp extract``'s MTP directory, say)."""
        return bool(self.tensors) and len(self._mtp()) == len(self.tensors)

    def _mtp(self) -> list[str]:
        # classify() answers MTP exactly for the names the family's test accepts (its first test): filter with that,
        # then sort the few MTP names only, not the whole table; once (the table does not change after open)
        if self._mtp_names is None:
            if self._base is not None:  # an amended view: the rest of its table is its base's, which has no MTP name
                self._mtp_names = self._base._mtp() if self._base_mtp is None else sorted(self._base_mtp)
            else:
                is_mtp = self.spec.mtp_names.matcher
                self._mtp_names = sorted(n for n in self.tensors if is_mtp(n))
        return self._mtp_names

    def mtp_tensors(self) -> list[TensorEntry]:
        """Every MTP tensor present (the family's storage: ``mtp.*``, appended layers, ...), sorted by name."""
        return [self.tensors[n] for n in self._mtp()]

    def forgotten_mtp(self) -> dict[str, dict[str, TensorEntry]]:
        """Shards beside the index that it does not list and that hold only MTP tensors (GLM-4.7's ``mtp.safetensors``
        left out of a ModelOpt export's index): shard -> its tensors. Loaders read only the shards the index names
        (vLLM 0.32 ``filter_duplicate_safetensors_files``), so to them this MTP is missing. Each such shard's header is
        read (two small reads); one that does not parse is left out (the stray-shard note still names it)."""
        if self._forgotten is None:
            self._forgotten = {}
            if self.index is not None:
                referenced = set(self.shards)
                files = self.source.list_files()
                for shard in sorted(f for f in files if f.endswith(".safetensors") and "/" not in f):
                    if shard in referenced:
                        continue
                    try:
                        header = read_shard_header(self.source, shard)
                    except MtpquantError:
                        continue
                    if header.tensors and all(self.spec.is_mtp(n) for n in header.tensors):
                        self._forgotten[shard] = dict(header.tensors)
        return self._forgotten

    def lost_tensors(self) -> dict[str, list[str]]:
        """Each shard the index names that does not exist -> the tensors the index maps to it (empty when none)."""
        missing = {s for s in self.shards if s not in self.headers}
        if not missing or self.index is None:
            return {}
        lost: dict[str, list[str]] = defaultdict(list)
        for name, shard in self.index["weight_map"].items():
            if shard in missing:
                lost[shard].append(str(name))
        return {shard: sorted(names) for shard, names in sorted(lost.items())}

    @property
    def only_mtp_lost(self) -> bool:
        """The index's fatal defects are all shards that do not exist and that held only MTP tensors (an MTP
        shard deleted, or never downloaded): the rest of the checkpoint is whole, and ``graft --from SRC`` puts the
        MTP back."""
        fatal = [p for p in self.problems if p.fatal]
        lost = self.lost_tensors()
        return (
            bool(fatal)
            and all(p.code == "missing_shard" for p in fatal)
            and all(self.spec.is_mtp(n) for names in lost.values() for n in names)
        )

    def amended(
        self,
        config: dict[str, Any],
        hf_quant_config: dict[str, Any] | None,
        mtp: Mapping[str, TensorEntry] | None = None,
        problems: list[Problem] | None = None,
        *,
        indexed_forgotten: bool = False,
    ) -> Checkpoint:
        """This checkpoint's header-level view as a repair would leave it: new metadata, and (where given) the MTP
        entries that take the place of this checkpoint's (``mtp``: the rest of the table stays this one's, in its
        order, the new entries after it) and new index problems; ``indexed_forgotten``: the MTP shards the index forgot
        are indexed (their tensors in ``mtp``, their stray-shard notes gone). Nothing is read or written. The view
        derives its classes, Linear precisions and byte total from this checkpoint's where its MTP name test is this
        one's (the rest of its table is then this one's, entry for entry)."""
        if indexed_forgotten:
            adopted = set(self.forgotten_mtp())
            problems = [p for p in (self.problems if problems is None else problems)
                        if not (p.code == "stray_shard" and p.message.split(":", 1)[0] in adopted)]
        tensors = self.tensors
        if mtp is not None:
            tensors = dict(tensors)
            for name in self._mtp():
                del tensors[name]
            tensors.update(mtp)
        view = dataclasses.replace(
            self,
            config=config,
            spec=resolve(config, tensors),
            tensors=tensors,
            problems=self.problems if problems is None else problems,
        )
        view.__dict__["hf_quant_config"] = hf_quant_config  # the cached_property's slot: never read from the source
        if indexed_forgotten:
            view._forgotten = {}
        if view.spec.mtp_names == self.spec.mtp_names and (mtp is None or all(map(view.spec.mtp_names.matcher, mtp))):
            view._base, view._base_mtp = self, None if mtp is None else list(mtp)
        return view

    @property
    def total_bytes(self) -> int:
        """Sum of tensor bytes."""
        base = self._base
        if base is not None:  # an amended view: the base's table less its MTP, plus the view's MTP
            if self._base_mtp is None:
                return base.total_bytes
            old = sum(base.tensors[n].nbytes for n in base._mtp())
            return base.total_bytes - old + sum(self.tensors[n].nbytes for n in self._base_mtp)
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


# Sane limits on what one checkpoint may declare or hold. Config values size loops and tables (the expected MTP
# tensor set, the model transformers builds): the largest real checkpoints are far below them (Qwen3.5-397B: 60
# layers, 512 experts, 1 MTP layer; a fine-grained MoE quant: ~300,000 tensors).
MAX_TENSORS = 1_000_000
MAX_MTP_LAYERS = 16
_CONFIG_LIMITS = {"num_hidden_layers": 1024, "num_experts": 4096}


# The layer kinds a config's ``layer_types`` may name: transformers 5.19's ``configuration_utils.ALLOWED_LAYER_TYPES``,
# which its config classes enforce and engines build layers from (Qwen4-Exp: ``indexed_attention``), and the legacy
# names its ``_LEGACY_LAYER_TYPE_REMAP`` renames before that check (``qwen_sparse_attention``, ...).
_LAYER_TYPES = frozenset({
    "full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
    "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe", "hybrid",
    "hybrid_sliding", "linear_attention", "sparse", "dense",
    "mamba", "attention", "deepseek_sparse_attention", "qwen_sparse_attention",
})
_SECTIONS = ("text_config", "vision_config", "rope_parameters", "rope_scaling", "quantization_config")
# torch's dtype names a config's ``dtype`` / ``torch_dtype`` may hold (transformers looks them up on ``torch``).
_DTYPES = frozenset({
    "auto", "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex64", "complex128", "bool",
    "uint8", "int8", "int16", "int32", "int64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2",
})


def _check_config_bounds(spec: ModelSpec) -> None:
    """Refuse a config whose values would drive loops and tables past any real model, or that transformers' own config
    class would refuse where inspect can see it without importing transformers (sections that are not objects,
    ``layer_types`` of the wrong kind or length): one line, exit 3. convert also runs transformers' own validation
    (``convert.plan.check_config_with_transformers``)."""
    where = "text_config." if spec.wrapped else ""
    for section in _SECTIONS:
        for scope, prefix in ((spec.config, ""), (spec.text, where)):
            value = scope.get(section)
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"config.json: {prefix}{section} must be an object, got {type(value).__name__}")
    for scope, prefix in ((spec.config, ""), (spec.text, where)):
        for key in ("dtype", "torch_dtype"):
            value = scope.get(key)
            if value is not None and (not isinstance(value, str) or value.removeprefix("torch.") not in _DTYPES):
                raise ConfigError(f"config.json: {prefix}{key} {value!r} is not a torch dtype")
    kinds = spec.text.get("layer_types")
    if kinds is not None:
        layers = spec.text.get("num_hidden_layers")
        if not isinstance(kinds, list) or not all(isinstance(k, str) and k in _LAYER_TYPES for k in kinds):
            raise ConfigError(f"config.json: {where}layer_types must be a list of layer kinds, got {str(kinds)[:80]}")
        # configs of appended-layer families may list the MTP layers too (Step-3.5's legacy per-layer lists carry
        # num_nextn_predict_layers trailing entries: transformers' Step3p7Config splits them off into mtp_*)
        if isinstance(layers, int) and len(kinds) not in (
            {layers, layers + spec.mtp.layers} if spec.family.mtp.storage.kind == APPENDED else {layers}
        ):
            raise ConfigError(
                f"config.json: {where}layer_types lists {len(kinds)} layers but num_hidden_layers is {layers}"
            )
    for key, limit in _CONFIG_LIMITS.items():
        value = spec.text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= limit:
            raise ConfigError(f"config.json: {where}{key} = {value} is outside what any model has (0 to {limit})")
    if spec.mtp.layers > MAX_MTP_LAYERS:
        raise ConfigError(
            f"config.json: {spec.mtp.key} = {spec.mtp.layers} declares more MTP layers than any model has "
            f"(at most {MAX_MTP_LAYERS})"
        )


def _check_config_matches_tensors(ckpt: Checkpoint) -> None:
    """Refuse a config that contradicts the tensors (hidden size, vocabulary, layer count, MTP shapes)."""
    spec = ckpt.spec
    layers = spec.text.get("num_hidden_layers")
    norm = "layers.{}.input_layernorm.weight"
    if isinstance(layers, int) and layers > 0 and ckpt.main_prefix + norm.format(0) in ckpt.tensors:
        last = ckpt.main_prefix + norm.format(layers - 1)  # a few lookups: the table of a real model is ~10^5 names
        indexed = ckpt.index.get("weight_map", {}) if ckpt.index else {}
        if last not in ckpt.tensors and last not in indexed:  # (a missing shard is the index's problem)
            raise ConfigError(f"config.json: num_hidden_layers {layers} contradicts the tensors: there is no {last}")
    embed = ckpt.tensors.get(ckpt.main_prefix + "embed_tokens.weight")
    if embed is not None and embed.dtype in FLOAT_DTYPES and len(embed.shape) == 2:
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
        if entry is not None and entry.dtype in FLOAT_DTYPES and entry.shape != shape:
            raise ConfigError(
                f"config.json implies {name} of shape {list(shape)}, but {entry.shard} holds {list(entry.shape)}"
            )
