"""What may leave this machine: local directories named by their base name, never by their absolute path.

Every file mtpquant writes that can go to the Hub (the provenance file, the resolved recipe, an extracted
MTP's README, validation reports, the model card) passes what it records through here, so a user's
directory layout stays private. A Hub repo id stays as it is; a local directory that is a Hub snapshot (or
the SRC the provenance names by its repo id) is named by that id.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.source import SourceRef
from mtpquant.net.http import scrub_credentials

__all__ = [
    "local_path_needles",
    "public_args",
    "public_checkpoint",
    "public_file",
    "public_json",
    "public_name",
    "public_ref",
    "public_text",
]

# An absolute path inside free text: '/' not preceded by a word character, '.', ':' or '/' (URLs stay intact),
# at least two components; the last one is kept.
_ABS_PATH = re.compile(r"(?<![\w.:/])/(?:[^\s/'\"`]+/)+([^\s/'\"`]+)")


def _is_local_path(value: str) -> bool:
    return value.startswith(("/", "~", "./", "../")) or (len(value) > 2 and value[1] == ":" and value[2] in "/\\")


def _same_dir(text: str, path: str) -> bool:
    if text == path:
        return True
    try:
        p = Path(text).expanduser()
        return p.exists() and p.resolve() == Path(path).resolve()
    except OSError:
        return False


def public_name(value: str | os.PathLike[str], ref: SourceRef | None = None) -> str:
    """A local path by its base name (``ref``'s directory by its repo id when it has one); anything else as is."""
    text = os.fspath(value)
    if ref is not None and ref.path and _same_dir(text, ref.path):
        return ref.repo_id or Path(ref.path).name
    if not _is_local_path(text):
        return text
    return Path(text).name or text


def public_checkpoint(label: str) -> str:
    """A checkpoint as a report names it: a local directory by its base name however it was given (``tiny``,
    ``./tiny``, ``/abs/tiny`` and ``runs/tiny`` all read ``tiny``), anything else (a repo id, a served model name)
    as ``public_name`` names it."""
    try:
        local = Path(label).expanduser()
        ref = SourceRef(path=str(local.resolve())) if local.is_dir() else None
    except (OSError, ValueError):
        ref = None
    return public_name(label, ref)


def public_file(value: str) -> str:
    """A value that may name a local file (``--calib-data``): the file's base name when it is one (an absolute or
    relative path, or a file that exists here); anything else (``offline``, a dataset name) as it is."""
    try:
        is_file = Path(value).expanduser().is_file()
    except (OSError, ValueError):
        is_file = False
    if _is_local_path(value) or is_file:
        return Path(value).name or value
    return value


# Flags whose value is a secret (a server's key, a token): recorded as ``***``.
_SECRET_FLAGS = frozenset({"--api-key", "--token", "--hf-token", "--password"})


def public_args(args: Sequence[str], ref: SourceRef | None = None) -> tuple[str, ...]:
    """A command line with each local path argument (``--x=/a/b`` too) by its base name, the value of a secret flag
    (``--api-key``, ``--token``) as ``***`` and ``user:password@`` removed from URLs."""
    out: list[str] = []
    for arg in args:
        flag, eq, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
        if flag in _SECRET_FLAGS or (not flag and out and out[-1] in _SECRET_FLAGS):
            out.append(f"{flag}{eq}***")
            continue
        out.append(f"{flag}{eq}{scrub_credentials(public_name(value, ref))}")
    return tuple(out)


def public_ref(ref: SourceRef | None) -> SourceRef | None:
    """A source as the provenance records it: the repo id and commit as they are, a local path by base name."""
    if ref is None or ref.path is None:
        return ref
    return replace(ref, path=Path(ref.path).name or ref.path)


def public_text(text: str) -> str:
    """Free text with every absolute local path shortened to ``.../<last component>``."""
    return _ABS_PATH.sub(r".../\1", text)


def public_json(value: Any) -> Any:
    """A JSON value with ``public_text`` applied to every string in it."""
    if isinstance(value, str):
        return public_text(value)
    if isinstance(value, Mapping):
        return {k: public_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_json(v) for v in value]
    return value


def local_path_needles(*directories: Path) -> list[str]:
    """Directory prefixes (with their trailing '/') that must not appear in an uploaded file: the user's home,
    the working directory and the given directories' parents; the filesystem root is never one."""
    dirs: Iterable[Path] = (Path.home(), Path.cwd(), *(d.resolve().parent for d in directories))
    needles = {str(d).rstrip("/") + "/" for d in dirs}
    return sorted(n for n in needles if n.count("/") >= 2)
