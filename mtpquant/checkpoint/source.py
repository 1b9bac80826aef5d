"""Where checkpoint bytes come from: a local directory or a Hub repo.

This is the only module that knows whether a checkpoint is remote. Everything above it asks for
files, sizes and byte ranges, and the source counts the bytes it read so reports can state them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mtpquant.errors import CheckpointError, HubAccessError, HubUnreachableError, MtpquantError, UsageError

__all__ = [
    "JSON_LIMIT",
    "REPO_ID_RE",
    "CheckpointSource",
    "HubSource",
    "LocalSource",
    "SourceRef",
    "is_repo_id",
    "looks_like_repo_id",
    "open_source",
]

log = logging.getLogger(__name__)

# .../models--org--name/snapshots/<commit>/ : a checkpoint in the HF cache
_HF_CACHE_SNAPSHOT = re.compile(r"models--([A-Za-z0-9][\w.-]*)--([\w.-]+)/snapshots/([0-9a-f]{40})/")


@dataclass(frozen=True)
class SourceRef:
    """Where a checkpoint came from, for provenance: a Hub repo (and the commit it resolved to) or a directory."""

    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None  # the Hub commit sha the revision resolved to
    path: str | None = None  # a local directory (absolute)


class CheckpointSource(Protocol):
    """Read access to the files of one checkpoint.

    ``local_root`` is the checkpoint's own directory on this machine, or None for a remote one: the only
    place anything above this module learns whether a checkpoint is remote.
    """

    label: str
    bytes_read: int
    requests: int  # network requests made (0 for a local directory)
    local_root: Path | None

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

    def plan_reads(self, relpath: str, ranges: list[tuple[int, int]]) -> None:
        """Ranges of a file about to be read (a remote source merges them into few requests)."""
        ...

    def local_path(self, relpath: str) -> Path:
        """A local path holding the file (downloads it for a remote source)."""
        ...

    def local_dir(self, ignore_patterns: list[str]) -> Path:
        """A local directory holding the whole checkpoint (a snapshot in the HF cache for a remote source)."""
        ...

    def local_extent(self, relpath: str, start: int, end: int) -> tuple[Path, int, int] | None:
        """(file, start, end) of bytes already on this disk (copied in the kernel), counted as read; None if remote."""
        ...

    def copy_observer(self, relpath: str, start: int, end: int) -> Callable[[memoryview], None] | None:
        """A function to see every piece of a local extent as it is copied (then copied through a buffer, not in the
        kernel), or None to let the kernel copy it."""
        ...

    def fingerprint(self, relpath: str) -> tuple[int, int, int, int] | None:
        """(device, inode, size, mtime_ns) of a local file (the one a symlink points to); None for a remote one."""
        ...

    def ref(self) -> SourceRef:
        """Where the checkpoint came from (provenance)."""
        ...


def read_file_range(path: Path, start: int, end: int, label: str) -> bytes:
    """Bytes ``[start, end)`` of a local file; a file that ends earlier is refused, naming ``label``."""
    with path.open("rb") as fh:
        fh.seek(start)
        data = fh.read(end - start)
    if len(data) != end - start:
        raise CheckpointError(f"{label}: truncated: wanted bytes {start}..{end}, file ends earlier")
    return data


def file_pieces(path: Path, start: int, end: int, label: str, chunk: int = 1 << 20) -> Iterator[memoryview]:
    """Bytes ``[start, end)`` of a local file in pieces of at most ``chunk``, read into one reused buffer (each piece
    is valid until the next is read); a file that ends earlier is refused, naming ``label``."""
    buf = memoryview(bytearray(min(chunk, max(end - start, 1))))
    with path.open("rb", buffering=0) as fh:
        fh.seek(start)
        offset = start
        while offset < end:
            n = fh.readinto(buf[: min(len(buf), end - offset)])
            if not n:
                raise CheckpointError(f"{label}: truncated: wanted bytes {start}..{end}, file ends earlier")
            yield buf[:n]
            offset += n


class LocalSource:
    """A checkpoint directory on disk.

    Nothing is read through a symbolic link that leaves the directory: a file (or a directory on its way) that
    resolves outside it is refused, naming it (a ``git clone`` or an archive can carry such a link, and convert and
    graft would copy or hard-link its target into their output). The one exception is a snapshot in the HF cache's
    layout (``models--ORG--NAME/snapshots/COMMIT/``), whose files are links into the repo's own ``blobs/`` (a real
    directory there, not itself a link).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.label = str(self.root)
        self.bytes_read = 0
        self.requests = 0
        self.local_root: Path | None = self.root
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a checkpoint directory")
        real = os.path.realpath(self.root)
        self._inside: tuple[str, ...] = (real.rstrip(os.sep) + os.sep,)
        if Path(real).parent.name == "snapshots":  # a snapshot of huggingface_hub's cache layout
            blobs = Path(real).parent.parent / "blobs"
            if blobs.is_dir() and not blobs.is_symlink():  # its own blobs/, itself no link to elsewhere
                self._inside += (str(blobs) + os.sep,)
        self._contained: set[str] = set()  # relative paths already checked

    def list_files(self) -> list[str]:
        """Relative paths of every regular file (not following into hidden temp dirs, nor into linked directories);
        a file that is a link leading out of the checkpoint is refused."""
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                name = rel.as_posix()
                if p.is_symlink():  # rglob does not descend into linked directories: only the file itself can be one
                    self._contain(name, p)
                self._contained.add(name)
                out.append(name)
        return out

    def _contain(self, relpath: str, path: Path) -> None:
        if not os.path.realpath(path).startswith(self._inside):
            raise CheckpointError(
                f"{self.label}: {relpath} is a symbolic link that leads outside the checkpoint; mtpquant never "
                "follows a link out of a checkpoint (copy the file into it)"
            )
        self._contained.add(relpath)

    def _path(self, relpath: str) -> Path:
        path = self.root / relpath
        if relpath not in self._contained:
            self._contain(relpath, path)
        return path

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
        data = read_file_range(self._path(relpath), start, end, relpath)
        self.bytes_read += len(data)
        return data

    def plan_reads(self, relpath: str, ranges: list[tuple[int, int]]) -> None:
        """Local files: nothing to merge."""
        del relpath, ranges

    def local_path(self, relpath: str) -> Path:
        """The file's own path."""
        return self._path(relpath)

    def local_dir(self, ignore_patterns: list[str]) -> Path:
        """The directory itself."""
        del ignore_patterns
        return self.root

    def local_extent(self, relpath: str, start: int, end: int) -> tuple[Path, int, int] | None:
        """The file and range themselves."""
        self.bytes_read += end - start
        return self._path(relpath), start, end

    def copy_observer(self, relpath: str, start: int, end: int) -> Callable[[memoryview], None] | None:
        """None: nothing watches a plain local copy."""
        del relpath, start, end
        return None

    def fingerprint(self, relpath: str) -> tuple[int, int, int, int] | None:
        """stat of the file (following a symlink)."""
        try:
            st = self._path(relpath).stat()
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def ref(self) -> SourceRef:
        """A repo id when the directory is a snapshot in the HF cache, else the path."""
        resolved = self.root.resolve()
        m = _HF_CACHE_SNAPSHOT.search(resolved.as_posix() + "/")
        if m:
            return SourceRef(repo_id=f"{m.group(1)}/{m.group(2)}", commit=m.group(3), path=str(resolved))
        return SourceRef(path=str(resolved))


