"""graft's view of SRC: every MTP byte read is checksummed (for the write-back check), and a shard is downloaded
whole when ranged reads fail. Generic over ``CheckpointSource``: graft never needs to know where SRC lives.

A local SRC's MTP bytes are checksummed while they are copied (read once, through one reused buffer: the writer
shows each piece to ``copy_observer``'s function before writing it); a remote one's as its ranged reads arrive.
Either way the verification checksums the bytes in the written result (``digest.checksum_file``) against these.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from mtpquant.checkpoint.digest import Checksum, checksum
from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.source import CheckpointSource, SourceRef, read_file_range
from mtpquant.net.hub import RangeIgnoredError

__all__ = ["TrackedSource"]

log = logging.getLogger(__name__)


class TrackedSource:
    """SRC's source, hashing every MTP tensor read and downloading a shard whole if ranged reads fail.

    Generic over ``CheckpointSource``: "download" is ``local_path``, which a local source answers with
    its own file, so graft never needs to know where SRC lives.
    """

    def __init__(self, inner: CheckpointSource, entries: list[TensorEntry]) -> None:
        self.inner = inner
        self.label = inner.label
        self._hashes: dict[str, str] = {}
        self._running: dict[str, Checksum] = {}
        self.downloaded: list[str] = []
        self._local: dict[str, Path] = {}
        self._entries: dict[str, list[TensorEntry]] = defaultdict(list)
        for e in sorted(entries, key=lambda e: e.start):
            self._entries[e.shard].append(e)

    @property
    def hashes(self) -> dict[str, str]:
        """Checksum of every MTP tensor read or copied so far, by name."""
        return {**self._hashes, **{name: c.value() for name, c in self._running.items()}}

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
        return self.inner.local_extent(relpath, start, end)

    def copy_observer(self, relpath: str, start: int, end: int) -> Callable[[memoryview], None] | None:
        # a local MTP tensor is checksummed as the writer copies it (read once); anything else is not watched
        entry = next((e for e in self._entries.get(relpath, ()) if e.start == start and e.end == end), None)
        if entry is None:
            return None
        running = self._running[entry.name] = Checksum()
        return running.update

    def fingerprint(self, relpath: str) -> tuple[int, int, int, int] | None:
        return self.inner.fingerprint(relpath)

    def ref(self) -> SourceRef:
        return self.inner.ref()

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        if relpath in self._local:
            data = read_file_range(self._local[relpath], start, end, relpath)
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
                data = read_file_range(path, start, end, relpath)
        for e in self._entries.get(relpath, ()):
            if e.start >= start and e.end <= end:
                self._hashes[e.name] = checksum(memoryview(data)[e.start - start : e.end - start])
        return data
