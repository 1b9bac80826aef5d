"""graft: repair a quant that lost its MTP by adding SRC's MTP tensors, writing only the MTP bytes.

Plan from headers, refuse early, then act:

1. open QUANT and SRC header-first; check lineage (family, dimensions, MTP shapes) before any write;
2. read only SRC's ``mtp.*`` tensors (byte ranges from the header table, locally or by ranged Hub
   reads, falling back to downloading just the shards that hold them) and write them into new
   ``mtp-*.safetensors`` shards through convert's keep mode (``surgery.modes``), the same code;
3. hard-link every untouched file (copy where links fail, reported), rewrite the index (existing
   entries unchanged, MTP entries added, ``total_size`` updated), restore the MTP declaration and
   add the exclusions in ``config.json`` and ``hf_quant_config.json``;
4. verify the result (headers, index, MTP bytes against SRC, the inspect checks) before it is put
   in place: ``--out`` by renaming a temp sibling, ``--in-place`` by an atomic directory exchange
   (see ``mtpquant.graft.inplace``).

``--fix-metadata`` runs step 3's metadata part alone and touches no tensor file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.index import INDEX_NAME, SINGLE_NAME
from mtpquant.checkpoint.source import CheckpointSource, SourceRef
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
from mtpquant.errors import CheckpointError, OutputExistsError, OutputVerificationError, UsageError
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.graft import inplace
from mtpquant.graft.lineage import GraftError, LineageError, LineageReport, check_lineage, mtp_layer_count
from mtpquant.inspect.report import inspect_checkpoint
from mtpquant.provenance import PROVENANCE_FILE, Step, source_provenance
from mtpquant.surgery.metadata import MetadataPlan, plan_metadata
from mtpquant.surgery.modes import MODES, WriteContext

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "GraftError",
    "GraftOptions",
    "GraftResult",
    "LineageError",
    "fix_metadata",
    "graft",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class GraftOptions:
    """Everything ``mtpquant graft`` takes; the CLI builds one of these and calls ``graft``."""

    quant: str | os.PathLike[str]
    source: str | os.PathLike[str] | None = None  # SRC: a directory or Hub repo id (None with fix_metadata)
    out: str | os.PathLike[str] | None = None
    in_place: bool = False
    replace: bool = False
    fix_metadata: bool = False
    revision: str | None = None  # QUANT's Hub revision
    source_revision: str | None = None  # SRC's Hub revision
    token: str | None = field(default=None, repr=False)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    link: bool = True  # hard-link untouched files (False: copy them)
    dry_run: bool = False
    command: tuple[str, ...] = ()  # the command line, recorded in the provenance file (the CLI sets it)


@dataclass
class GraftResult:
    """What graft did (or, with ``dry_run``, would do)."""

    quant: str
    source: str | None
    destination: str | None  # the directory that holds the result (None for a no-op / dry run)
    mode: str  # "out" | "in-place"
    action: str  # "grafted" | "replaced" | "metadata" | "noop" | "planned"
    message: str
    mtp_tensors: int = 0
    mtp_bytes: int = 0
    src_bytes_fetched: int = 0
    quant_bytes_fetched: int = 0
    bytes_written: int = 0
    new_shards: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    metadata_changes: list[str] = field(default_factory=list)
    src_shards_downloaded: list[str] = field(default_factory=list)
    cleaned: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verified_with: list[str] = field(default_factory=list)
    commit: str | None = None  # "rename" (--out) | "exchange" | "files" (--in-place)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- sources


class _TrackedSource:
    """SRC's source, hashing every MTP tensor read and downloading a shard whole if ranged reads fail.

    Generic over ``CheckpointSource``: "download" is ``local_path``, which a local source answers with
    its own file, so graft never needs to know where SRC lives.
    """

    def __init__(self, inner: CheckpointSource, entries: list[TensorEntry]) -> None:
        self.inner = inner
        self.label = inner.label
        self.bytes_read = inner.bytes_read
        self.hashes: dict[str, str] = {}
        self.downloaded: list[str] = []
        self._local: dict[str, Path] = {}
        self._entries: dict[str, list[TensorEntry]] = defaultdict(list)
        for e in sorted(entries, key=lambda e: e.start):
            self._entries[e.shard].append(e)

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def exists(self, relpath: str) -> bool:
        return self.inner.exists(relpath)

    def file_size(self, relpath: str) -> int:
        return self.inner.file_size(relpath)

    def local_path(self, relpath: str) -> Path:
        return self.inner.local_path(relpath)

    @property
    def local_root(self) -> Path | None:
        return self.inner.local_root

    def local_dir(self, ignore_patterns: list[str]) -> Path:
        return self.inner.local_dir(ignore_patterns)

    def local_extent(self, relpath: str, start: int, end: int) -> tuple[Path, int, int] | None:
        # every MTP byte goes through read_range, where it is checksummed for the write-back check
        del relpath, start, end
        return None

    def fingerprint(self, relpath: str) -> tuple[int, int, int, int] | None:
        return self.inner.fingerprint(relpath)

    def ref(self) -> SourceRef:
        return self.inner.ref()

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        if relpath in self._local:
            data = _read_local(self._local[relpath], relpath, start, end)
        else:
            try:
                data = self.inner.read_range(relpath, start, end)
            except CheckpointError:
                raise
            except Exception as exc:
                # Ranged reads failed (server without Range support, proxy, ...): fetch this shard only.
                log.warning(
                    "%s: ranged read of %s failed (%s); downloading that shard",
                    self.label,
                    relpath,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                try:
                    path = self.inner.local_path(relpath)
                except Exception as exc2:
                    raise CheckpointError(f"{self.label}: cannot read {relpath} ({type(exc2).__name__})") from None
                self._local[relpath] = path
                self.downloaded.append(relpath)
                data = _read_local(path, relpath, start, end)
        self.bytes_read = self.inner.bytes_read
        for e in self._entries.get(relpath, ()):
            if e.start >= start and e.end <= end:
                self.hashes[e.name] = _checksum(memoryview(data)[e.start - start : e.end - start])
        return data


def _checksum(data: bytes | memoryview) -> str:
    """Length + CRC-32 of tensor bytes: the write-back check guards against I/O and copy errors, not
    adversaries, and CRC-32 runs ~4x faster than sha256 here (the check would otherwise cost more than
    writing the MTP)."""
    return f"{len(data)}:{zlib.crc32(data):08x}"


def _read_local(path: Path, relpath: str, start: int, end: int) -> bytes:
    with path.open("rb") as fh:
        fh.seek(start)
        data = fh.read(end - start)
    if len(data) != end - start:
        raise CheckpointError(f"{relpath}: truncated: wanted bytes {start}..{end}, file ends earlier")
    return data


# ---------------------------------------------------------------------------------------------- planning


@dataclass
class _Plan:
    """The whole change, decided from headers before anything is written."""

    quant: Checkpoint
    hfq: dict[str, Any] | None
    weight_map: dict[str, str]  # QUANT's current map (implied for a single-file checkpoint)
    link: list[str] = field(default_factory=list)  # shards kept as they are
    rewrite: dict[str, list[str]] = field(default_factory=dict)  # shard -> tensors kept (MTP removed)
    drop: list[str] = field(default_factory=list)  # shards holding only the MTP being replaced
    add: list[str] = field(default_factory=list)  # MTP tensor names to write
    removed: list[str] = field(default_factory=list)  # QUANT's MTP tensors being replaced
    strays: list[str] = field(default_factory=list)  # unreferenced *.safetensors in QUANT
    metadata: MetadataPlan = field(default_factory=MetadataPlan)
    mtp_layers: int = 0
    index_fix: str | None = None  # QUANT's index declares a wrong total_size: the change line that corrects it


def _weight_map(ckpt: Checkpoint) -> dict[str, str]:
    if ckpt.index is not None:
        return {str(k): str(v) for k, v in ckpt.index["weight_map"].items()}
    return dict.fromkeys(ckpt.tensors, SINGLE_NAME)


def _total_size_fix(ckpt: Checkpoint) -> str | None:
    """The change line when QUANT's index declares a wrong ``metadata.total_size`` (None when it is right).

    No loader reads total_size (peers write it from file sizes, or as 0), so it is no reason to refuse;
    but what graft writes carries the right one.
    """
    if ckpt.index is None or not any(p.code == "total_size" for p in ckpt.problems):
        return None
    meta = ckpt.index.get("metadata")
    old = meta.get("total_size") if isinstance(meta, dict) else None
    return f"{INDEX_NAME}: metadata.total_size = {ckpt.total_bytes} (was {old!r})"


def _strays(ckpt: Checkpoint, weight_map: dict[str, str]) -> list[str]:
    referenced = set(weight_map.values())
    return sorted(
        f for f in ckpt.source.list_files() if f.endswith(".safetensors") and "/" not in f and f not in referenced
    )


def _plan_shards(plan: _Plan, removed: set[str]) -> None:
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in plan.weight_map.items():
        by_shard[shard].append(name)
    for shard in sorted(by_shard):
        names = by_shard[shard]
        gone = [n for n in names if n in removed]
        if not gone:
            plan.link.append(shard)
        elif len(gone) == len(names):
            plan.drop.append(shard)
        else:
            plan.rewrite[shard] = sorted(n for n in names if n not in removed)


def _new_index(plan: _Plan, mtp_entries: dict[str, TensorEntry], new_shard_of: dict[str, str]) -> dict[str, Any]:
    """QUANT's index with the replaced MTP entries removed and the new ones added; total_size updated."""
    removed = set(plan.removed)
    weight_map = {n: s for n, s in plan.weight_map.items() if n not in removed}
    weight_map.update(new_shard_of)
    total = sum(plan.quant.tensors[n].nbytes for n in weight_map if n not in new_shard_of)
    total += sum(mtp_entries[n].nbytes for n in new_shard_of)
    old = plan.quant.index or {}
    raw_meta = old.get("metadata")
    meta: dict[str, Any] = dict(raw_meta) if isinstance(raw_meta, dict) else {}
    metadata = {**meta, "total_size": total} if "total_size" in meta else {"total_size": total, **meta}
    index = {k: v for k, v in old.items() if k not in ("metadata", "weight_map")}
    # existing top-level key order kept; an index created here has build_index's layout
    out: dict[str, Any] = {}
    for key in [*list(old), "metadata", "weight_map"]:
        if key in out:
            continue
        if key == "metadata":
            out[key] = metadata
        elif key == "weight_map":
            out[key] = dict(sorted(weight_map.items()))
        else:
            out[key] = index[key]
    return out