class HubSource:
    """A model repo on the Hub (or any server in the Hub's URL layout, via ``HF_ENDPOINT``).

    Uses huggingface_hub for everything: the file list, small-file downloads through the HF cache, and
    ranged reads of shard headers and tensors over its shared HTTP client (``mtpquant.net.hub``: a
    timeout, ``Retry-After``, checked lengths, one-line errors). Ranges announced with ``plan_reads``
    are merged into as few requests as possible (adjacent tensors are one read) and served from a
    bounded cache. ``requests`` counts every HTTP request this source made (redirects included).
    """

    MERGE_GAP = 64 * 1024  # ranges this close are one read
    MAX_SPAN = 1024 * 1024 * 1024  # no single read larger than this (the memory it takes)
    CACHE_BYTES = MAX_SPAN  # readers go front to back (``PlannedTensor.read_order``): one span at a time

    def __init__(
        self, repo_id: str, revision: str | None = None, token: str | None = None, endpoint: str | None = None
    ) -> None:
        from huggingface_hub import HfApi

        from mtpquant.net.hub import configure_client

        configure_client()
        self.repo_id = repo_id
        self.revision = revision or "main"
        self.label = repo_id if self.revision == "main" else f"{repo_id}@{self.revision}"
        self.bytes_read = 0
        self.requests = 0
        self._token = token
        # The endpoint and cache are read when the source is made (huggingface_hub reads its own
        # constants at import time), so HF_ENDPOINT / HF_HUB_CACHE set later still apply.
        self.endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
        self.cache_dir = os.environ.get("HF_HUB_CACHE") or (
            str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None
        )
        self._api = HfApi(endpoint=self.endpoint, token=token)
        self._sizes: dict[str, int] | None = None
        self._commit: str | None = None
        self._planned: dict[str, list[tuple[int, int]]] = {}
        self._cache: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._cached_bytes = 0
        self.local_root: Path | None = None
        self.not_local = False  # a mistyped local path, perhaps (``open_source``): Hub errors say there is none

    @contextlib.contextmanager
    def _hub(self, what: str) -> Iterator[None]:
        """Hub calls: errors as one line naming the repo; requests counted."""
        from mtpquant.net.hub import hub_errors, request_count

        before = request_count()
        try:
            with hub_errors(self.label, what, self.endpoint):
                yield
        except (HubAccessError, HubUnreachableError) as exc:
            if not self.not_local:
                raise
            raise type(exc)(f"{exc}; nor is there a local directory {self.repo_id}") from None
        finally:
            self.requests += request_count() - before

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            with self._hub("listing the repo"):
                items = list(self._api.list_repo_tree(self.repo_id, revision=self.revision, recursive=True))
            # Hub-only files (.gitattributes, ...) are not part of the checkpoint, as a local directory's are not
            self._sizes = {
                it.path: int(getattr(it, "size", 0) or 0)
                for it in items
                if hasattr(it, "size") and not any(part.startswith(".") for part in it.path.split("/"))
            }
        return self._sizes

    def list_files(self) -> list[str]:
        """Relative paths of every file in the repo revision (hidden files left out)."""
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

    def plan_reads(self, relpath: str, ranges: list[tuple[int, int]]) -> None:
        """Announce ranges about to be read: later reads inside them are served from merged requests."""
        merged: list[list[int]] = []
        for start, end in sorted(ranges):
            if merged and start - merged[-1][1] <= self.MERGE_GAP and end - merged[-1][0] <= self.MAX_SPAN:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._planned[relpath] = sorted([*self._planned.get(relpath, []), *((a, b) for a, b in merged)])

    def _fetch(self, relpath: str, start: int, end: int) -> bytes:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        from mtpquant.net.hub import read_range

        url = hf_hub_url(self.repo_id, relpath, revision=self.revision, endpoint=self.endpoint)
        with self._hub(f"reading {relpath}"):
            data, _ = read_range(
                url, start, end, build_hf_headers(token=self._token), label=self.label, what=f"reading {relpath}"
            )
        self.bytes_read += len(data)
        return data

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``: from a cached merged read when planned, else one ranged GET."""
        if end <= start:
            return b""
        for (path, a, b), data in self._cache.items():
            if path == relpath and a <= start and end <= b:
                self._cache.move_to_end((path, a, b))
                return data[start - a : end - a]
        span = next(((a, b) for a, b in self._planned.get(relpath, ()) if a <= start and end <= b), None)
        if span is None:
            return self._fetch(relpath, start, end)
        data = self._fetch(relpath, *span)
        self._cache[(relpath, span[0], span[1])] = data
        self._cached_bytes += len(data)
        while self._cached_bytes > self.CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= len(old)
        return data[start - span[0] : end - span[0]]

    def local_path(self, relpath: str) -> Path:
        """Download the file into the HF cache (revision-aware) and return its path."""
        from huggingface_hub import hf_hub_download

        with self._hub(f"downloading {relpath}"):
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

    def local_dir(self, ignore_patterns: list[str]) -> Path:
        """``snapshot_download`` of the revision into the HF cache (resumable, revision-aware)."""
        from huggingface_hub import snapshot_download

        log.info("downloading %s (HF cache)", self.label)
        with self._hub("downloading the repo"):
            path = Path(
                snapshot_download(
                    repo_id=self.repo_id,
                    revision=self.revision,
                    token=self._token,
                    cache_dir=self.cache_dir,
                    endpoint=self.endpoint,
                    ignore_patterns=ignore_patterns,
                )
            )
        self._commit = path.name  # snapshots/<commit sha>
        return path

    def local_extent(self, relpath: str, start: int, end: int) -> tuple[Path, int, int] | None:
        """Remote: no local bytes (reads go through ``read_range``)."""
        del relpath, start, end
        return None

    def copy_observer(self, relpath: str, start: int, end: int) -> Callable[[memoryview], None] | None:
        """Remote: no local copies."""
        del relpath, start, end
        return None

    def fingerprint(self, relpath: str) -> tuple[int, int, int, int] | None:
        """Remote: no local file."""
        del relpath
        return None

    def ref(self) -> SourceRef:
        """The repo, the revision asked for, and the commit it resolved to (one model_info call if not known)."""
        if self._commit is None:
            try:
                with self._hub("resolving the commit"):
                    self._commit = self._api.model_info(self.repo_id, revision=self.revision).sha
            except MtpquantError as exc:
                log.warning("%s", exc)
        return SourceRef(repo_id=self.repo_id, revision=self.revision, commit=self._commit)


# A full Hub repo id by the Hub's naming rules: namespace/name, each [A-Za-z0-9._-] not starting or ending with
# '.' or '-', at most 96 characters, no '--' or '..', not ending in '.git'.
_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID_RE = re.compile(rf"{_REPO_PART}/{_REPO_PART}")


def is_repo_id(value: object) -> bool:
    """Whether ``value`` is a full Hub model id (``namespace/name``) by the Hub's naming rules."""
    return (
        isinstance(value, str)
        and REPO_ID_RE.fullmatch(value) is not None
        and ".." not in value
        and "--" not in value
        and not value.endswith(".git")
    )


