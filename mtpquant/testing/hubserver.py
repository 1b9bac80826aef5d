"""A local, stdlib-only stand-in for the Hugging Face Hub HTTP API, for tests.

`LocalHub` serves model repos stored as plain directories on a threaded HTTP server bound to 127.0.0.1, in the
URL layout `huggingface_hub` (1.x) talks to, so the **real** client can be pointed at it with
``endpoint=hub.endpoint`` (``hf_hub_download``, ``snapshot_download``, ``HfApi(endpoint=...)``,
``HfFileSystem(endpoint=...)``) and exercised without network access or patching its HTTP layer.

Storage layout (``root`` is the directory given to `LocalHub`)::

    root/<org>/<name>/                     files of the repo's ``main`` branch, as-is
    root/<org>/<name>@<quoted-revision>/   any other revision: ``name@dev``, ``name@refs%2Fpr%2F1`` ...
    root/.localhub/                        scratch space of the server (temporary files of commits)

A revision's commit sha is derived from the ``(path, size, mtime_ns, inode)`` of its files, so it changes
as soon as anything in the directory changes (also when a test edits files directly); the server reports it
in ``X-Repo-Commit`` / ``sha`` and accepts it (or a >= 7 character prefix) wherever a revision is expected.
Older commits are not kept: a sha only resolves while its revision still has that content.

File object ids are content hashes (git blob sha1; sha256 for files at or above ``lfs_threshold``, which are
reported as LFS files like on the Hub: ``X-Linked-Etag``/``X-Linked-Size`` headers and ``lfs`` entries in
tree listings), computed lazily and cached by file stat. For multi-GB repos pass ``hash_contents=False`` to
get cheap stat-derived ids instead (then unchanged re-uploads are not detected as no-ops).

Uploads never need LFS or Xet: the preupload endpoint answers ``"regular"`` for every file, so the client
sends the contents base64-encoded inside the NDJSON commit payload, which the server writes byte-exact.
Responses never carry ``X-Xet-Hash`` or ``xetHash``, so downloads stay on plain HTTP even with ``hf_xet``
installed.

Client quirks (huggingface_hub 1.x) that callers must know:

* ``HF_ENDPOINT``, ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and the token path are read when
  ``huggingface_hub`` is imported; setting them later (``monkeypatch.setenv``) has no effect on an already
  imported client, and the module-level functions (``huggingface_hub.model_info``, ``upload_folder``, ...)
  are bound to an ``HfApi()`` created at import. Pass ``endpoint=hub.endpoint`` / ``HfApi(endpoint=...)`` and
  ``cache_dir=`` explicitly, or wrap the code in ``hub.client_env(home)``, which also covers calls that take
  no such arguments (``HfApi.get_safetensors_metadata`` downloads the shard index into the default cache).
  ``HF_TOKEN`` is read per call.
* fsspec caches ``HfFileSystem`` instances: use ``HfFileSystem(endpoint=..., skip_instance_cache=True)``.
  Its default buffered reads fetch a whole block ahead (up to 5 MiB); ``fs.cat_file(path, start=a, end=b,
  cache_type="none")`` or ``fs.open(path, "rb", cache_type="none")`` + ``seek``/``read`` fetch exactly the
  requested bytes (one ``Range`` GET, after one ``model_info`` and one parent-folder tree listing per fs).
* Editing a served file in place without changing its size within the filesystem's timestamp granularity is
  not noticed (sha and ids are keyed by stat); write new content via a new file (or a different size).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["LocalHub", "RequestRecord"]

_CHUNK = 1 << 20
_HOST = "127.0.0.1"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA_PREFIX_RE = re.compile(r"[0-9a-f]{7,40}")
_PR_RE = re.compile(r"refs/pr/(\d+)")
_RANGE_RE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*")
_SPECIAL_REFS = ("pr", "convert", "heads", "tags")
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
_TRUE = {"1", "true", "yes", "on"}


# --------------------------------------------------------------------------------------------- public records


@dataclass(frozen=True)
class RequestRecord:
    """One request the server answered (the token itself is never recorded)."""

    method: str
    path: str  # URL path, percent-decoded, without the query string
    query: str  # raw query string
    status: int
    body_bytes: int  # response body bytes written to the socket (0 for HEAD)
    range: str | None  # the request's Range header, if any
    has_auth: bool  # whether an Authorization header was sent
    kind: str  # route: "resolve", "model_info", "tree", "paths_info", "preupload", "commit", ...
    repo_id: str | None = None
    revision: str | None = None  # revision as requested (decoded), e.g. "main", "refs/pr/1", a sha
    filename: str | None = None  # path in repo, for "resolve"


# --------------------------------------------------------------------------------------------- internals


@dataclass(frozen=True)
class _Stat:
    path: str  # absolute path on disk
    size: int
    mtime_ns: int
    ino: int

    @property
    def signature(self) -> str:
        return f"{self.size}:{self.mtime_ns}:{self.ino}"


@dataclass(frozen=True)
class _Rev:
    repo_id: str
    name: str  # "main", "dev", "refs/pr/1"
    dir: Path
    files: dict[str, _Stat]
    sha: str


@dataclass
class _Request:
    method: str
    segs: list[str]
    path: str
    raw_query: str
    headers: Message
    body: bytes = b""
    kind: str = "unknown"
    repo_id: str | None = None
    revision: str | None = None
    filename: str | None = None

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.raw_query, keep_blank_values=True)

    def flag(self, name: str) -> bool:
        values = self.query.get(name) or [""]
        return values[-1].strip().lower() in _TRUE

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except ValueError as e:
            raise _HttpError(400, f"Request body is not valid JSON: {e}") from e


@dataclass
class _Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    file: tuple[str, int, int] | None = None  # (path, offset, length) streamed from disk

    @property
    def length(self) -> int:
        return self.file[2] if self.file is not None else len(self.body)


class _HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def response(self) -> _Response:
        headers = {k: v for k, v in self.headers.items() if k.lower() != "content-type"}
        headers["X-Error-Message"] = _header_safe(self.message)
        if self.code is not None:
            headers["X-Error-Code"] = self.code
        return _json_response({"error": self.message, **self.extra}, status=self.status, headers=headers)


def _header_safe(text: str) -> str:
    return text.replace("\r", " ").replace("\n", " ").encode("ascii", "replace").decode("ascii")


def _json_response(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> _Response:
    body = json.dumps(obj).encode("utf-8")
    return _Response(status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})}, body)


def _iso(ts: float) -> str:
    dt = datetime.fromtimestamp(ts, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def _split_revision(segs: list[str]) -> tuple[str, list[str]]:
    """First revision in `segs`: one (possibly %2F-quoted) segment, or an unquoted `refs/<kind>/<name>`."""
    if not segs or not segs[0]:
        raise _HttpError(400, "Missing revision in URL")
    if len(segs) >= 3 and segs[0] == "refs" and segs[1] in _SPECIAL_REFS:
        return "/".join(segs[:3]), segs[3:]
    return segs[0], segs[1:]


def _clean_repo_path(path: Any, *, allow_root: bool = False) -> str:
    if not isinstance(path, str):
        raise _HttpError(400, f"Invalid path in repo: {path!r}")
    cleaned = path.strip("/")
    parts = cleaned.split("/") if cleaned else []
    if (not parts and not allow_root) or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise _HttpError(400, f"Invalid path in repo: {path!r}")
    if parts and parts[0] == ".git":
        raise _HttpError(400, f"Invalid path in repo: {path!r}")
    return cleaned


def _parse_range(header: str, size: int) -> tuple[int, int] | bool | None:
    """(start, end) inclusive; None to ignore the header (serve everything); False if unsatisfiable."""
    m = _RANGE_RE.fullmatch(header)
    if m is None or (not m[1] and not m[2]):
        return None  # multi-range or garbage: RFC 9110 lets a server ignore Range
    if not m[1]:  # suffix: last N bytes
        n = int(m[2])
        if n == 0 or size == 0:
            return False
        return max(0, size - n), size - 1
    start = int(m[1])
    if m[2] and int(m[2]) < start:
        return None  # syntactically invalid: ignored
    if start >= size:
        return False
    end = int(m[2]) if m[2] else size - 1
    return start, min(end, size - 1)


# --------------------------------------------------------------------------------------------- HTTP plumbing


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, hub: LocalHub, port: int) -> None:
        self.hub = hub
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__((_HOST, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn); not needed, and slow without a resolver.
        TCPServer.server_bind(self)
        self.server_name = _HOST
        self.server_port = self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self.connections_lock:
            conns = list(self.connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: huggingface_hub shares one pooled httpx.Client
    server_version = "LocalHub/1.0"
    timeout = 60  # idle keep-alive connections end after this

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        del format, args  # the hub keeps its own request log

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _handle(self) -> None:
        hub = cast(_Server, self.server).hub
        parts = urlsplit(self.path)
        # Split before decoding: revisions and tree paths arrive as single %2F-quoted segments.
        segs = [unquote(s) for s in parts.path.split("/")[1:]]
        req = _Request(self.command, segs, unquote(parts.path), parts.query, self.headers)
        try:
            req.body = self._read_body()
            resp = hub._dispatch(req)
        except _HttpError as e:
            resp = e.response()
        except Exception as e:
            hub._record_error(req, e)
            resp = _HttpError(500, f"LocalHub internal error: {type(e).__name__}: {e}").response()
        head = self.command == "HEAD"
        # Count before writing: a client may act on the last byte before this thread runs again.
        ticket = hub._record(req, resp, 0 if head else resp.length)
        unsent = self._send(resp, head=head)
        if unsent:
            hub._uncount(ticket, req.path, unsent)

    def _send(self, resp: _Response, *, head: bool) -> int:
        """Write the response; returns how many of the body bytes counted in advance were not written."""
        unsent = 0 if head else resp.length
        try:
            self.send_response(resp.status)
            for key, value in resp.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(resp.length))
            self.end_headers()
            if head:
                return 0
            if resp.file is None:
                self.wfile.write(resp.body)
                return 0
            path, offset, _ = resp.file
            with open(path, "rb") as f:
                f.seek(offset)
                while unsent > 0:
                    chunk = f.read(min(_CHUNK, unsent))
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    unsent -= len(chunk)
            if unsent > 0:  # file shrank under us: the declared length can't be honoured
                self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        return unsent


# --------------------------------------------------------------------------------------------- the hub


class LocalHub:
    """Threaded Hub-compatible HTTP server on 127.0.0.1 serving repos from ``root`` (see module docstring).

    Use as a context manager (or `start()` / `close()`)::

        with LocalHub(tmp_path / "hub") as hub:
            hub.create_repo("org/model", {"config.json": "{}"})
            hf_hub_download("org/model", "config.json", endpoint=hub.endpoint, cache_dir=tmp_path / "cache")

    Args:
        root: directory holding ``<org>/<name>/`` repo directories (created if missing).
        token: if set, every request must carry ``Authorization: Bearer <token>``, else 401.
        port: 0 picks a free ephemeral port.
        user: user name reported by ``whoami`` and used as namespace when ``create_repo`` gets none.
        lfs_threshold: files of at least this many bytes are reported as LFS files (``None``: never).
        hash_contents: content-hash file ids (default) or derive them from file stats (fast for huge repos).
        hardlink_threshold: when the server clones a revision (new PR / branch), files of at least this size
            are hard-linked instead of copied; the server itself only ever replaces files, never edits them in
            place, but a test that rewrites such a file in place changes it in every clone.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        token: str | None = None,
        port: int = 0,
        user: str = "local-user",
        lfs_threshold: int | None = 10 * 1024 * 1024,
        hash_contents: bool = True,
        hardlink_threshold: int = 16 * 1024 * 1024,
    ) -> None:
        self.root = Path(root).resolve()
        self.token = token
        self.user = user
        self.lfs_threshold = lfs_threshold
        self.hash_contents = hash_contents
        self.hardlink_threshold = hardlink_threshold
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # repo mutations
        self._stats_lock = threading.Lock()
        self._digests: dict[tuple[str, int, int, int, str], str] = {}
        self._generation = 0
        self._bytes_total = 0
        self._bytes_by_path: dict[str, int] = {}
        self._requests: list[RequestRecord] = []
        self._errors: list[str] = []
        self._commits: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._discussions: dict[str, dict[int, dict[str, Any]]] = {}
        self._private: dict[str, bool] = {}
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> LocalHub:
        if self._server is not None:
            return self
        self._server = _Server(self, self._port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="LocalHub", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("LocalHub is not started")
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """Base URL to pass as ``endpoint=`` / ``HF_ENDPOINT``, e.g. ``http://127.0.0.1:43121``."""
        return f"http://{_HOST}:{self.port}"

    # ------------------------------------------------------------------ counters

    @property
    def bytes_served(self) -> int:
        """Total response body bytes written since start / the last `reset_counters()`."""
        with self._stats_lock:
            return self._bytes_total

    @property
    def bytes_served_by_path(self) -> dict[str, int]:
        """Response body bytes per decoded URL path (e.g. ``/org/m/resolve/main/model.safetensors``)."""
        with self._stats_lock:
            return dict(self._bytes_by_path)

    def bytes_served_for(self, repo_id: str, filename: str, *, revision: str | None = None) -> int:
        """Body bytes of ``/resolve/`` responses for one file (any revision unless given)."""
        return sum(
            r.body_bytes
            for r in self.requests
            if r.kind == "resolve"
            and r.repo_id == repo_id
            and r.filename == filename
            and (revision is None or r.revision == revision)
        )

    @property
    def requests(self) -> list[RequestRecord]:
        """Copy of the request log (oldest first)."""
        with self._stats_lock:
            return list(self._requests)

    @property
    def errors(self) -> list[str]:
        """Tracebacks of internal server errors (answered with HTTP 500); empty when all went well."""
        with self._stats_lock:
            return list(self._errors)

    def reset_counters(self) -> None:
        with self._stats_lock:
            self._generation += 1
            self._bytes_total = 0
            self._bytes_by_path.clear()
            self._requests.clear()

    def _record(self, req: _Request, resp: _Response, sent: int) -> tuple[int, int]:
        record = RequestRecord(
            method=req.method,
            path=req.path,
            query=req.raw_query,
            status=resp.status,
            body_bytes=sent,
            range=req.headers.get("Range"),
            has_auth=req.headers.get("Authorization") is not None,
            kind=req.kind,
            repo_id=req.repo_id,
            revision=req.revision,
            filename=req.filename,
        )
        with self._stats_lock:
            self._bytes_total += sent
            self._bytes_by_path[req.path] = self._bytes_by_path.get(req.path, 0) + sent
            self._requests.append(record)
            return self._generation, len(self._requests) - 1

    def _uncount(self, ticket: tuple[int, int], path: str, unsent: int) -> None:
        """Take back body bytes counted by `_record` that could not be written (client went away)."""
        generation, index = ticket
        with self._stats_lock:
            if generation != self._generation:  # reset_counters() ran in between
                return
            self._bytes_total -= unsent
            self._bytes_by_path[path] = self._bytes_by_path.get(path, 0) - unsent
            record = self._requests[index]
            self._requests[index] = dataclasses.replace(record, body_bytes=record.body_bytes - unsent)

    def _record_error(self, req: _Request, exc: BaseException) -> None:
        text = f"{req.method} {req.path}?{req.raw_query}\n" + "".join(traceback.format_exception(exc))
        with self._stats_lock:
            self._errors.append(text)

    # ------------------------------------------------------------------ helpers for tests

    def repo_dir(self, repo_id: str, revision: str = "main") -> Path:
        """Directory holding ``revision`` of ``repo_id`` (whether or not it exists yet)."""
        org, name = self._split_repo_id(repo_id)
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/") :]
        if revision == "main":
            return self.root / org / name
        return self.root / org / f"{name}@{quote(revision, safe='')}"

    def create_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str | os.PathLike[str]] | None = None,
        *,
        revision: str = "main",
        exist_ok: bool = False,
    ) -> Path:
        """Create (or with `exist_ok`, extend) a repo revision on disk.

        `files` maps repo paths to bytes, text, or a local file to copy. Returns the revision directory.
        """
        with self._lock:
            main = self.repo_dir(repo_id)
            if revision != "main" and not main.is_dir():
                main.mkdir(parents=True)
            target = self.repo_dir(repo_id, revision)
            if target.exists() and not exist_ok:
                raise FileExistsError(target)
            target.mkdir(parents=True, exist_ok=True)
            for rel, content in (files or {}).items():
                dest = target / _clean_repo_path(rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, bytes):
                    dest.write_bytes(content)
                elif isinstance(content, str):
                    dest.write_text(content, encoding="utf-8")
                else:
                    shutil.copyfile(content, dest)
            return target

    def create_branch(self, repo_id: str, branch: str, *, from_revision: str = "main") -> Path:
        """Create ``branch`` (or any ref, e.g. ``refs/pr/3``) as a copy of ``from_revision``."""
        with self._lock:
            src = self._resolve_rev(repo_id, from_revision)
            dst = self.repo_dir(repo_id, branch)
            if dst.exists():
                raise FileExistsError(dst)
            self._clone_dir(src.dir, dst)
            return dst

    def commit_sha(self, repo_id: str, revision: str = "main") -> str:
        """The sha the server currently reports for ``revision``."""
        return self._resolve_rev(repo_id, revision).sha

    def file_url(self, repo_id: str, filename: str, revision: str = "main") -> str:
        return f"{self.endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"

    @contextlib.contextmanager
    def client_env(self, home: str | os.PathLike[str], *, token: str | None = None) -> Iterator[Path]:
        """Point ``huggingface_hub`` at this hub with an isolated ``HF_HOME`` for the duration of the block.

        Sets ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_XET_CACHE``, ``HF_TOKEN_PATH``,
        ``HF_HUB_DISABLE_TELEMETRY=1``, unsets ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` and sets
        ``HF_TOKEN`` to `token` (or unsets it). Because ``huggingface_hub`` reads these at import time, if it
        is already imported the matching ``huggingface_hub.constants`` values (``ENDPOINT`` together with
        ``HUGGINGFACE_CO_URL_TEMPLATE``, cache/token paths, ``HF_HUB_OFFLINE``) and the endpoint of the
        module-level ``huggingface_hub.hf_api.api`` singleton (behind ``huggingface_hub.model_info`` & co.)
        are set as well. Only configuration values are touched, never the HTTP machinery; all is restored
        on exit.
        """
        home_path = Path(home).resolve()
        home_path.mkdir(parents=True, exist_ok=True)
        paths = {
            "HF_HOME": str(home_path),
            "HF_HUB_CACHE": str(home_path / "hub"),
            "HF_ASSETS_CACHE": str(home_path / "assets"),
            "HF_XET_CACHE": str(home_path / "xet"),
            "HF_TOKEN_PATH": str(home_path / "token"),
        }
        env: dict[str, str | None] = {
            "HF_ENDPOINT": self.endpoint,
            **paths,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": None,
            "TRANSFORMERS_OFFLINE": None,
            "HUGGINGFACE_HUB_CACHE": None,
            "HUGGINGFACE_ASSETS_CACHE": None,
            "HUGGING_FACE_HUB_TOKEN": None,
            "HF_OIDC_RESOURCE": None,  # would trigger a token exchange with the real Hub
            "HF_TOKEN": token,
        }
        saved_env = {key: os.environ.get(key) for key in env}
        patched: list[tuple[object, str, object]] = []

        def _set(obj: object, attr: str, value: object) -> None:
            if hasattr(obj, attr):
                patched.append((obj, attr, getattr(obj, attr)))
                setattr(obj, attr, value)

        try:
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            constants = sys.modules.get("huggingface_hub.constants")
            if constants is not None:
                values: dict[str, object] = {
                    "ENDPOINT": self.endpoint,
                    "HUGGINGFACE_CO_URL_TEMPLATE": self.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                    **paths,
                    "HUGGINGFACE_HUB_CACHE": paths["HF_HUB_CACHE"],
                    "HUGGINGFACE_ASSETS_CACHE": paths["HF_ASSETS_CACHE"],
                    "HF_STORED_TOKENS_PATH": str(home_path / "stored_tokens"),
                    "HF_HUB_OFFLINE": False,
                    "HF_HUB_DISABLE_TELEMETRY": True,
                }
                for attr, new_value in values.items():
                    _set(constants, attr, new_value)
            hf_api = sys.modules.get("huggingface_hub.hf_api")
            singleton = getattr(hf_api, "api", None) if hf_api is not None else None
            if singleton is not None:
                _set(singleton, "endpoint", self.endpoint)
            yield home_path
        finally:
            for obj, attr, original in reversed(patched):
                setattr(obj, attr, original)
            for key, saved in saved_env.items():
                if saved is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = saved

    # ------------------------------------------------------------------ storage

    @staticmethod
    def _split_repo_id(repo_id: str) -> tuple[str, str]:
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(_NAME_RE.fullmatch(p) and ".." not in p for p in parts):
            raise _HttpError(
                404, f"Repository not found: {repo_id!r} (LocalHub needs '<org>/<name>')", "RepoNotFound"
            )
        return parts[0], parts[1]

    def _revision_names(self, repo_id: str) -> list[str]:
        org, name = self._split_repo_id(repo_id)
        names = ["main"]
        org_dir = self.root / org
        prefix = f"{name}@"
        if org_dir.is_dir():
            names += sorted(
                unquote(p.name[len(prefix) :])
                for p in org_dir.iterdir()
                if p.name.startswith(prefix) and p.is_dir()
            )
        return names

    def _scan(self, directory: Path) -> dict[str, _Stat]:
        out: dict[str, _Stat] = {}
        base = str(directory)
        for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            rel_dir = os.path.relpath(dirpath, base).replace(os.sep, "/")
            for fn in filenames:
                full = os.path.join(dirpath, fn)  # noqa: PTH118
                try:
                    st = os.stat(full)  # noqa: PTH116
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                rel = fn if rel_dir == "." else f"{rel_dir}/{fn}"
                out[rel] = _Stat(full, st.st_size, st.st_mtime_ns, st.st_ino)
        return dict(sorted(out.items()))

    @staticmethod
    def _sha(repo_id: str, files: Mapping[str, _Stat]) -> str:
        h = hashlib.sha1(f"localhub:{repo_id}\n".encode())
        for rel, st in files.items():
            h.update(f"{rel}\0{st.signature}\n".encode())
        return h.hexdigest()

    def _resolve_rev(self, repo_id: str, revision: str | None) -> _Rev:
        main = self.repo_dir(repo_id)
        if not main.is_dir():
            raise _HttpError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        name = revision or "main"
        if name.startswith("refs/heads/"):
            name = name[len("refs/heads/") :]
        directory = self.repo_dir(repo_id, name)
        if directory.is_dir():
            files = self._scan(directory)
            return _Rev(repo_id, name, directory, files, self._sha(repo_id, files))
        if _SHA_PREFIX_RE.fullmatch(name):
            for other in self._revision_names(repo_id):
                other_dir = self.repo_dir(repo_id, other)
                files = self._scan(other_dir)
                sha = self._sha(repo_id, files)
                if sha.startswith(name):
                    return _Rev(repo_id, other, other_dir, files, sha)
        raise _HttpError(404, f"Invalid rev id: {name}", "RevisionNotFound")

    def _digest(self, st: _Stat, kind: str) -> str:
        """'sha1git' (git blob id of the content) or 'sha256' of a file, cached by stat."""
        key = (st.path, st.size, st.mtime_ns, st.ino, kind)
        cached = self._digests.get(key)
        if cached is not None:
            return cached
        if self.hash_contents:
            h = hashlib.sha1(f"blob {st.size}\0".encode()) if kind == "sha1git" else hashlib.sha256()
            with open(st.path, "rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
            value = h.hexdigest()
        else:
            seed = f"{kind}:{st.path}:{st.signature}".encode()
            value = (hashlib.sha256 if kind == "sha256" else hashlib.sha1)(seed).hexdigest()
        self._digests[key] = value
        return value

    def _is_lfs(self, st: _Stat) -> bool:
        return self.lfs_threshold is not None and st.size >= self.lfs_threshold

    def _lfs_pointer(self, st: _Stat) -> bytes:
        return _LFS_POINTER.format(sha256=self._digest(st, "sha256"), size=st.size).encode()

    def _blob_oid(self, st: _Stat) -> str:
        if self._is_lfs(st):  # like git: the blob is the LFS pointer file
            pointer = self._lfs_pointer(st)
            return hashlib.sha1(f"blob {len(pointer)}\0".encode() + pointer).hexdigest()
        return self._digest(st, "sha1git")

    def _last_commit(self, rev: _Rev) -> dict[str, Any]:
        top = self._history(rev)[0]
        return {"id": top["id"], "title": top["title"], "date": top["date"]}

    def _history(self, rev: _Rev) -> list[dict[str, Any]]:
        with self._lock:
            recorded = list(self._commits.get((rev.repo_id, rev.name), []))
        if not recorded or recorded[0]["id"] != rev.sha:
            mtimes = [st.mtime_ns for st in rev.files.values()]
            ts = max(mtimes) / 1e9 if mtimes else rev.dir.stat().st_mtime
            title = "Initial commit" if not recorded else "Update files"
            recorded.insert(0, self._commit_entry(rev.sha, title, "", ts))
        return recorded

    def _commit_entry(self, sha: str, title: str, message: str, ts: float) -> dict[str, Any]:
        return {
            "id": sha,
            "title": title,
            "message": message,
            "authors": [{"user": self.user}],
            "date": _iso(ts),
        }

    def _file_entry(self, rev: _Rev, path: str, st: _Stat, expand: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self._blob_oid(st), "size": st.size, "path": path}
        if self._is_lfs(st):
            entry["lfs"] = {
                "oid": self._digest(st, "sha256"),
                "size": st.size,
                "pointerSize": len(self._lfs_pointer(st)),
            }
        if expand:
            entry["lastCommit"] = self._last_commit(rev)
        return entry

    def _dir_entry(self, rev: _Rev, path: str, expand: bool) -> dict[str, Any]:
        h = hashlib.sha1(f"tree:{path}\n".encode())
        prefix = f"{path}/"
        for rel, st in rev.files.items():
            if rel.startswith(prefix):
                h.update(f"{rel}\0{st.signature}\n".encode())
        entry: dict[str, Any] = {"type": "directory", "oid": h.hexdigest(), "size": 0, "path": path}
        if expand:
            entry["lastCommit"] = self._last_commit(rev)
        return entry

    def _clone_dir(self, src: Path, dst: Path) -> None:
        def _link_or_copy(s: str, d: str) -> str:
            if Path(s).stat().st_size >= self.hardlink_threshold:
                try:
                    os.link(s, d)
                    return d
                except OSError:
                    pass
            return cast(str, shutil.copy2(s, d))

        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)

    def _tmp_dir(self) -> Path:
        tmp = self.root / ".localhub" / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    # ------------------------------------------------------------------ routing

    def _dispatch(self, req: _Request) -> _Response:
        s = req.segs
        if s[:1] == ["api"]:
            req.kind = "api"
            self._check_auth(req)
            return self._route_api(req, s[1:])
        if len(s) >= 4 and s[2] == "resolve":
            req.kind = "resolve"
            req.repo_id = f"{s[0]}/{s[1]}"
            self._check_auth(req)
            rev, rest = _split_revision(s[3:])
            req.revision = rev
            req.filename = "/".join(rest)
            return self._resolve_file(req)
        self._check_auth(req)
        raise _HttpError(501, f"LocalHub does not implement {req.method} {req.path}")

    def _check_auth(self, req: _Request) -> None:
        if self.token is None:
            return
        auth = req.headers.get("Authorization")
        if auth is None:
            raise _HttpError(401, "Authentication required: send 'Authorization: Bearer <token>'")
        if auth != f"Bearer {self.token}":
            raise _HttpError(401, "Invalid credentials in Authorization header")

    def _route_api(self, req: _Request, s: list[str]) -> _Response:
        get = req.method in ("GET", "HEAD")
        post = req.method == "POST"
        if s == ["whoami-v2"] and get:
            req.kind = "whoami"
            return self._whoami(req)
        if s == ["validate-yaml"] and post:
            req.kind = "validate_yaml"
            return _json_response({"errors": [], "warnings": []})
        if s == ["repos", "create"] and post:
            req.kind = "create_repo"
            return self._create_repo(req)
        if s == ["repos", "delete"] and req.method == "DELETE":
            req.kind = "delete_repo"
            return self._delete_repo(req)
        if len(s) >= 3 and s[0] == "models":
            repo_id = req.repo_id = f"{s[1]}/{s[2]}"
            rest = s[3:]
            head, tail = (rest[0], rest[1:]) if rest else ("", [])
            if not rest and get:
                req.kind = "model_info"
                return self._model_info(req, repo_id, None)
            if head == "revision" and tail and get:
                req.kind = "model_info"
                req.revision = "/".join(tail)
                return self._model_info(req, repo_id, req.revision)
            if head == "tree" and tail and get:
                req.kind = "tree"
                req.revision, path_segs = _split_revision(tail)
                return self._tree(req, repo_id, req.revision, "/".join(path_segs))
            if head == "paths-info" and tail and post:
                req.kind = "paths_info"
                req.revision = "/".join(tail)
                return self._paths_info(req, repo_id, req.revision)
            if head == "preupload" and tail and post:
                req.kind = "preupload"
                req.revision = "/".join(tail)
                return self._preupload(req, repo_id, req.revision)
            if head == "commit" and tail and post:
                req.kind = "commit"
                req.revision = "/".join(tail)
                return self._commit(req, repo_id, req.revision)
            if head == "commits" and tail and get:
                req.kind = "commits"
                req.revision = "/".join(tail)
                rev = self._resolve_rev(repo_id, req.revision)
                return _json_response(self._history(rev))
            if head == "refs" and not tail and get:
                req.kind = "refs"
                return self._refs(repo_id)
            if head == "branch" and tail and req.method in ("POST", "DELETE"):
                req.kind = "branch"
                return self._branch(req, repo_id, "/".join(tail))
            if head == "discussions" and not tail and post:
                req.kind = "discussions"
                return self._create_discussion(req, repo_id)
            if head == "discussions" and len(tail) == 1 and get:
                req.kind = "discussions"
                return self._discussion_details(repo_id, tail[0])
        elif s[:1] and s[0] in ("datasets", "spaces", "kernels", "buckets"):
            raise _HttpError(404, f"LocalHub serves model repos only: {req.path}", "RepoNotFound")
        raise _HttpError(501, f"LocalHub does not implement {req.method} {req.path}")

    # ------------------------------------------------------------------ read endpoints

    def _resolve_file(self, req: _Request) -> _Response:
        if req.method not in ("GET", "HEAD"):
            raise _HttpError(405, f"Method {req.method} not allowed on /resolve/")
        assert req.repo_id is not None and req.filename is not None
        rev = self._resolve_rev(req.repo_id, req.revision)
        commit = {"X-Repo-Commit": rev.sha}
        st = rev.files.get(req.filename)
        if st is None:
            raise _HttpError(404, f"Entry not found: {req.filename}", "EntryNotFound", headers=commit)
        headers = {**commit, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if self._is_lfs(st):
            sha256 = self._digest(st, "sha256")
            headers.update(
                {"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(st.size)}
            )
        else:
            headers["ETag"] = f'"{self._digest(st, "sha1git")}"'
        range_header = req.headers.get("Range")
        if range_header:
            parsed = _parse_range(range_header, st.size)
            if parsed is False:
                raise _HttpError(
                    416,
                    f"Range not satisfiable: {range_header}",
                    headers={**headers, "Content-Range": f"bytes */{st.size}"},
                )
            if isinstance(parsed, tuple):
                start, end = parsed
                headers["Content-Range"] = f"bytes {start}-{end}/{st.size}"
                return _Response(206, headers, file=(st.path, start, end - start + 1))
        return _Response(200, headers, file=(st.path, 0, st.size))

    def _model_info(self, req: _Request, repo_id: str, revision: str | None) -> _Response:
        rev = self._resolve_rev(repo_id, revision)
        blobs = req.flag("blobs")
        query = req.query
        expand = query.get("expand", []) + query.get("expand[]", [])
        siblings = []
        for rel, st in rev.files.items():
            sibling: dict[str, Any] = {"rfilename": rel, "size": st.size}
            if blobs:
                sibling["blobId"] = self._blob_oid(st)
                if self._is_lfs(st):
                    sibling["lfs"] = {
                        "size": st.size,
                        "sha256": self._digest(st, "sha256"),
                        "pointerSize": len(self._lfs_pointer(st)),
                    }
            siblings.append(sibling)
        org = repo_id.split("/")[0]
        mtimes = [st.mtime_ns for st in rev.files.values()]
        last_modified = max(mtimes) / 1e9 if mtimes else rev.dir.stat().st_mtime
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": org,
            "sha": rev.sha,
            "lastModified": _iso(last_modified),
            "createdAt": _iso(self.repo_dir(repo_id).stat().st_mtime),
            "private": self._private.get(repo_id, False),
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(st.size for st in rev.files.values()),
        }
        if not expand or "safetensors" in expand:
            safetensors = self._safetensors_summary(rev)
            if safetensors is not None:
                info["safetensors"] = safetensors
        if not expand or "config" in expand:
            config = self._config_summary(rev)
            if config is not None:
                info["config"] = config
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id") or k in expand}
        return _json_response(info)

    @staticmethod
    def _safetensors_summary(rev: _Rev) -> dict[str, Any] | None:
        params: dict[str, int] = {}
        found = False
        for rel, st in rev.files.items():
            if not rel.endswith(".safetensors"):
                continue
            try:
                with open(st.path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    if n > 100_000_000:
                        continue
                    header = json.loads(f.read(n))
            except (OSError, ValueError, struct.error):
                continue
            found = True
            for name, tensor in header.items():
                if name == "__metadata__" or not isinstance(tensor, dict):
                    continue
                dtype = str(tensor.get("dtype"))
                params[dtype] = params.get(dtype, 0) + math.prod(tensor.get("shape") or [])
        return {"parameters": params, "total": sum(params.values())} if found else None

    @staticmethod
    def _config_summary(rev: _Rev) -> dict[str, Any] | None:
        st = rev.files.get("config.json")
        if st is None or st.size > 10_000_000:
            return None
        try:
            config = json.loads(Path(st.path).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict):
            return None
        return {k: config[k] for k in ("architectures", "model_type") if k in config}

    def _tree(self, req: _Request, repo_id: str, revision: str, path: str) -> _Response:
        rev = self._resolve_rev(repo_id, revision)
        path = path.strip("/")
        recursive = req.flag("recursive")
        expand = req.flag("expand")
        prefix = f"{path}/" if path else ""
        under = [(rel, st) for rel, st in rev.files.items() if rel.startswith(prefix)]
        if path and not under:
            raise _HttpError(404, f"Entry not found: {path} (not a folder of {revision})", "EntryNotFound")
        entries: dict[str, dict[str, Any]] = {}
        for rel, st in under:
            parts = rel[len(prefix) :].split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):
                folder = prefix + "/".join(parts[:i])
                if folder not in entries:
                    entries[folder] = self._dir_entry(rev, folder, expand)
            if recursive or len(parts) == 1:
                entries[rel] = self._file_entry(rev, rel, st, expand)
        return _json_response(list(entries.values()))

    def _paths_info(self, req: _Request, repo_id: str, revision: str) -> _Response:
        rev = self._resolve_rev(repo_id, revision)
        content_type = (req.headers.get("Content-Type") or "").lower()
        if "json" in content_type:
            data = req.json() or {}
            paths, expand = data.get("paths", []), bool(data.get("expand"))
        else:
            form = parse_qs(req.body.decode("utf-8"), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = (form.get("expand") or ["false"])[-1].lower() in _TRUE
        if isinstance(paths, str):
            paths = [paths]
        out = []
        for raw in paths:
            path = str(raw).strip("/")
            if path in rev.files:
                out.append(self._file_entry(rev, path, rev.files[path], expand))
            elif path and any(rel.startswith(f"{path}/") for rel in rev.files):
                out.append(self._dir_entry(rev, path, expand))
        return _json_response(out)

    def _refs(self, repo_id: str) -> _Response:
        out: dict[str, list[dict[str, str]]] = {
            "branches": [],
            "converts": [],
            "tags": [],
            "pullRequests": [],
        }
        for name in self._revision_names(repo_id):
            sha = self._resolve_rev(repo_id, name).sha
            if name.startswith("refs/pr/"):
                out["pullRequests"].append({"name": name, "ref": name, "targetCommit": sha})
            elif name.startswith("refs/tags/"):
                out["tags"].append({"name": name[len("refs/tags/") :], "ref": name, "targetCommit": sha})
            elif name.startswith("refs/convert/"):
                out["converts"].append(
                    {"name": name[len("refs/convert/") :], "ref": name, "targetCommit": sha}
                )
            else:
                out["branches"].append({"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha})
        return _json_response(out)

    def _whoami(self, req: _Request) -> _Response:
        if req.headers.get("Authorization") is None:
            raise _HttpError(401, "Invalid user token")
        return _json_response(
            {
                "type": "user",
                "id": hashlib.sha1(self.user.encode()).hexdigest()[:24],
                "name": self.user,
                "fullname": self.user,
                "email": f"{self.user}@localhost",
                "emailVerified": True,
                "isPro": False,
                "canPay": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "localhub", "role": "write"}},
            }
        )

    # ------------------------------------------------------------------ write endpoints

    def _create_repo(self, req: _Request) -> _Response:
        data = req.json() or {}
        repo_type = data.get("type") or "model"
        if repo_type != "model":
            raise _HttpError(400, f"LocalHub serves model repos only, not {repo_type!r}")
        org = data.get("organization") or self.user
        repo_id = req.repo_id = f"{org}/{data.get('name')}"
        try:
            self._split_repo_id(repo_id)
        except _HttpError as e:
            raise _HttpError(400, f"Invalid repo name: {repo_id!r}") from e
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            main = self.repo_dir(repo_id)
            if main.exists():
                # create_repo(exist_ok=True) reads "url" from the 409 body.
                raise _HttpError(409, "You already created this model repo", extra={"url": url})
            main.mkdir(parents=True)
            self._private[repo_id] = bool(data.get("private")) or data.get("visibility") == "private"
        return _json_response({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, req: _Request) -> _Response:
        data = req.json() or {}
        repo_id = req.repo_id = f"{data.get('organization') or self.user}/{data.get('name')}"
        with self._lock:
            names = self._revision_names(repo_id)
            if not self.repo_dir(repo_id).is_dir():
                raise _HttpError(404, f"Repository not found: {repo_id}", "RepoNotFound")
            for name in reversed(names):
                shutil.rmtree(self.repo_dir(repo_id, name), ignore_errors=True)
            self._discussions.pop(repo_id, None)
            for key in [k for k in self._commits if k[0] == repo_id]:
                del self._commits[key]
        return _json_response({})

    def _preupload(self, req: _Request, repo_id: str, revision: str) -> _Response:
        data = req.json() or {}
        try:
            rev: _Rev | None = self._resolve_rev(repo_id, revision)
        except _HttpError as e:
            if e.code != "RevisionNotFound":
                raise
            rev = None
        files = []
        for item in data.get("files", []):
            path = item.get("path")
            st = rev.files.get(path) if rev is not None else None
            oid = self._digest(st, "sha1git") if st is not None and self.hash_contents else None
            # "regular" for everything: no LFS batch API and no Xet storage needed by the client.
            files.append({"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return _json_response({"files": files, "commitOid": rev.sha if rev is not None else None})

    def _commit(self, req: _Request, repo_id: str, revision: str) -> _Response:
        lines = []
        for raw in req.body.splitlines():
            if raw.strip():
                try:
                    lines.append(json.loads(raw))
                except ValueError as e:
                    raise _HttpError(400, f"Invalid NDJSON line in commit payload: {e}") from e
        header = next((ln.get("value") or {} for ln in lines if ln.get("key") == "header"), {})
        ops = [ln for ln in lines if ln.get("key") != "header"]
        summary = str(header.get("summary") or "Commit")
        description = str(header.get("description") or "")
        with self._lock:
            base = self._resolve_rev(repo_id, revision)
            parent = header.get("parentCommit")
            if parent and parent != base.sha:
                raise _HttpError(412, f"Parent commit {parent} is not the head of {base.name} ({base.sha})")
            state, touched = self._stage(base, ops)
            pr_num: int | None = None
            if req.flag("create_pr"):
                pr_num = self._next_discussion_num(repo_id)
                target_name = f"refs/pr/{pr_num}"
                target_dir = self.repo_dir(repo_id, target_name)
                self._clone_dir(base.dir, target_dir)
                self._discussions.setdefault(repo_id, {})[pr_num] = self._discussion_record(
                    pr_num, summary, description, is_pr=True, base=base.name
                )
            else:
                target_name, target_dir = base.name, base.dir
                if (m := _PR_RE.fullmatch(target_name)) is not None:
                    pr_num = int(m[1])
            self._apply(target_dir, base.files, state, touched)
            new = self._resolve_rev(repo_id, target_name)
            self._commits.setdefault((repo_id, target_name), []).insert(
                0, self._commit_entry(new.sha, summary, description, time.time())
            )
        out: dict[str, Any] = {
            "success": True,
            "commitOid": new.sha,
            "commitUrl": f"{self.endpoint}/{repo_id}/commit/{new.sha}",
            "hookOutput": "",
        }
        if pr_num is not None:
            out["pullRequestUrl"] = f"{self.endpoint}/{repo_id}/discussions/{pr_num}"
        return _json_response(out)

    def _stage(self, base: _Rev, ops: list[dict[str, Any]]) -> tuple[dict[str, _Stat | bytes], set[str]]:
        """Validate commit operations against `base`: returns the final {path: content} and touched paths."""
        state: dict[str, _Stat | bytes] = dict(base.files)
        touched: set[str] = set()
        for op in ops:
            key = op.get("key")
            value = op.get("value") or {}
            if key == "file":
                path = _clean_repo_path(value.get("path"))
                content = value.get("content") or ""
                if value.get("encoding", "base64") == "base64":
                    try:
                        state[path] = base64.b64decode(content, validate=True)
                    except ValueError as e:
                        raise _HttpError(400, f"Invalid base64 content for {path}: {e}") from e
                else:
                    state[path] = str(content).encode("utf-8")
                touched.add(path)
            elif key == "lfsFile":
                path = _clean_repo_path(value.get("path"))
                source = self._find_lfs_object(base.repo_id, str(value.get("oid")), value.get("size"))
                if source is None:
                    raise _HttpError(
                        400,
                        f"LFS object {value.get('oid')} for {path} is unknown (LocalHub has no LFS upload)",
                    )
                state[path] = source
                touched.add(path)
            elif key == "deletedFile":
                path = _clean_repo_path(value.get("path"))
                if path not in state:
                    raise _HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del state[path]
                touched.add(path)
            elif key == "deletedFolder":
                path = _clean_repo_path(value.get("path"), allow_root=True)
                prefix = f"{path}/" if path else ""
                victims = [p for p in state if p.startswith(prefix)]
                if not victims:
                    raise _HttpError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for victim in victims:
                    del state[victim]
                touched.update(victims)
            else:
                raise _HttpError(400, f"Unsupported commit operation {key!r} (LocalHub)")
        for path in state:
            parts = path.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in state:
                    raise _HttpError(400, f"Path conflict: {'/'.join(parts[:i])} is both a file and a folder")
        return state, touched

    def _find_lfs_object(self, repo_id: str, oid: str, size: Any) -> _Stat | None:
        for name in self._revision_names(repo_id):
            for st in self._scan(self.repo_dir(repo_id, name)).values():
                if (size is None or st.size == size) and self._digest(st, "sha256") == oid:
                    return st
        return None

    def _apply(
        self,
        target: Path,
        base_files: Mapping[str, _Stat],
        state: Mapping[str, _Stat | bytes],
        touched: set[str],
    ) -> None:
        tmp_dir = self._tmp_dir()
        staged: list[tuple[str, str]] = []  # (tmp file, repo path)
        try:
            for path in sorted(touched):
                if path not in state:
                    continue
                content = state[path]
                fd, tmp = tempfile.mkstemp(dir=tmp_dir, prefix="commit-")
                with os.fdopen(fd, "wb") as f:
                    if isinstance(content, bytes):
                        f.write(content)
                    else:
                        with open(content.path, "rb") as src:
                            shutil.copyfileobj(src, f, _CHUNK)
                staged.append((tmp, path))
            for path in sorted(touched):
                if path in base_files and path not in state:
                    (target / path).unlink(missing_ok=True)
                    parent = (target / path).parent
                    while parent != target and parent.is_dir() and not any(parent.iterdir()):
                        parent.rmdir()
                        parent = parent.parent
            for tmp, path in staged:
                dest = target / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    Path(tmp).replace(dest)
                except OSError:  # e.g. repo dir symlinked onto another filesystem
                    shutil.move(tmp, dest)
        finally:
            for tmp, _ in staged:
                Path(tmp).unlink(missing_ok=True)

    def _branch(self, req: _Request, repo_id: str, branch: str) -> _Response:
        if not branch or branch.startswith("refs/") or (branch == "main" and req.method == "DELETE"):
            raise _HttpError(400, f"Invalid reference for a branch: {branch}")
        _clean_repo_path(branch)
        with self._lock:
            self._resolve_rev(repo_id, "main")  # 404 if the repo is missing
            dst = self.repo_dir(repo_id, branch)
            if req.method == "DELETE":
                if not dst.is_dir():
                    raise _HttpError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                shutil.rmtree(dst)
                return _json_response({})
            if dst.exists():
                raise _HttpError(409, f"Reference already exists: refs/heads/{branch}")
            data = req.json() or {}
            src = self._resolve_rev(repo_id, data.get("startingPoint") or "main")
            self._clone_dir(src.dir, dst)
        return _json_response({})

    def _next_discussion_num(self, repo_id: str) -> int:
        nums = set(self._discussions.get(repo_id, {}))
        for name in self._revision_names(repo_id):
            if (m := _PR_RE.fullmatch(name)) is not None:
                nums.add(int(m[1]))
        return max(nums, default=0) + 1

    def _discussion_record(
        self, num: int, title: str, description: str, *, is_pr: bool, base: str
    ) -> dict[str, Any]:
        return {
            "num": num,
            "title": title,
            "description": description,
            "isPullRequest": is_pr,
            "status": "open",
            "createdAt": _iso(time.time()),
            "base": base,
        }

    def _create_discussion(self, req: _Request, repo_id: str) -> _Response:
        data = req.json() or {}
        is_pr = bool(data.get("pullRequest"))
        with self._lock:
            main = self._resolve_rev(repo_id, "main")
            num = self._next_discussion_num(repo_id)
            if is_pr:
                self._clone_dir(main.dir, self.repo_dir(repo_id, f"refs/pr/{num}"))
            self._discussions.setdefault(repo_id, {})[num] = self._discussion_record(
                num,
                str(data.get("title") or ""),
                str(data.get("description") or ""),
                is_pr=is_pr,
                base="main",
            )
        return _json_response({"num": num, "url": f"{self.endpoint}/{repo_id}/discussions/{num}"})

    def _discussion_details(self, repo_id: str, num_text: str) -> _Response:
        self._resolve_rev(repo_id, "main")
        try:
            num = int(num_text)
        except ValueError as e:
            raise _HttpError(400, f"Invalid discussion number: {num_text}") from e
        record = self._discussions.get(repo_id, {}).get(num)
        if record is None:
            if not self.repo_dir(repo_id, f"refs/pr/{num}").is_dir():
                raise _HttpError(404, f"Discussion #{num} not found in {repo_id}")
            record = self._discussion_record(num, f"PR #{num}", "", is_pr=True, base="main")
        details = {
            "num": num,
            "title": record["title"],
            "status": record["status"],
            "createdAt": record["createdAt"],
            "isPullRequest": record["isPullRequest"],
            "repo": {"name": repo_id, "type": "model"},
            "author": {"name": self.user},
            "events": [],
            "changes": {"base": f"refs/heads/{record['base']}"},
            "filesWithConflicts": [],
            "diff": "",
        }
        return _json_response(details)
