"""LocalHub's HTTP layer: the threaded server, request/response records, ranges and the handler."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socketserver import TCPServer
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

if TYPE_CHECKING:
    from tests.support.hubserver.hub import LocalHub

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


class _Hangup(Exception):
    """Close the connection without an answer (the "hang" fault, once released)."""


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

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request (reset, broken pipe) is not an error of the server."""
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionResetError, BrokenPipeError, TimeoutError)):
            return
        super().handle_error(request, client_address)

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
        except _Hangup:
            self.close_connection = True
            return
        except _HttpError as e:
            resp = e.response()
        except Exception as e:
            hub._record_error(req, e)
            resp = _HttpError(500, f"LocalHub internal error: {type(e).__name__}: {e}").response()
        head = self.command == "HEAD"
        # Count before writing: a client may act on the last byte before this thread runs again.
        ticket = hub._record(req, resp, 0 if head else resp.length)
        unsent = self._send(resp, head=head, drop=hub._faulty("drop", req.kind) and resp.status < 300)
        if unsent:
            hub._uncount(ticket, req.path, unsent)

    def _send(self, resp: _Response, *, head: bool, drop: bool = False) -> int:
        """Write the response; returns how many of the body bytes counted in advance were not written.

        ``drop``: write the headers and half the body, then close the connection (a fault for tests)."""
        unsent = 0 if head else resp.length
        stop_at = resp.length // 2 if drop else -1
        try:
            self.send_response(resp.status)
            for key, value in resp.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(resp.length))
            self.end_headers()
            if head:
                return 0
            if drop:
                body = resp.body if resp.file is None else Path(resp.file[0]).read_bytes()[resp.file[1] :]
                self.wfile.write(body[:stop_at])
                self.wfile.flush()
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return resp.length - stop_at
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
