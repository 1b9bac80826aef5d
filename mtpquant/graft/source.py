"""graft's view of SRC: every MTP byte read is checksummed (for the write-back check), and a shard is downloaded
whole when ranged reads fail. Generic over ``CheckpointSource``: graft never needs to know where SRC lives.

A local SRC is checksummed through a memory map of its file and its bytes are then copied in the kernel
(``copy_file_range``, as ``cp`` does); a remote one is checksummed as its ranged reads arrive. Either way the
verification checksums the bytes in the written result (``checksum_extent``) against these.
"""

from __future__ import annotations

import logging
import zlib
from collections import defaultdict
from pathlib import Path

from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.source import CheckpointSource, SourceRef
from mtpquant.errors import CheckpointError
from mtpquant.hubhttp import RangeIgnoredError

__all__ = ["TrackedSource", "checksum", "checksum_extent"]

log = logging.getLogger(__name__)


class TrackedSource:
    """SRC's source, hashing every MTP tensor read and downloading a shard whole if ranged reads fail.

    Generic over ``CheckpointSource``: "download" is ``local_path``, which a local source answers with
    its own file, so graft never needs to know where SRC lives.
    """

    def __init__(self, inner: CheckpointSource, entries: list[TensorEntry]) -> None:
        self.inner = inner
        self.label = inner.label
        self.hashes: dict[str, str] = {}
        self.downloaded: list[str] = []
        self._local: dict[str, Path] = {}
        self._entries: dict[str, list[TensorEntry]] = defaultdict(list)
        for e in sorted(entries, key=lambda e: e.start):
            self._entries[e.shard].append(e)

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    @property
    def requests(self) -> int:
        return self.inner.requests

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def exists(self, relpath: str) -> bool:
        return self.inner.exists(relpath)

    def file_size(self, relpath: str) -> int:
        return self.inner.file_size(relpath)

    def local_path(self, relpath: str) -> Path:
        return self.inner.local_path(relpath)

    def plan_reads(self, relpath: str, ranges: list[tuple[int, int]]) -> None:
        self.inner.plan_reads(relpath, ranges)

    @property
    def local_root(self) -> Path | None:
        return self.inner.local_root

    def local_dir(self, ignore_patterns: list[str]) -> Path:
        return self.inner.local_dir(ignore_patterns)

    def local_extent(self, relpath: str, start: int, end: int) -> tuple[Path, int, int] | None:
        # a local file's MTP tensors are checksummed here, in the file, before the kernel copies them
        extent = self.inner.local_extent(relpath, start, end)
        if extent is not None:
            path, first, _last = extent
            for e in self._entries.get(relpath, ()):
                if e.start >= start and e.end <= end:
                    self.hashes[e.name] = checksum_extent(path, first + e.start - start, first + e.end - start)
        return extent

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
            except RangeIgnoredError as exc:
                # A server without Range support: fetch this shard only, whole.
                log.warning(
                    "%s: ranged read of %s failed (%s); downloading that shard",
                    self.label,
                    relpath,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
                path = self.inner.local_path(relpath)
                self._local[relpath] = path
                self.downloaded.append(relpath)
                data = _read_local(path, relpath, start, end)
        for e in self._entries.get(relpath, ()):
            if e.start >= start and e.end <= end:
                self.hashes[e.name] = checksum(memoryview(data)[e.start - start : e.end - start])
        return data


def checksum(data: bytes | memoryview) -> str:
    """Length + CRC-32 of tensor bytes: the write-back check guards against I/O and copy errors, not
    adversaries, and CRC-32 runs ~4x faster than sha256 here (the check would otherwise cost more than
    writing the MTP)."""
    return f"{len(data)}:{zlib.crc32(data):08x}"


_CHECKSUM_CHUNK = 1 << 20


def checksum_extent(path: Path, start: int, end: int) -> str:
    """``checksum`` of bytes ``[start, end)`` of a local file, read in 1 MiB pieces into one reused buffer (the
    bytes are never held whole)."""
    buf = memoryview(bytearray(min(_CHECKSUM_CHUNK, max(end - start, 1))))
    crc = 0
    with path.open("rb", buffering=0) as fh:
        fh.seek(start)
        offset = start
        while offset < end:
            n = fh.readinto(buf[: min(len(buf), end - offset)])
            if not n:
                raise CheckpointError(f"{path.name}: truncated: wanted bytes {start}..{end}, file ends earlier")
            crc = zlib.crc32(buf[:n], crc)
            offset += n
    return f"{end - start}:{crc:08x}"


def _read_local(path: Path, relpath: str, start: int, end: int) -> bytes:
    with path.open("rb") as fh:
        fh.seek(start)
        data = fh.read(end - start)
    if len(data) != end - start:
        raise CheckpointError(f"{relpath}: truncated: wanted bytes {start}..{end}, file ends earlier")
    return data
