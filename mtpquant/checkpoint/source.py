"""Where checkpoint bytes come from: a local directory or a Hub repo.

This is the only module that knows whether a checkpoint is remote. Everything above it asks for
files, sizes and byte ranges, and the source counts the bytes it read so reports can state them.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Protocol

from mtpquant.errors import CheckpointError

__all__ = ["CheckpointSource", "HubSource", "LocalSource", "open_source"]

log = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class CheckpointSource(Protocol):
    """Read access to the files of one checkpoint."""

    label: str
    bytes_read: int

    def list_files(self) -> list[str]:
        """Relative paths of every file."""
        ...

    def exists(self, relpath: str) -> bool:
        """Whether a file exists."""
        ...

    def file_size(self, relpath: str) -> int:
        """Size of a file in bytes."""
        ...

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file."""
        ...

    def local_path(self, relpath: str) -> Path:
        """A local path holding the file (downloads it for a remote source)."""
        ...


class LocalSource:
    """A checkpoint directory on disk."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.label = str(self.root)
        self.bytes_read = 0
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a checkpoint directory")

    def list_files(self) -> list[str]:
        """Relative paths of every regular file (not following into hidden temp dirs)."""
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                out.append(rel.as_posix())
        return out

    def _path(self, relpath: str) -> Path:
        return self.root / relpath

    def exists(self, relpath: str) -> bool:
        """Whether a file exists."""
        return self._path(relpath).is_file()

    def file_size(self, relpath: str) -> int:
        """Size of a file in bytes."""
        try:
            return self._path(relpath).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{relpath}: file does not exist in {self.label}") from None

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file."""
        with self._path(relpath).open("rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        self.bytes_read += len(data)
        if len(data) != end - start:
            raise CheckpointError(f"{relpath}: truncated: wanted bytes {start}..{end}, file ends earlier")
        return data

    def local_path(self, relpath: str) -> Path:
        """The file's own path."""
        return self._path(relpath)


class HubSource:
    """A model repo on the Hub (or any server in the Hub's URL layout, via ``HF_ENDPOINT``).

    Uses huggingface_hub for everything: the file list, small-file downloads through the HF cache,
    and ranged reads of shard headers and tensors through ``HfFileSystem``.
    """

    def __init__(
        self, repo_id: str, revision: str | None = None, token: str | None = None, endpoint: str | None = None
    ) -> None:
        from huggingface_hub import HfApi, HfFileSystem

        self.repo_id = repo_id
        self.revision = revision or "main"
        self.label = repo_id if self.revision == "main" else f"{repo_id}@{self.revision}"
        self.bytes_read = 0
        self._token = token
        # The endpoint and cache are read when the source is made (huggingface_hub reads its own
        # constants at import time), so HF_ENDPOINT / HF_HUB_CACHE set later still apply.
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self.cache_dir = os.environ.get("HF_HUB_CACHE") or (
            str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None
        )
        self._api = HfApi(endpoint=self.endpoint, token=token)
        self._fs = HfFileSystem(endpoint=self.endpoint, token=token, skip_instance_cache=True)
        self._sizes: dict[str, int] | None = None

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            from huggingface_hub.errors import HfHubHTTPError

            try:
                items = self._api.list_repo_tree(self.repo_id, revision=self.revision, recursive=True)
                self._sizes = {it.path: int(getattr(it, "size", 0) or 0) for it in items if hasattr(it, "size")}
            except HfHubHTTPError as exc:
                raise CheckpointError(f"{self.label}: cannot list the repo ({_short(exc)})") from None
        return self._sizes

    def list_files(self) -> list[str]:
        """Relative paths of every file in the repo revision."""
        return sorted(self._listing())

    def exists(self, relpath: str) -> bool:
        """Whether the repo has the file."""
        return relpath in self._listing()

    def file_size(self, relpath: str) -> int:
        """Size from the repo listing (no download)."""
        try:
            return self._listing()[relpath]
        except KeyError:
            raise CheckpointError(f"{relpath}: file does not exist in {self.label}") from None

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        """An HTTP range read of ``[start, end)`` through HfFileSystem (no caching block)."""
        if end <= start:
            return b""
        from urllib.parse import quote

        path = f"{self.repo_id}@{quote(self.revision, safe='')}/{relpath}"
        # cache_type="none": fetch exactly [start, end) instead of fsspec's 5 MiB read-ahead
        data = self._fs.cat_file(path, start=start, end=end, cache_type="none")
        self.bytes_read += len(data)
        return bytes(data)

    def local_path(self, relpath: str) -> Path:
        """Download the file into the HF cache (revision-aware) and return its path."""
        from huggingface_hub import hf_hub_download

        path = Path(
            hf_hub_download(
                self.repo_id,
                relpath,
                revision=self.revision,
                token=self._token,
                endpoint=self.endpoint,
                cache_dir=self.cache_dir,
            )
        )
        self.bytes_read += path.stat().st_size
        return path


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__


def looks_like_repo_id(ref: str) -> bool:
    """True for ``org/name`` strings that are not existing local paths."""
    return bool(_REPO_ID.match(ref)) and not Path(ref).exists()


def open_source(ref: str | os.PathLike[str], revision: str | None = None, token: str | None = None) -> Any:
    """A local directory, or a Hub repo id when ``ref`` is ``org/name`` and no such path exists."""
    ref_s = os.fspath(ref)
    if Path(ref_s).exists():
        return LocalSource(Path(ref_s))
    if looks_like_repo_id(ref_s):
        return HubSource(ref_s, revision=revision, token=token)
    raise CheckpointError(f"{ref_s}: no such directory, and not a Hub repo id (org/name)")


def read_json(source: CheckpointSource, relpath: str) -> Any:
    """Read and parse a small JSON file from a source, with a one-line error on failure."""
    size = source.file_size(relpath)
    raw = source.read_range(relpath, 0, size)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{relpath}: not valid JSON ({exc})") from None