def looks_like_repo_id(ref: str) -> bool:
    """True for Hub repo ids (``is_repo_id``) that are not existing local paths."""
    return is_repo_id(ref) and not Path(ref).exists()


def open_source(ref: str | os.PathLike[str], revision: str | None = None, token: str | None = None) -> Any:
    """A local directory, or a Hub repo id when ``ref`` is ``org/name`` and no such path exists."""
    ref_s = os.fspath(ref)
    if Path(ref_s).exists():
        if revision is not None:
            raise UsageError(f"{ref_s}: a local directory has no revisions (a revision applies to a Hub repo id)")
        return LocalSource(Path(ref_s))
    if looks_like_repo_id(ref_s):
        source = HubSource(ref_s, revision=revision, token=token)
        # ``runs/typo`` where ``runs/`` is a local directory: a Hub failure also says there is no such local directory
        source.not_local = Path(ref_s).parent.is_dir()
        return source
    raise CheckpointError(f"{ref_s}: no such directory, and not a Hub repo id (org/name)")


# The largest JSON file of a checkpoint mtpquant reads whole (config, index, quantization config, provenance). A
# real index of ~300,000 tensors is ~30 MB; this leaves room and still bounds what one bad file can take.
JSON_LIMIT = 256 * 1024 * 1024


