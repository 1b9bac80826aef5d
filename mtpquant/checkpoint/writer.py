"""Every output checkpoint is built here: temp sibling directory, byte-budget shards, atomic JSON (on the primitives
of ``filesystem.py``).

An output is built in ``.<name>.mtpquant-partial-<id>/`` next to its destination and renamed into
place by ``finalize`` once every header re-opens and the index checks out; nothing that looks like
a finished checkpoint exists before that. While it is built, the run holds the destination's lock
(``checkpoint.lock``): a second run on the same destination refuses at its start. Shards are
streamed: the header is computed from the plan, then tensor bytes are written one tensor at a
time, so memory stays at one tensor.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from mtpquant.checkpoint import filesystem  # write_data looked up at each call: a test patches the one seam
from mtpquant.checkpoint.filesystem import (
    SPACE_ERRNOS,
    atomic_write_bytes,
    exchange_dirs,
    fsync_dir,
    fsync_file,
    out_of_space,
    replace_atomically,
    space_error,
)
from mtpquant.checkpoint.header import ShardHeader, tensor_nbytes
from mtpquant.checkpoint.index import INDEX_NAME, build_index, check_shard_name
from mtpquant.checkpoint.lock import OutputLock
from mtpquant.checkpoint.source import LocalSource, file_pieces
from mtpquant.errors import CheckpointError, FilesystemError, MtpquantError, OutputExistsError

__all__ = [
    "ASIDE_MARK",
    "DEFAULT_MAX_SHARD_BYTES",
    "PARTIAL_MARK",
    "OutputDir",
    "PlannedTensor",
    "atomic_write_safetensors",
    "find_stale_partials",
    "plan_shards",
    "write_safetensors",
]

log = logging.getLogger(__name__)

# The byte budget of one output shard unless a recipe or --max-shard-size says otherwise (convert, graft, heal).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

PARTIAL_MARK = ".mtpquant-partial-"
ASIDE_MARK = ".mtpquant-old-"  # an old output renamed aside by a replacement where exchange is unsupported
_OWNER_FILE = ".mtpquant-owner"


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its header facts plus a callable that produces its bytes when needed."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], bytes]
    # Where the bytes already lie on a local disk (file, start, end): copied in the kernel instead.
    source: tuple[Path, int, int] | None = None
    # Where the bytes are read from (file, offset): a shard's tensors are produced in this order, each
    # written at its own offset, so a remote source is read front to back (one merged request per span).
    read_order: tuple[str, int] | None = None
    # With ``source``: sees every piece of the bytes as they are copied (through one reused buffer, not in the
    # kernel), e.g. a checksum computed while writing.
    observe: Callable[[memoryview], None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return tensor_nbytes(self.dtype, self.shape)


_COPY_CHUNK = 64 * 1024 * 1024


def _copy_observed(fh: Any, src: Path, start: int, end: int, observe: Callable[[memoryview], None]) -> None:
    for piece in file_pieces(src, start, end, src.name):
        observe(piece)
        filesystem.write_data(fh, piece)


def _copy_range(
    fh: Any, src: Path, start: int, end: int, observe: Callable[[memoryview], None] | None = None
) -> None:
    """Append bytes ``[start, end)`` of ``src`` to ``fh``: ``os.copy_file_range`` (no copy through
    Python, what ``cp`` does), falling back to chunked reads through ``filesystem.write_data`` where unsupported; with
    ``observe``, through one reused buffer, each piece shown to ``observe`` before it is written."""
    if observe is not None:
        _copy_observed(fh, src, start, end, observe)
        return
    fh.flush()
    with src.open("rb") as s:
        offset = start
        if hasattr(os, "copy_file_range"):
            try:
                while offset < end:
                    n = os.copy_file_range(s.fileno(), fh.fileno(), min(end - offset, _COPY_CHUNK), offset)
                    if n == 0:
                        raise CheckpointError(f"{src.name}: truncated: wanted bytes {start}..{end}, file ends earlier")
                    offset += n
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                    raise
            fh.seek(0, os.SEEK_END)  # the kernel moved the file offset; resync the buffered writer
        s.seek(offset)
        while offset < end:
            data = s.read(min(end - offset, _COPY_CHUNK))
            if not data:
                raise CheckpointError(f"{src.name}: truncated: wanted bytes {start}..{end}, file ends earlier")
            filesystem.write_data(fh, data)
            offset += len(data)


def write_safetensors(path: Path, tensors: Iterable[PlannedTensor], metadata: Mapping[str, str] | None = None) -> None:
    """Stream a safetensors file: header from the plan, then each tensor's bytes in order."""
    plan = list(tensors)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in plan:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    with path.open("wb") as fh:
        filesystem.write_data(fh, struct.pack("<Q", len(raw)) + raw)
        if any(t.read_order is not None for t in plan):
            # produce in source order, each at its offset: the file comes out the same, read front to back
            offsets = {t.name: header[t.name]["data_offsets"][0] for t in plan}
            for t in sorted(plan, key=lambda t: t.read_order or ("", 0)):
                data = t.produce()
                if len(data) != t.nbytes:
                    raise CheckpointError(
                        f"{path.name}: tensor {t.name!r} produced {len(data)} bytes, expected {t.nbytes}"
                    )
                fh.seek(base + offsets[t.name])
                filesystem.write_data(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
            return
        for t in plan:
            if t.source is not None:
                src, start, end = t.source
                if end - start != t.nbytes:
                    raise CheckpointError(
                        f"{path.name}: tensor {t.name!r} source holds {end - start} bytes, expected {t.nbytes}"
                    )
                _copy_range(fh, src, start, end, t.observe)
                continue
            data = t.produce()
            if len(data) != t.nbytes:
                raise CheckpointError(f"{path.name}: tensor {t.name!r} produced {len(data)} bytes, expected {t.nbytes}")
            filesystem.write_data(fh, data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_safetensors(
    path: Path, tensors: Iterable[PlannedTensor], metadata: Mapping[str, str] | None = None
) -> None:
    """A standalone safetensors file via temp file + fsync + ``os.replace`` + directory fsync."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda tmp: write_safetensors(tmp, tensors, metadata))


def plan_shards(tensors: Iterable[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy split into shards under a byte budget, keeping order; an oversized tensor goes alone."""
    shards: list[list[PlannedTensor]] = []
    current: list[PlannedTensor] = []
    size = 0
    for t in tensors:
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def find_stale_partials(final: Path) -> list[Path]:
    """Leftover temp dirs of earlier runs for ``final`` whose owning process is gone."""
    stale = []
    for p in final.parent.glob(f".{final.name}{PARTIAL_MARK}*"):
        owner = p / _OWNER_FILE
        try:
            pid = int(owner.read_text().strip())
        except (OSError, ValueError):
            pid = -1
        if pid <= 0 or not _pid_alive(pid):
            stale.append(p)
    return sorted(stale)


def _recover_aside(final: Path) -> None:
    """After a kill inside a replacement without exchange: put the old output back if nothing is at ``final``, and
    remove any other old tree left aside. The caller holds ``final``'s lock."""
    asides = sorted(final.parent.glob(f".{final.name}{ASIDE_MARK}*"), key=lambda p: p.stat().st_mtime_ns)
    if asides and not os.path.lexists(final):
        back = asides.pop()
        log.warning("putting back %s, moved aside by a replacement that was interrupted", final)
        os.replace(back, final)
        fsync_dir(final.parent)
    for aside in asides:
        log.warning("removing the old output left aside by an interrupted replacement: %s", aside)
        shutil.rmtree(aside, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _naming(od: OutputDir, relname: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        target = od.final / relname
        if exc.errno in SPACE_ERRNOS:
            raise space_error(target, od.path, od.doing) from None
        raise FilesystemError(f"{target}: {exc.strerror or exc} (writing it; nothing was put in place)") from None


class OutputDir:
    """A checkpoint being built in a temp sibling directory of ``final``.

    ``overwrite``: an existing ``final`` may be replaced, after ``replace_check(final)`` (if given) accepts what is
    there, at the start and again just before the replacement (``convert --overwrite`` replaces only a checkpoint
    mtpquant wrote). Without ``overwrite`` an existing ``final`` is refused, by ``replace_check`` first (so the
    error suggests ``--overwrite`` only where it would work). The replacement is one atomic exchange of the two
    directories (Linux ``renameat2``), so a kill leaves the old ``final`` or the new one; the old tree, left under
    the temp name, is removed, or by the next run if a kill comes first. Where the filesystem cannot exchange, the
    old tree is renamed aside first (``.<name>.mtpquant-old-<id>``) and the next run for ``final`` puts it back if a
    kill left no ``final``.
    """

    def __init__(
        self,
        final: Path | str,
        *,
        overwrite: bool = False,
        lock: OutputLock | None = None,
        replace_check: Callable[[Path], None] | None = None,
    ) -> None:
        """``lock``: the destination's lock, already taken by the caller (it passes to this object)."""
        self.final = Path(final).absolute()
        self.overwrite = overwrite
        self.replace_check = replace_check
        self.final.parent.mkdir(parents=True, exist_ok=True)
        # first the lock: from here on no other live run writes this destination
        self._lock = lock if lock is not None else OutputLock.acquire(self.final)
        try:
            _recover_aside(self.final)
            if os.path.lexists(self.final):
                if replace_check is not None:  # what --overwrite would refuse is refused so, with or without it
                    replace_check(self.final)
                if not overwrite:
                    raise OutputExistsError(f"{self.final}: output already exists (use --overwrite to replace it)")
            for stale in find_stale_partials(self.final):
                log.warning("removing leftover temporary directory of an interrupted run: %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
            self.path = self.final.parent / f".{self.final.name}{PARTIAL_MARK}{uuid.uuid4().hex[:12]}"
            self.path.mkdir()
            try:
                (self.path / _OWNER_FILE).write_text(str(os.getpid()))
            except BaseException:
                shutil.rmtree(self.path, ignore_errors=True)  # a disk too full for a few bytes: nothing left behind
                raise
        except OSError as exc:
            self._lock.release()
            if exc.errno in SPACE_ERRNOS:
                raise space_error(self.final, self.final.parent) from None
            raise
        except BaseException:
            self._lock.release()
            raise
        self.doing = ""  # what the run is doing with it (a step name for messages), set by the caller
        self.linked: list[str] = []
        self.copied: list[str] = []
        self.bytes_written = 0
        self._done = False
        self._synced: set[str] = set()  # files whose bytes this object wrote and fsynced (or hard-linked)

    # ---- context management -------------------------------------------------------------------
    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._done:
            return
        full = ev is not None and not isinstance(ev, MtpquantError) and out_of_space(ev, self.path)
        error = space_error(self.final, self.path, self.doing) if full else None  # (free space before the clean-up)
        self.abort()
        if error is not None:  # a library's own words for a full disk (modelopt's export, torch.save): one line
            raise error from None

    def _writing(self, relname: str) -> contextlib.AbstractContextManager[None]:
        """Errors writing ``relname`` name the file being written (never the file it is copied from)."""
        return _naming(self, relname)

    def abort(self) -> None:
        """Remove the temp directory; the destination is untouched."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._done = True
        self._lock.release()

    # ---- writing ------------------------------------------------------------------------------
    def _target(self, relname: str) -> Path:
        if relname.endswith(".safetensors"):
            check_shard_name(relname, where=str(self.final))
        p = (self.path / relname).resolve()
        if self.path.resolve() not in p.parents:
            raise CheckpointError(f"{relname}: refusing to write outside the output directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write_shard(
        self, relname: str, tensors: Iterable[PlannedTensor], metadata: Mapping[str, str] | None = None
    ) -> None:
        """Write one safetensors shard (streamed)."""
        target = self._target(relname)
        with self._writing(relname):
            write_safetensors(target, tensors, metadata)  # fsyncs it
        self._synced.add(relname)
        self.bytes_written += target.stat().st_size

    def write_shards(
        self,
        tensors: Iterable[PlannedTensor],
        *,
        max_bytes: int,
        pattern: str = "model-{index:05d}-of-{count:05d}.safetensors",
        metadata: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Split ``tensors`` under the byte budget and write them; returns the shard names."""
        groups = plan_shards(tensors, max_bytes)
        names = [pattern.format(index=i + 1, count=len(groups)) for i in range(len(groups))]
        for name, group in zip(names, groups):
            self.write_shard(name, group, metadata)
        return names

    def adopt_file(self, src: Path, relname: str) -> str:
        """Move a file that already lies inside the temp directory (an exported shard) to ``relname``.

        A rename: no byte is written again. Its mode becomes what a file this process creates gets
        (the umask's), whatever the writer chose (modelopt writes 0600). Returns the relative name.
        """
        src = Path(src).resolve()
        if self.path.resolve() not in src.parents:
            raise CheckpointError(f"{src}: only files inside the output's temporary directory can be moved into it")
        target = self._target(relname)
        if target != src:
            os.replace(src, target)
        umask = os.umask(0)
        os.umask(umask)
        target.chmod(0o666 & ~umask)
        with self._writing(relname):
            fsync_file(target)  # written by a library that may not have flushed it: durable before the rename
        self._synced.add(relname)
        return relname

    def write_json(self, relname: str, obj: Any) -> None:
        """Atomic JSON file (replacing, never writing through, a file linked from elsewhere; the temp directory's
        entries are fsynced once, when it is committed)."""
        data = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        with self._writing(relname):
            atomic_write_bytes(self._target(relname), data, sync_dir=False)  # fsyncs it
        self._synced.add(relname)
        self.bytes_written += len(data)

    def write_text(self, relname: str, text: str) -> None:
        """Atomic text file (as ``write_json``)."""
        self.write_bytes(relname, text.encode("utf-8"))

    def write_bytes(self, relname: str, data: bytes) -> None:
        """Atomic file of ``data`` (as ``write_json``)."""
        with self._writing(relname):
            atomic_write_bytes(self._target(relname), data, sync_dir=False)  # fsyncs it
        self._synced.add(relname)
        self.bytes_written += len(data)

    def link_file(self, src: Path, relname: str | None = None, *, link: bool = True) -> str:
        """Hard-link ``src`` into the output (fallback: copy); returns the relative name."""
        relname = relname or src.name
        target = self._target(relname)
        src = src.resolve()  # os.link would link a symlink itself (HF cache snapshots are symlinks)
        if link:
            try:
                os.link(src, target)
                self.linked.append(relname)
                self._synced.add(relname)  # the source's own bytes: nothing new to flush
                return relname
            except OSError as exc:
                log.info("hard link of %s failed (%s); copying", src, exc.strerror)
        with self._writing(relname):
            shutil.copyfile(src, target)
            fsync_file(target)
        self._synced.add(relname)
        self.copied.append(relname)
        self.bytes_written += target.stat().st_size
        return relname

    # ---- finishing ----------------------------------------------------------------------------
    def _sync_tree(self) -> None:
        """Every file a library wrote into the temp directory (and not yet fsynced here) is fsynced, then every
        directory of it: after a crash the renamed output holds the bytes it was verified with."""
        dirs = [self.path]
        for dirpath, dirnames, filenames in os.walk(self.path):
            base = Path(dirpath)
            dirs += [base / d for d in dirnames]
            for name in filenames:
                rel = (base / name).relative_to(self.path).as_posix()
                if rel not in self._synced and not (base / name).is_symlink():
                    with self._writing(rel):
                        fsync_file(base / name)
        for d in reversed(dirs):
            fsync_dir(d)

    def shard_headers(self) -> dict[str, ShardHeader]:
        """Re-read every shard header in the temp directory."""
        from mtpquant.checkpoint.table import read_shard_header

        source = LocalSource(self.path)
        return {
            f: read_shard_header(source, f) for f in source.list_files() if f.endswith(".safetensors") and "/" not in f
        }

    def write_index(self, extra_metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Build the index from the shards actually on disk and write it."""
        index = build_index(self.shard_headers(), extra_metadata)
        self.write_json(INDEX_NAME, index)
        return index

    def finalize(
        self, verify: Callable[[Path], None] | None = None, *, opened: bool = False, checkpoint: bool = True
    ) -> Path:
        """Verify the temp directory (headers, index, ``verify``) and rename it into place.

        ``opened``: the caller has just opened the finished temp directory with
        ``Checkpoint.open(strict=True)`` itself (as its own verification) and written nothing since,
        so that open is not repeated here. ``checkpoint=False``: the directory is not a checkpoint (a validation
        report), so there are no headers or index to check.
        """
        from mtpquant.checkpoint.table import Checkpoint

        if checkpoint and not opened:
            Checkpoint.open(self.path, strict=True)
        if verify is not None:
            verify(self.path)
        (self.path / _OWNER_FILE).unlink(missing_ok=True)
        self._sync_tree()
        old: Path | None = None
        if os.path.lexists(self.final):
            if not self.overwrite:
                raise OutputExistsError(f"{self.final}: output appeared while converting; not replacing it")
            if self.replace_check is not None:
                self.replace_check(self.final)  # what is there now, under the lock
            if exchange_dirs(self.path, self.final):
                old = self.path  # the old tree, under the temp name: without an owner, a leftover the next run removes
            else:
                old = self.final.parent / f".{self.final.name}{ASIDE_MARK}{uuid.uuid4().hex[:8]}"
                os.replace(self.final, old)
                os.replace(self.path, self.final)
        else:
            os.replace(self.path, self.final)
        fsync_dir(self.final.parent)
        self._done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._lock.release()
        log.info("wrote %s", self.final)
        return self.final
