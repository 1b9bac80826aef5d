"""The filesystem primitives every output relies on: atomic file writes and directory exchange, fsync, and telling
a full disk from other write failures (in one line naming the filesystem and what is left on it).

Every byte mtpquant writes goes through ``write_data`` (one seam for fault-injection tests); ``writer.py`` builds
checkpoints on top of these.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpquant.errors import FilesystemError

__all__ = [
    "SPACE_ERRNOS",
    "atomic_write_bytes",
    "atomic_write_json",
    "exchange_dirs",
    "fsync_dir",
    "fsync_file",
    "json_bytes",
    "mount_point",
    "out_of_space",
    "replace_atomically",
    "space_error",
    "write_data",
]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EPERM}


def exchange_dirs(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a))


def fsync_file(path: Path) -> None:
    """fsync a file's bytes (one a library wrote, which may not have flushed it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory so renames in it survive a crash (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How libraries word running out of space when they do not raise OSError: safetensors ("I/O error: No space left on
# device (os error 28)"), and torch.save, which loses the cause ("PytorchStreamWriter failed writing file ...",
# "[enforce fail at inline_container.cc] unexpected pos"): those count only when the filesystem is in fact full.
_SPACE_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
_WRITE_FAILURE_TEXTS = ("PytorchStreamWriter failed writing", "inline_container.cc", "file write failed")
_NEARLY_FULL = 64 * 1024 * 1024


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (the nearest existing directory on its way up)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    dev = p.stat().st_dev
    while p != p.parent and p.parent.stat().st_dev == dev:
        p = p.parent
    return p


def out_of_space(exc: BaseException, where: Path) -> bool:
    """Whether ``exc`` (or what caused it) is the filesystem of ``where`` running out of space or quota, however the
    library that wrote says so."""
    seen: BaseException | None = exc
    texts = []
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in SPACE_ERRNOS:
            return True
        texts.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    text = " ".join(texts)
    if any(t in text for t in _SPACE_TEXTS):
        return True
    if any(t in text for t in _WRITE_FAILURE_TEXTS):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(mount_point(where)).free < _NEARLY_FULL
    return False


def space_error(target: Path, where: Path, doing: str = "") -> FilesystemError:
    """The one line for running out of space writing ``target``: the filesystem (its mount point) and what is left."""
    from mtpquant.units import format_bytes

    mount = mount_point(where)
    try:
        free = f", {format_bytes(shutil.disk_usage(mount).free)} free"
    except OSError:
        free = ""
    during = f" while {doing}" if doing else ""
    return FilesystemError(
        f"{target}: No space left on device (the filesystem mounted at {mount}{free}){during}; nothing was put in place"
    )


def write_data(fh: Any, data: bytes | memoryview) -> None:
    """Every byte mtpquant writes goes through here (one seam for fault-injection tests)."""
    fh.write(data)


def replace_atomically(path: Path, fill: Callable[[Path], None], *, sync_dir: bool = True) -> None:
    """``fill`` writes (and fsyncs) a temp file beside ``path``, which then replaces ``path`` and the directory is
    fsynced (unless ``sync_dir`` is False: a staging directory fsynced once when it is committed); a crash or an
    error leaves the old file or none, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write a file via temp file + fsync + ``os.replace``; a crash leaves the old file or none."""

    def fill(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            write_data(fh, data)
            fh.flush()
            os.fsync(fh.fileno())

    replace_atomically(path, fill, sync_dir=sync_dir)


def json_bytes(obj: Any) -> bytes:
    """``obj`` as indented UTF-8 JSON with a trailing newline; strict JSON (a NaN or an infinity is a ValueError,
    never the bare ``NaN`` other readers refuse)."""
    return (json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (``json_bytes``)."""
    atomic_write_bytes(path, json_bytes(obj))
