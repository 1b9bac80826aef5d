"""Changing a checkpoint directory in place so that a kill at any moment leaves it old or new, never mixed.

The new version is built as a mirror of the directory in an ``OutputDir`` temp sibling: every
file it keeps is hard-linked (the same inode, so untouched shards are never rewritten), new files
are written there, and the result is verified there. Then one of two commits puts it in place:

- ``exchange`` (Linux ``renameat2(RENAME_EXCHANGE)``): the mirror and the directory swap names in
  one atomic step. Before it, the directory is exactly as it was; after it, exactly as planned. The
  old tree, now in the temp sibling, is removed; if a kill leaves it, the next ``OutputDir`` for the
  same directory removes it (it has no live owner).
- ``files`` (where the filesystem cannot exchange): new files are renamed into the directory
  first, then the JSON files are replaced atomically, the index last of all. The directory never
  references a missing file; a kill before the JSON step leaves it as it was plus new files the
  index does not reference, which the journal in the temp sibling lets the next run remove. A
  kill between the JSON replacements leaves it loadable with part of the new metadata; rerunning
  the command completes it. Removing or rewriting files needs ``exchange``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from mtpquant.checkpoint.filesystem import exchange_dirs, fsync_dir
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.writer import OutputDir, find_stale_partials

__all__ = [
    "JOURNAL",
    "clean_interrupted",
    "clean_stale",
    "commit_exchange",
    "commit_files",
    "exchange_supported",
    "mirror_tree",
    "snapshot",
]

log = logging.getLogger(__name__)

JOURNAL = ".mtpquant-graft-journal.json"
# OutputDir's marker of a live temp directory (mtpquant.checkpoint.writer._OWNER_FILE); the mirror
# must not carry it into the directory it replaces.
_OWNER_FILE = ".mtpquant-owner"


def exchange_supported(scratch: Path) -> bool:
    """Whether the filesystem of ``scratch`` (a directory we own) can exchange two directories."""
    a, b = scratch / ".exchange-probe-a", scratch / ".exchange-probe-b"
    try:
        a.mkdir()
        b.mkdir()
        return exchange_dirs(a, b)
    except OSError:
        return False
    finally:
        for p in (a, b):
            with contextlib.suppress(OSError):
                p.rmdir()


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime_ns) of every entry under ``root``: detects changes made behind our back."""
    out: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[p.relative_to(root).as_posix()] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def mirror_tree(
    od: OutputDir, root: Path, skip: Iterable[str], *, link: bool = True, prune: Iterable[str] = ()
) -> None:
    """Recreate everything under ``root`` in ``od`` (hard links; symlinks as symlinks), except ``skip`` (files) and
    ``prune`` (directories, with everything in them).

    Hidden files count too: this is the whole directory as the user has it. Files already present
    in ``od`` (written before the mirror, on purpose, so a link can never be written through) are an
    error rather than overwritten.
    """
    skip, pruned = set(skip), set(prune)
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        rel_dir = base.relative_to(root)
        dirnames[:] = [d for d in dirnames if (rel_dir / d).as_posix() not in pruned]
        for name in sorted(dirnames):
            src = base / name
            if src.is_symlink():  # os.walk lists symlinks to directories as directories
                filenames.append(name)
                continue
            (od.path / rel_dir / name).mkdir(exist_ok=True)
        dirnames[:] = [d for d in dirnames if not (base / d).is_symlink()]
        for name in sorted(filenames):
            src = base / name
            rel = (rel_dir / name).as_posix()
            if rel in skip:
                continue
            target = od.path / rel
            if os.path.lexists(target):
                raise FileExistsError(f"{rel}: the new version already has this file; refusing to overwrite it")
            if src.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(src.readlink())
            elif stat.S_ISREG(src.lstat().st_mode):
                od.link_file(src, rel, link=link)
            else:
                log.warning("%s: not a regular file, not carried over", src)


def _clear_owner(od: OutputDir) -> None:
    (od.path / _OWNER_FILE).unlink(missing_ok=True)


def commit_exchange(od: OutputDir, root: Path) -> None:
    """Swap the verified mirror in ``od`` with ``root``; ``od.path`` then holds the old tree."""
    with contextlib.suppress(OSError):
        od.path.chmod(stat.S_IMODE(root.stat().st_mode))
    _clear_owner(od)
    fsync_dir(od.path)
    if not exchange_dirs(od.path, root):
        # the probe said yes; a filesystem that changed its mind is an error, not a reason to mix
        (od.path / _OWNER_FILE).write_text(str(os.getpid()))
        raise OSError(errno.ENOTSUP, "atomic directory exchange failed", str(root))
    fsync_dir(root.parent)


def commit_files(od: OutputDir, root: Path, new_files: list[str], json_files: list[str]) -> None:
    """Move ``new_files`` from the mirror into ``root``, then replace ``json_files`` (index last).

    A journal naming the new files (and their inodes) is written into ``od`` first, so a later run
    can remove them if a kill stops this before the index references them.
    """
    journal = [{"name": n, "ino": (od.path / n).stat().st_ino} for n in new_files]
    data = json.dumps({"root": str(root), "files": journal}).encode("utf-8")
    with (od.path / JOURNAL).open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    for name in new_files:
        dest = root / name
        if os.path.lexists(dest):
            raise FileExistsError(f"{dest}: appeared while grafting; not replacing it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        (od.path / name).rename(dest)
    fsync_dir(root)
    ordered = [j for j in json_files if j != INDEX_NAME] + [j for j in json_files if j == INDEX_NAME]
    for name in ordered:
        os.replace(od.path / name, root / name)  # written there by atomic_write_json, fsynced
        fsync_dir(root)


def clean_interrupted(root: Path, staging_final: Path) -> list[str]:
    """Remove files an interrupted ``commit_files`` put into ``root`` that the index does not reference.

    Only files named in the journal of a dead run, still with the inode it recorded, are touched.
    Returns the names removed. The temp directories themselves are left for ``OutputDir`` to clean.
    """
    removed: list[str] = []
    referenced: set[str] = set()
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        index = json.loads((root / INDEX_NAME).read_text(encoding="utf-8"))
        referenced = {str(v) for v in index["weight_map"].values()}
    for stale in find_stale_partials(staging_final):
        try:
            journal = json.loads((stale / JOURNAL).read_text(encoding="utf-8"))
            entries = [(str(e["name"]), int(e["ino"])) for e in journal["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for name, ino in entries:
            p = root / name
            if name in referenced or ".." in Path(name).parts or Path(name).is_absolute():
                continue
            with contextlib.suppress(FileNotFoundError):
                if p.lstat().st_ino == ino:
                    p.unlink()
                    removed.append(name)
                    log.warning("%s: removed %s, left behind by an interrupted in-place graft", root, name)
        fsync_dir(root)
        with contextlib.suppress(OSError):
            (stale / JOURNAL).unlink()
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def clean_stale(root: Path) -> list[str]:
    """Everything interrupted in-place runs on ``root`` left: stray new files, then temp directories."""
    removed = clean_interrupted(root, root)
    for stale in find_stale_partials(root):
        log.warning("removing leftover temporary directory of an interrupted run: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale.name)
    return removed