# ---------------------------------------------------------------------------------------------- verification


def _verify(
    path: Path,
    expected: dict[str, tuple[int, ...]],
    src_hashes: dict[str, str] | None,
    mtp_layers: int,
    quant: Checkpoint,
    result: GraftResult,
) -> list[str]:
    """Check the finished result where it was built; raise if it is not healthy. Returns checks run.

    The inspect verdict must be clean, except for failures QUANT already had that graft does not
    touch (a main-model defect, say): those stay, and are reported as warnings.
    """

    def fail(reason: str) -> OutputVerificationError:
        return OutputVerificationError(f"the result failed verification and was not put in place: {reason}")

    # Every file graft wrote (new MTP shards, rewritten shards, index, JSON) is read and parsed again;
    # a hard link to a QUANT shard reuses the header parsed when QUANT was opened, but only when it is
    # that very file, unchanged since (device, inode, size, mtime). The index checks run in full.
    ckpt = Checkpoint.open(path, strict=True, reuse=quant)
    wrong_total = [p.message for p in ckpt.problems if p.code == "total_size"]
    if wrong_total:
        raise fail(wrong_total[0])
    checks = ["headers+index"]
    present = {e.name: e.shape for e in ckpt.mtp_tensors()}
    if set(present) != set(expected):
        missing = sorted(set(expected) - set(present))
        raise fail(f"MTP tensor set differs from what config.json implies (missing {missing[:1]})")
    bad = [n for n, s in expected.items() if present[n] != s]
    if bad:
        raise fail(f"{bad[0]} has shape {list(present[bad[0]])}, expected {list(expected[bad[0]])}")
    if src_hashes is not None:
        if set(src_hashes) != set(expected):
            raise fail("not every MTP tensor was read from SRC exactly once per byte range")
        for entry, data in ckpt.iter_raw(sorted(src_hashes)):
            if _checksum(data) != src_hashes[entry.name]:
                raise fail(f"{entry.name} in {entry.shard} is not byte-identical to SRC")
        checks.append("mtp-bytes")
    if ckpt.spec.mtp.layers != mtp_layers:
        raise fail(f"config.json declares {ckpt.spec.mtp.describe()}, the tensors hold {mtp_layers} MTP layers")
    leftover = plan_metadata(ckpt.spec, ckpt.hf_quant_config, ckpt.tensors, mtp_layers=mtp_layers)
    if leftover.changes:
        raise fail(f"metadata still incomplete ({leftover.changes[0]})")
    checks.append("exclusions")
    report = inspect_checkpoint(path, checkpoint=ckpt)
    if not report.healthy:
        baseline = set(inspect_checkpoint(quant.source, checkpoint=quant).failure_messages)
        new = [m for m in report.failure_messages if m not in baseline]
        if new:
            raise fail(f"inspect: {new[0]}")
        for m in report.failure_messages:
            warning = f"QUANT's own problem, not graft's to fix, remains: {m}"
            log.warning("%s", warning)
            result.warnings.append(warning)
    checks.append("inspect")
    return checks


