"""What ``publish`` uploads from OUT: the file list (``plan_files``: hidden files and validate's server logs left
out, every file a regular file inside OUT) and the scan that refuses a file holding a Hub token or naming a local
path (``refuse_private``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from mtpquant.checkpoint.header import MAX_HEADER_BYTES
from mtpquant.errors import PublishRefusedError
from mtpquant.public import local_path_needles
from mtpquant.publish.card import CARD_NAME
from mtpquant.records.validation import LOGS_DIR, REPORT_DIR

__all__ = ["HIDDEN", "LOCAL_ONLY", "SCAN_CHUNK", "PublishFile", "plan_files", "refuse_private"]

# Hidden files and folders (temp dirs of interrupted writes, caches) are never uploaded, nor the engine's server
# logs validate keeps beside its report (they name local paths and ports; the report holds what they showed).
HIDDEN = [".*", "*/.*"]
LOCAL_ONLY = [f"{REPORT_DIR}/{LOGS_DIR}/*"]


@dataclass(frozen=True)
class PublishFile:
    """One file of the upload."""

    path: str  # path in the repo
    size: int
    note: str = ""  # "generated card", "card kept", ...


def plan_files(out: Path) -> list[PublishFile]:
    """The files of OUT ``upload_folder`` will send, sorted; hidden files and folders and the engine's server
    logs (``validation/logs/``) are left out."""
    root = out.resolve()
    files: list[PublishFile] = []
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if any(part.startswith(".") for part in rel.parts) or any(fnmatch(rel.as_posix(), g) for g in LOCAL_ONLY):
            continue
        real = p.resolve()  # every file's real path: a link, or a file in a linked directory, must stay inside OUT
        if real != root and root not in real.parents:
            what = "symlink points" if p.is_symlink() else "resolves to a path"
            raise PublishRefusedError(f"{out}/{rel.as_posix()}: {what} outside OUT; refusing to upload it")
        if p.is_file():
            files.append(PublishFile(rel.as_posix(), p.stat().st_size))
        elif not p.is_dir():
            raise PublishRefusedError(f"{out}/{rel.as_posix()}: not a regular file; refusing to upload it")
    return files


# Files carried from the source as they are (the tokenizer's vocabulary can hold any string): not scanned for paths.
_CARRIED_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template", "preprocessor")
_TEXT_SUFFIXES = (".json", ".md", ".yaml", ".yml", ".txt", ".jinja", ".log", ".csv")


_ANY_TOKEN = re.compile(rb"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}")  # a Hub user access token, whoever's
SCAN_CHUNK = 8 * 1024 * 1024


def _scan(
    path: Path, tokens: Sequence[bytes], paths: Sequence[bytes], *, header_only: bool
) -> tuple[str, bytes] | None:
    """What private string ``path`` holds, if any: ``("token", t)`` (one of ``tokens``), ``("any-token", t)`` (any Hub
    token), ``("path", p)`` (one of ``paths``), in that order of precedence within a piece. Streamed, pieces overlapping
    so nothing is missed at a seam; of a safetensors shard only its header (``__metadata__`` and the tensor table)."""
    overlap = max([64, *(len(n) for n in (*tokens, *paths))])
    with path.open("rb") as fh:
        limit = None
        if header_only:
            first8 = fh.read(8)
            limit = min(int.from_bytes(first8, "little"), MAX_HEADER_BYTES) if len(first8) == 8 else 0
        tail = b""
        read = 0
        while True:
            want = SCAN_CHUNK if limit is None else min(SCAN_CHUNK, limit - read)
            piece = fh.read(want) if want > 0 else b""
            if not piece:
                return None
            read += len(piece)
            data = tail + piece
            hit = next((("token", t) for t in tokens if t in data), None)
            m = _ANY_TOKEN.search(data) if hit is None else None
            hit = hit or (("any-token", m.group(0)) if m is not None else None)
            hit = hit or next((("path", p) for p in paths if p in data), None)
            if hit is not None:
                return hit
            tail = data[-overlap:]


def refuse_private(out: Path, files: list[PublishFile], card: str, secrets: list[str]) -> None:
    """Refuse to upload what must stay private, reading each file once, streamed, whatever its suffix or size (of a
    weight shard its header: ``__metadata__`` and tensor names): a file that holds a Hub token (the one in use, or
    any ``hf_...`` token), checked first; then a file that names a local directory by its absolute path (a user's
    directory layout is private): the card, the shards' headers and every text file mtpquant or another tool wrote
    (carried tokenizer files excepted: their vocabulary can hold any string)."""
    tokens = [s.encode("utf-8") for s in secrets if len(s) >= 8]
    paths = [n.encode("utf-8") for n in local_path_needles(out)]

    def named_path(data: bytes) -> str | None:
        return next((n.decode("utf-8") for n in paths if n in data), None)

    leak = named_path(card.encode("utf-8"))
    first_leak = (CARD_NAME, leak) if leak else None
    for f in files:
        weight = f.path.endswith(".safetensors")
        name = f.path.rsplit("/", 1)[-1]
        scan_paths = f.path != CARD_NAME and first_leak is None and (
            weight or (f.path.endswith(_TEXT_SUFFIXES) and not name.startswith(_CARRIED_PREFIXES))
        )
        hit = _scan(out / f.path, tokens, paths if scan_paths else [], header_only=weight)
        if hit is None:
            continue
        kind, found = hit
        if kind != "path":
            what = "the Hub token" if kind == "token" else "a Hub token (hf_...)"
            where = "its header" if weight else "it"
            raise PublishRefusedError(
                f"{out}/{f.path} contains {what}; refusing to upload it (remove the token from {where})"
            )
        first_leak = (f.path, found.decode("utf-8"))
    if first_leak is not None:
        path, needle = first_leak
        raise PublishRefusedError(
            f"{out}/{path} names the local path {needle}...; refusing to upload it (a directory layout is "
            "private: name local directories by their base name, or remove the file)"
        )
