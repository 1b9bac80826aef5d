"""A scripted HTTP server on 127.0.0.1 for the hostile-network tests: each request is answered by a function that
writes raw bytes to the socket (so it can drip, send endless bodies, redirect anywhere), and every request is
recorded (method, path, headers, body).

    with RawServer(lambda req, sock: sock.sendall(b"HTTP/1.1 200 OK\\r\\n...")) as server:
        server.url, server.requests
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType


@dataclass
class RawRequest:
    """One request as it arrived."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    extra: dict[str, object] = field(default_factory=dict)


Script = Callable[[RawRequest, socket.socket], None]


def answer(status: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer (closing the connection)."""
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def drip(sock: socket.socket, data: bytes, every: float = 0.5) -> None:
    """Send ``data`` one byte every ``every`` seconds (until the peer goes away)."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i : i + 1])
        except OSError:
            return
        time.sleep(every)


class RawServer:
    """Answers each connection's requests with ``script`` (on its own thread)."""

    def __init__(self, script: Script, host: str = "127.0.0.1") -> None:
        self.script = script
        self.requests: list[RawRequest] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RawServer:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            buf = b""
            try:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, rest = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0") or 0)
                while len(rest) < n:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    rest += chunk
                req = RawRequest(method, path, headers, rest[:n])
                self.requests.append(req)
                self.script(req, conn)
            except OSError:
                return