# ---------------------------------------------------------------------------------------------- writing


@dataclass
class _Target:
    """Where the result is built and how it is put in place."""

    od: OutputDir
    mode: str  # "out" | "in-place"
    root: Path | None  # QUANT's directory for in-place
    commit: str  # "rename" | "exchange" | "files"
    before: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def _open_target(options: GraftOptions, quant: Checkpoint, plan: _Plan, result: GraftResult) -> _Target:
    if options.out is not None:
        return _Target(OutputDir(Path(options.out)), "out", None, "rename")
    assert quant.source.local_root is not None  # --in-place was refused for a remote QUANT
    root = quant.source.local_root.resolve()
    if root.stat().st_dev != root.parent.stat().st_dev:
        raise GraftError(f"{root}: is a mount point; --in-place needs to build next to it: use --out")
    result.cleaned = inplace.clean_stale(root)
    before = inplace.snapshot(root)
    od = OutputDir(root, overwrite=True)
    commit = "exchange" if inplace.exchange_supported(od.path) else "files"
    if commit == "files" and (plan.drop or plan.rewrite):
        od.abort()
        raise GraftError(
            f"{root}: replacing an MTP in place needs a filesystem with atomic directory "
            "exchange (Linux renameat2); use --out"
        )
    return _Target(od, "in-place", root, commit, before)


