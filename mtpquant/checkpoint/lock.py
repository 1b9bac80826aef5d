"""One run per output: an advisory ``flock`` on ``.<name>.mtpquant-lock`` beside the directory a run writes.

Every ``OutputDir`` takes the lock of its destination before it looks at leftovers of earlier runs,
so a second convert (or graft) on the same OUT refuses at its start, naming the first one's pid,
and can never mistake the live run's temporary directory for a leftover. The kernel drops the
lock when its process dies, however it dies, so a killed run never blocks the next one. The lock
file is removed when the lock is released; a run that opened it just before checks after locking
that the name still leads to the file it locked, and starts over if not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from types import TracebackType

from mtpquant.errors import OutputBusyError

__all__ = ["LOCK_SUFFIX", "OutputLock", "lock_path"]

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".mtpquant-lock"


def lock_path(final: Path) -> Path:
    """The lock file of an output directory."""
    final = Path(final).absolute()
    return final.parent / f".{final.name}{LOCK_SUFFIX}"


class OutputLock:
    """The exclusive lock of one output path, held by this process until ``release``."""

    def __init__(self, final: Path | str) -> None:
        self.final = Path(final).absolute()
        self.path = lock_path(self.final)
        self._fd: int | None = None

    @classmethod
    def acquire(cls, final: Path | str) -> OutputLock:
        """Take the lock now, or raise ``OutputBusyError`` naming the live run that holds it."""
        lock = cls(final)
        lock._acquire()
        return lock

    def _acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise OutputBusyError(
                    f"{self.final}: another mtpquant run ({self._holder()}) is writing it; wait for it to "
                    "finish or stop it"
                ) from None
            try:
                same = os.fstat(fd).st_ino == self.path.stat().st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file between our open and our lock: take the new one
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:  # a disk too full for a pid: the lock still holds, the file just names no holder
            log.debug("%s: could not record the pid", self.path)
        self._fd = fd

    def _holder(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.path.read_text().strip())
            return f"pid {pid}"
        return "pid unknown"

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