def read_bytes(source: CheckpointSource, relpath: str, *, limit: int = JSON_LIMIT, what: str = "file") -> bytes:
    """A whole small file of a source (a JSON file, a tokenizer, a card, a recipe), never more than ``limit`` bytes,
    locally or from the Hub; a larger one is refused in one line naming it (``what``: its kind, for that line)."""
    size = source.file_size(relpath)
    if size > limit:
        raise CheckpointError(f"{relpath}: {size} bytes, more than the {limit} mtpquant reads of a {what}")
    return source.read_range(relpath, 0, size)


def read_text(source: CheckpointSource, relpath: str, *, limit: int = JSON_LIMIT, what: str = "file") -> str:
    """``read_bytes`` as UTF-8 text; text that is not UTF-8 is refused in one line naming the file."""
    try:
        return read_bytes(source, relpath, limit=limit, what=what).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{relpath}: not UTF-8 text") from None


def read_json(source: CheckpointSource, relpath: str, *, limit: int = JSON_LIMIT) -> Any:
    """Read and parse a JSON file of a source (never more than ``limit`` bytes, locally or from the Hub, nor nested
    deeper than the parser allows), with a one-line error on failure."""
    from mtpquant.net import safejson

    raw = read_bytes(source, relpath, limit=limit, what="JSON file")
    try:
        return safejson.loads(raw, limit=limit)
    except safejson.JsonLimitError as exc:
        raise CheckpointError(f"{relpath}: not readable JSON ({exc})") from None
    except ValueError as exc:
        raise CheckpointError(f"{relpath}: not valid JSON ({exc})") from None