def _write(
    target: _Target,
    options: GraftOptions,
    plan: _Plan,
    src: Checkpoint | None,
    result: GraftResult,
    verify: Callable[[Path], list[str]],
) -> None:
    od, quant = target.od, plan.quant
    plan.strays = _strays(quant, plan.weight_map)  # after the clean-up of interrupted runs
    new_shard_of: dict[str, str] = {}
    mtp_entries: dict[str, TensorEntry] = {}
    # New bytes first, into an empty directory: nothing can be written through a link to QUANT.
    if plan.add and src is not None:
        mtp_entries = {n: src.tensors[n] for n in plan.add}
        # graft puts the MTP back the way convert's keep mode writes it (the same code, so extract + graft == keep)
        keep = MODES["keep"].write(WriteContext(od, src, options.max_shard_bytes))
        if keep.names != sorted(plan.add):
            raise GraftError("internal: keep mode wrote other MTP tensors than graft planned")
        result.new_shards = keep.shards
        headers = od.shard_headers()
        for shard in result.new_shards:
            for name in headers[shard].tensors:
                new_shard_of[name] = shard
        if set(new_shard_of) != set(plan.add):
            raise GraftError("internal: the MTP shards written do not hold exactly the MTP tensors planned")
    for shard, names in sorted(plan.rewrite.items()):
        entries = [quant.tensors[n] for n in names]
        entries.sort(key=lambda e: e.start)
        od.write_shard(shard, [_copy_of(quant, e) for e in entries], quant.headers[shard].metadata or None)
        result.rewritten.append(shard)
    rewrite_index = bool(plan.add or plan.removed or plan.index_fix)
    json_files = [*plan.metadata.changed_files, INDEX_NAME] if rewrite_index else list(plan.metadata.changed_files)
    json_files.insert(0, PROVENANCE_FILE)  # graft's step added to what QUANT records
    written = set(result.new_shards) | set(plan.rewrite)
    skip = written | set(plan.drop) | set(json_files)
    carried_strays = set(plan.strays) if target.mode == "in-place" else set()  # --out leaves strays behind
    clash = sorted(written & (set(plan.link) | carried_strays))
    if clash:
        raise GraftError(
            f"{quant.label}: already has a file named {clash[0]} that is not part of the MTP "
            "being replaced; rename or remove it"
        )
    if target.mode == "in-place":
        assert target.root is not None
        inplace.mirror_tree(od, target.root, skip, link=options.link)
    else:
        for rel in quant.source.list_files():
            if rel in skip or rel in plan.strays:
                continue
            # resolve(): Linux link(2) would link a symlink itself (HF cache snapshots are relative
            # symlinks into blobs/), leaving a dangling link in OUT
            od.link_file(quant.source.local_path(rel).resolve(), rel, link=options.link)
        for s in plan.strays:
            result.warnings.append(f"{s}: not referenced by QUANT's index; not carried into OUT")
    if plan.metadata.hf_quant_config is not None:
        od.write_json(HF_QUANT_CONFIG, plan.metadata.hf_quant_config)
    if plan.metadata.config is not None:
        od.write_json("config.json", plan.metadata.config)
    step = Step("graft", options.command, source=src.source.ref() if src is not None else None, mode="keep")
    od.write_text(PROVENANCE_FILE, source_provenance(quant.source).then(step).to_bytes().decode("utf-8"))
    if INDEX_NAME in json_files:
        od.write_json(INDEX_NAME, _new_index(plan, mtp_entries, new_shard_of))
    result.linked = sorted(od.linked)
    result.copied = sorted(od.copied)
    result.dropped = sorted(plan.drop)
    result.verified_with = verify(od.path)
    if target.mode == "out":
        od.finalize(opened=True)  # verify() opened the finished directory strictly, just now
    else:
        assert target.root is not None
        if inplace.snapshot(target.root) != target.before:
            raise GraftError(f"{target.root}: changed while grafting; nothing was changed by graft, rerun it")
        if target.commit == "exchange":
            inplace.commit_exchange(od, target.root)
        else:
            inplace.commit_files(od, target.root, sorted(result.new_shards), json_files)
    result.bytes_written = od.bytes_written
    if result.copied:
        result.warnings.append(f"hard links failed for {len(result.copied)} file(s); they were copied")


