"""Writing a changed quant the graft way: only the new bytes are written, everything else is linked, and the
result is verified where it was built before it is put in place.

``open_destination`` takes the destination (``--out``: a new directory; ``--in-place``: QUANT itself, locked, its
interrupted runs cleaned, snapshotted); ``build`` writes the new MTP shards first (into an empty directory, so
nothing can be written through a link to QUANT), rewrites the shards that lose tensors, links or mirrors every other
file, writes the small files (provenance, metadata, a rewritten recipe, index) and runs the verification; ``commit``
puts the verified result in place (a rename for ``--out``; an atomic directory exchange, or new files then the small
ones for ``--in-place``, see ``graft.inplace``). graft writes SRC's MTP through convert's keep mode; heal writes its
healed MTP, in QUANT's own precision, through the same steps. QUANT's validation report (``validation/``) is not
carried: it measured QUANT before the change, and a report describes the checkpoint it sits in.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mtpquant.checkpoint.dtypes import planned_copy
from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.lock import OutputLock
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.errors import GraftError
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.records.provenance import PROVENANCE_FILE, Step, source_provenance
from mtpquant.records.validation import REPORT_DIR
from mtpquant.surgery import inplace
from mtpquant.surgery.plan import Plan, new_index, strays

__all__ = ["Built", "Destination", "NewMtp", "Verified", "WriteLog", "build", "commit", "open_destination"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WriteLog:
    """What writing the change did (``commit`` returns it): the part of graft's and heal's results about the write."""

    bytes_written: int = 0
    new_shards: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    cleaned: list[str] = field(default_factory=list)  # what interrupted runs left and the opening removed
    warnings: list[str] = field(default_factory=list)
    verified_with: list[str] = field(default_factory=list)
    commit: str | None = None  # "rename" (--out) | "exchange" | "files" (--in-place)


@dataclass(frozen=True)
class Verified:
    """What a verification of the built result established: the checks it passed, and what it warns of."""

    checks: tuple[str, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Destination:
    """Where the result is built (``od``) and how it is put in place; ``open_destination`` makes one."""

    od: OutputDir
    mode: str  # "out" | "in-place"
    root: Path | None  # QUANT's directory for in-place
    commit: str  # "rename" | "exchange" | "files"
    before: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)
    cleaned: tuple[str, ...] = ()  # what interrupted runs left and the opening removed

    @property
    def path(self) -> Path:
        """The directory that holds the result once it is committed."""
        return self.root if self.root is not None else self.od.final


@dataclass(frozen=True)
class NewMtp:
    """The MTP tensors to write as new shards: their names, and the function that writes them into a directory
    (returning the shard names)."""

    names: tuple[str, ...]
    write: Callable[[OutputDir], list[str]]


@dataclass(frozen=True)
class Built:
    """What ``build`` wrote and checked in the destination's temporary directory; ``commit`` puts it in place."""

    new_shards: tuple[str, ...]
    rewritten: tuple[str, ...]
    dropped: tuple[str, ...]
    json_files: tuple[str, ...]  # the small files written (the in-place commit without an exchange needs them)
    verified: Verified
    warnings: tuple[str, ...]


def open_destination(quant: Checkpoint, out: Path | None, *, replaces: bool) -> Destination:
    """The destination, opened: ``out`` (must not exist), else QUANT itself (``replaces``: the change drops or
    rewrites a shard, which in place needs an atomic directory exchange)."""
    if out is not None:
        return Destination(OutputDir(out), "out", None, "rename")
    assert quant.source.local_root is not None  # --in-place was refused for a remote QUANT
    root = quant.source.local_root.resolve()
    if root.stat().st_dev != root.parent.stat().st_dev:
        raise GraftError(f"{root}: is a mount point; --in-place needs to build next to it: use --out")
    lock = OutputLock.acquire(root)  # before the clean-up: a live run's temp directory is never a leftover
    try:
        cleaned = inplace.clean_stale(root)
        before = inplace.snapshot(root)
    except BaseException:
        lock.release()
        raise
    od = OutputDir(root, overwrite=True, lock=lock)
    mode = "exchange" if inplace.exchange_supported(od.path) else "files"
    if mode == "files" and replaces:
        od.abort()
        raise GraftError(
            f"{root}: replacing an MTP in place needs a filesystem with atomic directory "
            "exchange (Linux renameat2); use --out"
        )
    return Destination(od, "in-place", root, mode, before, tuple(cleaned))