def _copy_of(ckpt: Checkpoint, entry: TensorEntry) -> PlannedTensor:
    return PlannedTensor(entry.name, entry.dtype, entry.shape, lambda: ckpt.read_raw(entry))


# ---------------------------------------------------------------------------------------------- entry points


def _check_options(options: GraftOptions) -> None:
    if (options.out is None) == (not options.in_place):
        raise UsageError("give exactly one of --out OUT or --in-place")
    if options.fix_metadata and options.source is not None:
        raise UsageError("--fix-metadata takes no --from: it repairs metadata only and touches no tensor file")
    if not options.fix_metadata and options.source is None:
        raise UsageError("give --from SRC (the checkpoint that still has the MTP), or --fix-metadata")
    if options.max_shard_bytes <= 0:
        raise UsageError("--max-shard-size must be positive")


def _check_out(options: GraftOptions, quant: Checkpoint) -> None:
    if options.out is None:
        return
    out = Path(options.out).absolute()
    if os.path.lexists(out):
        raise OutputExistsError(f"{out}: output already exists; graft never overwrites (choose a new --out)")
    if quant.source.local_root is not None:
        root = quant.source.local_root.resolve()
        if out.resolve() == root or root in out.resolve().parents:
            raise GraftError(f"{out}: --out must not be inside QUANT")


def _open_quant(options: GraftOptions) -> Checkpoint:
    quant = Checkpoint.open(options.quant, revision=options.revision, token=options.token)
    if options.in_place and quant.source.local_root is None:
        raise UsageError(f"{quant.label}: --in-place needs a local QUANT directory; for a Hub repo use --out")
    return quant