def build(
    dest: Destination,
    plan: Plan,
    new_mtp: NewMtp | None,
    step: Step,
    verify: Callable[[Path], Verified],
    *,
    link: bool = True,
    skip: frozenset[str] = frozenset(),
    texts: Mapping[str, str] | None = None,
    blobs: Mapping[str, bytes] | None = None,
) -> Built:
    """Build the changed quant in ``dest``'s temporary directory and verify it. ``step`` is added to QUANT's
    provenance; ``skip`` names files not carried over; ``texts`` are files of QUANT written with new text
    (``relpath -> text``), ``blobs`` files written with new bytes (a report's plots)."""
    texts = {**(texts or {})}
    blobs = blobs or {}
    od, quant = dest.od, plan.quant
    stray = strays(quant, plan.weight_map)  # after the clean-up of interrupted runs
    warnings: list[str] = []
    new_shards: list[str] = []
    new_shard_of: dict[str, str] = {}
    mtp_entries: dict[str, TensorEntry] = {}
    # New bytes first, into an empty directory: nothing can be written through a link to QUANT.
    if plan.add and new_mtp is not None:
        if sorted(new_mtp.names) != sorted(plan.add):
            raise GraftError("internal: the new MTP holds other tensors than planned")
        new_shards = new_mtp.write(od)
        headers = od.shard_headers()
        for shard in new_shards:
            for name, entry in headers[shard].tensors.items():
                new_shard_of[name] = shard
                mtp_entries[name] = entry
        if set(new_shard_of) != set(plan.add):
            raise GraftError("internal: the MTP shards written do not hold exactly the MTP tensors planned")
    for name, entry in sorted(plan.adopted.items()):  # an MTP shard the index forgot: indexed, linked as it is
        new_shard_of[name] = entry.shard
        mtp_entries[name] = entry
    stray = [s for s in stray if s not in set(new_shard_of.values())]  # an adopted shard is QUANT's, not a stray
    for shard, names in sorted(plan.rewrite.items()):
        entries = [quant.tensors[n] for n in names]
        entries.sort(key=lambda e: e.start)
        od.write_shard(shard, [planned_copy(quant, e) for e in entries], quant.headers[shard].metadata or None)
    rewrite_index = bool(plan.add or plan.removed or plan.index_fix or plan.lost or plan.adopted)
    json_files = [*plan.metadata.changed_files, INDEX_NAME] if rewrite_index else list(plan.metadata.changed_files)
    json_files[:0] = [PROVENANCE_FILE, *sorted({*texts, *blobs})]  # this step added to what QUANT records; new files
    written = set(new_shards) | set(plan.rewrite)
    skipped = written | set(plan.drop) | set(json_files) | set(skip)
    carried_strays = set(stray) if dest.mode == "in-place" else set()  # --out leaves strays behind
    clash = sorted(written & (set(plan.link) | carried_strays))
    if clash:
        raise GraftError(
            f"{quant.label}: already has a file named {clash[0]} that is not part of the MTP "
            "being replaced; rename or remove it"
        )
    report = _stale_report(dest, quant)
    if report:
        warnings.append(
            f"{REPORT_DIR}/: {report}: its report measured QUANT before this {step.tool} (validate the result for a "
            "report on it)"
        )
    if dest.mode == "in-place":
        assert dest.root is not None
        inplace.mirror_tree(od, dest.root, skipped, link=link, prune=(REPORT_DIR,))
    else:
        for rel in quant.source.list_files():
            if rel in skipped or rel in stray or rel.startswith(f"{REPORT_DIR}/"):
                continue
            # resolve(): Linux link(2) would link a symlink itself (HF cache snapshots are relative
            # symlinks into blobs/), leaving a dangling link in OUT
            od.link_file(quant.source.local_path(rel).resolve(), rel, link=link)
        warnings += [f"{s}: not referenced by QUANT's index; not carried into OUT" for s in stray]
    if plan.metadata.hf_quant_config is not None:
        od.write_json(HF_QUANT_CONFIG, plan.metadata.hf_quant_config)
    if plan.metadata.config is not None:
        od.write_json("config.json", plan.metadata.config)
    od.write_text(PROVENANCE_FILE, source_provenance(quant.source).then(step).to_bytes().decode("utf-8"))
    for rel, text in sorted(texts.items()):
        od.write_text(rel, text)
    for rel, data in sorted(blobs.items()):
        od.write_bytes(rel, data)
    if INDEX_NAME in json_files:
        od.write_json(INDEX_NAME, new_index(plan, mtp_entries, new_shard_of))
    verified = verify(od.path)
    return Built(
        tuple(new_shards), tuple(sorted(plan.rewrite)), tuple(sorted(plan.drop)), tuple(json_files), verified,
        tuple(warnings),
    )


def _stale_report(dest: Destination, quant: Checkpoint) -> str:
    """What becomes of QUANT's validation report (``""``: it has none): left out of OUT, or removed in place."""
    if dest.mode == "in-place":
        assert dest.root is not None
        return "removed" if (dest.root / REPORT_DIR).is_dir() else ""
    has = any(rel.startswith(f"{REPORT_DIR}/") for rel in quant.source.list_files())
    return "not carried over" if has else ""


def commit(dest: Destination, built: Built, *, what: str = "grafting") -> WriteLog:
    """Put the verified result in place (``--out``: rename; ``--in-place``: exchange, or new files then JSON) and
    say what the write did."""
    od = dest.od
    if dest.mode == "out":
        od.finalize(opened=True)  # the verification opened the finished directory strictly, just now
    else:
        assert dest.root is not None
        if inplace.snapshot(dest.root) != dest.before:
            raise GraftError(f"{dest.root}: changed while {what}; nothing was changed, rerun it")
        if dest.commit == "exchange":
            inplace.commit_exchange(od, dest.root)
        else:
            inplace.commit_files(od, dest.root, sorted(built.new_shards), list(built.json_files))
            # the change is in place: QUANT's report now describes a checkpoint that is gone (the exchange left it
            # out of the mirror; without one it is removed after the commit, so a kill never loses a current one)
            shutil.rmtree(dest.root / REPORT_DIR, ignore_errors=True)
    copied = sorted(od.copied)
    warnings = [*built.warnings, *built.verified.warnings]
    if copied:
        warnings.append(f"hard links failed for {len(copied)} file(s); they were copied")
    return WriteLog(
        bytes_written=od.bytes_written,
        new_shards=list(built.new_shards),
        linked=sorted(od.linked),
        copied=copied,
        rewritten=list(built.rewritten),
        dropped=list(built.dropped),
        cleaned=list(dest.cleaned),
        warnings=warnings,
        verified_with=list(built.verified.checks),
        commit=dest.commit,
    )