def _identical_mtp(quant: Checkpoint, src: Checkpoint) -> bool:
    """Whether QUANT's MTP is SRC's, byte for byte (compared tensor by tensor; stops at the first difference)."""
    q, s = {e.name: e for e in quant.mtp_tensors()}, {e.name: e for e in src.mtp_tensors()}
    if set(q) != set(s) or any((q[n].dtype, q[n].shape) != (s[n].dtype, s[n].shape) for n in q):
        return False
    return all(quant.read_raw(q[n]) == src.read_raw(s[n]) for n in sorted(q))


def _finish(result: GraftResult, t0: float, quant: Checkpoint, src: Checkpoint | None) -> GraftResult:
    if result.action == "noop" and result.mode == "in-place":
        # an earlier run may have been killed after putting its result in place: tidy up after it
        assert quant.source.local_root is not None
        result.cleaned = inplace.clean_stale(quant.source.local_root.resolve())
    result.quant_bytes_fetched = quant.source.bytes_read
    if src is not None:
        result.src_bytes_fetched = src.source.bytes_read
    result.seconds = round(time.perf_counter() - t0, 3)
    log.info("%s", result.message)
    return result


def graft(options: GraftOptions) -> GraftResult:
    """Add SRC's MTP to QUANT (or, with ``fix_metadata``, repair QUANT's MTP metadata only).

    Raises a one-line ``MtpquantError`` (nothing written) for a lineage mismatch, an SRC without MTP,
    an existing OUT, a QUANT that is not a checkpoint, a hostile index in either, or an MTP already
    present in QUANT that differs from SRC's without ``replace``.
    """
    t0 = time.perf_counter()
    _check_options(options)
    quant = _open_quant(options)
    _check_out(options, quant)
    mode = "out" if options.out is not None else "in-place"
    hfq = quant.hf_quant_config
    weight_map = _weight_map(quant)
    plan = _Plan(quant, hfq, weight_map)
    result = GraftResult(quant.label, None, None, mode, "planned", "")
    if options.fix_metadata:
        return _finish(_fix_metadata(options, plan, result), t0, quant, None)

    assert options.source is not None
    src = Checkpoint.open(options.source, revision=options.source_revision, token=options.token)
    result.source = src.label
    src_mtp = src.mtp_tensors()
    tracked = _TrackedSource(src.source, src_mtp)
    src = dataclasses.replace(src, source=cast(CheckpointSource, tracked))
    lineage: LineageReport = check_lineage(quant, src)
    result.warnings += list(lineage.warnings)
    result.mtp_tensors, result.mtp_bytes = len(src_mtp), lineage.mtp_bytes

    existing = quant.mtp_tensors()
    if existing:
        if _identical_mtp(quant, src):
            plan.metadata = plan_metadata(
                quant.spec, hfq, quant.tensors, mtp_layers=lineage.mtp_layers, reference_config=src.config
            )
            _plan_index_fix(plan)
            if not plan.metadata.changes:
                result.action = "noop"
                result.message = (
                    f"{quant.label} already has this MTP ({len(existing)} tensors, byte-identical "
                    "to SRC's) and its metadata is complete: nothing to do, nothing written"
                )
                return _finish(result, t0, quant, src)
            return _finish(
                _metadata_only(options, plan, result, lineage.mtp_layers, "MTP already present and identical to SRC's"),
                t0,
                quant,
                src,
            )
        if not options.replace:
            raise GraftError(
                f"{quant.label}: already has an MTP ({len(existing)} mtp.* tensors) that differs from SRC's; "
                "pass --replace to replace it"
            )
        plan.removed = sorted(e.name for e in existing)
    plan.add = sorted(e.name for e in src_mtp)
    plan.mtp_layers = lineage.mtp_layers
    _plan_shards(plan, set(plan.removed))
    table: dict[str, Any] = {n: e for n, e in quant.tensors.items() if n not in set(plan.removed)}
    table.update({e.name: e for e in src_mtp})
    plan.metadata = plan_metadata(quant.spec, hfq, table, mtp_layers=lineage.mtp_layers, reference_config=src.config)
    _plan_index_fix(plan)
    result.metadata_changes = list(plan.metadata.changes)
    result.warnings += plan.metadata.warnings
    result.action = "replaced" if plan.removed else "grafted"
    if options.dry_run:
        result.action = "planned"
        result.message = (
            f"would graft {len(plan.add)} MTP tensors ({lineage.mtp_bytes} bytes) from {src.label} "
            f"into {quant.label}; link {len(plan.link)} shard(s), rewrite {len(plan.rewrite)}, "
            f"drop {len(plan.drop)}; {len(plan.metadata.changes)} metadata change(s)"
        )
        return _finish(result, t0, quant, src)

    target = _open_target(options, quant, plan, result)
    with target.od:
        _write(
            target,
            options,
            plan,
            src,
            result,
            lambda p: _verify(p, lineage.expected, tracked.hashes, lineage.mtp_layers, quant, result),
        )
    result.src_shards_downloaded = list(tracked.downloaded)
    result.destination = str(target.root if target.root is not None else target.od.final)
    result.commit = target.commit
    verb = "replaced the MTP of" if plan.removed else "grafted the MTP into"
    result.message = (
        f"{verb} {result.destination}: {len(plan.add)} tensors, {lineage.mtp_bytes} bytes in "
        f"{len(result.new_shards)} new shard(s); wrote {result.bytes_written} bytes"
    )
    return _finish(result, t0, quant, src)


def _fix_metadata(options: GraftOptions, plan: _Plan, result: GraftResult) -> GraftResult:
    quant = plan.quant
    names = [e.name for e in quant.mtp_tensors()]
    if not names:
        raise GraftError(
            f"{quant.label}: has no mtp.* tensors, so there is no MTP metadata to repair; graft one with --from SRC"
        )
    layers = mtp_layer_count(names) or quant.spec.mtp.layers
    plan.metadata = plan_metadata(quant.spec, plan.hfq, quant.tensors, mtp_layers=layers)
    _plan_index_fix(plan)
    result.warnings += plan.metadata.warnings
    result.mtp_tensors = len(names)
    result.mtp_bytes = sum(quant.tensors[n].nbytes for n in names)
    if not plan.metadata.changes:
        result.action = "noop"
        result.message = f"{quant.label}: MTP metadata is already complete; nothing written"
        return result
    if options.dry_run:
        result.metadata_changes = list(plan.metadata.changes)
        result.message = f"would change: {'; '.join(plan.metadata.changes)}"
        return result
    return _metadata_only(options, plan, result, layers, "repaired MTP metadata")


def _plan_index_fix(plan: _Plan) -> None:
    """Add the total_size correction (when QUANT's is wrong) to the metadata changes."""
    plan.index_fix = _total_size_fix(plan.quant)
    if plan.index_fix is not None:
        plan.metadata.changes.append(plan.index_fix)


def _metadata_only(options: GraftOptions, plan: _Plan, result: GraftResult, layers: int, what: str) -> GraftResult:
    """Write the JSON changes only; every tensor file is linked (--out) or left alone (--in-place)."""
    quant = plan.quant
    plan.link = sorted(set(plan.weight_map.values()))
    result.metadata_changes = list(plan.metadata.changes)
    result.warnings += [w for w in plan.metadata.warnings if w not in result.warnings]
    expected = {e.name: e.shape for e in quant.mtp_tensors()}
    target = _open_target(options, quant, plan, result)
    with target.od:
        _write(target, options, plan, None, result, lambda p: _verify(p, expected, None, layers, quant, result))
    result.action = "metadata"
    result.destination = str(target.root if target.root is not None else target.od.final)
    result.commit = target.commit
    result.message = f"{what} in {result.destination}: {'; '.join(plan.metadata.changes)}"
    return result


def fix_metadata(
    quant: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    in_place: bool = False,
    revision: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
) -> GraftResult:
    """Repair QUANT's MTP declaration and exclusions only, touching no tensor file."""
    return graft(
        GraftOptions(
            quant=quant, out=out, in_place=in_place, fix_metadata=True, revision=revision, token=token, dry_run=dry_run
        )
    )
