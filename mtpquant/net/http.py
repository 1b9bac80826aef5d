"""Every HTTP request mtpquant makes is bounded in time and in bytes, and no URL it keeps carries a password.

Both network clients (the Hub's, through huggingface_hub's shared ``httpx`` client, ``mtpquant.net.hub``; the
engines', ``mtpquant.engine.http``) send their requests through ``bounded_transport()``: httpx's own transport over
httpcore's connection pool, with a network backend that clamps every socket operation (connect, TLS, each read and
each write) to what is left of the request's **budget** (``Budget``): an overall deadline that runs from the start
of the request through the last byte of its answer, headers included. httpx's own timeouts bound the wait between
two bytes only, so a server that sends one byte a second would otherwise hold a run forever. A budget may grow with
the bytes moved (``rate``: a multi-GB download is not cut off while it makes progress) and may cap the bytes read
(``limit``: a JSON answer, metrics, an error body), refused with ``BoundExceededError`` as soon as it is passed, never
read whole.

``public_url`` / ``split_credentials``: a URL as it may be stored or printed (``user:password@`` removed).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "BoundExceededError",
    "Budget",
    "bounded_transport",
    "budget",
    "current_budget",
    "public_url",
    "scrub_credentials",
    "split_credentials",
    "start_budget",
    "transport_class",
]


_T = TypeVar("_T")


class BoundExceededError(Exception):
    """An answer passed its byte cap (or came encoded where a capped answer must not be); ``str`` says which."""


@dataclass
class Budget:
    """What one request may take: ``seconds`` from ``start`` (plus one second per ``rate`` bytes moved, when
    given) and at most ``limit`` bytes read (headers and body, as they come off the socket)."""

    start: float
    seconds: float
    rate: float | None = None
    limit: int | None = None
    received: int = 0
    sent: int = 0
    expired: bool = False  # the deadline (not a wait between two bytes) ended the request

    def remaining(self) -> float:
        """Seconds left before the deadline."""
        extra = (self.received + self.sent) / self.rate if self.rate else 0.0
        return self.start + self.seconds + extra - time.monotonic()

    def clamp(self, timeout: float | None, expired: type[Exception]) -> float:
        """``timeout`` cut to what is left; ``expired`` raised when nothing is."""
        left = self.remaining()
        if left <= 0:
            self.expired = True
            raise expired(f"no complete answer within the request's deadline ({self.seconds:g} s)")
        return left if timeout is None else min(timeout, left)

    def within(self, op: Callable[[float], _T], timeout: float | None, expired: type[Exception]) -> _T:
        """``op(timeout)``, the timeout cut to what is left; when ``op`` times out with nothing left, the budget has
        expired."""
        try:
            return op(self.clamp(timeout, expired))
        except expired:
            if self.remaining() <= 0.001:
                self.expired = True
            raise


_current: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("mtpquant_http_budget", default=None)


def _connect_timeout(timeout: float | None, expired: type[Exception]) -> float | None:
    """A connection's ``timeout`` cut to the current budget (none: as given)."""
    b = _current.get()
    return timeout if b is None else b.clamp(timeout, expired)


def current_budget() -> Budget | None:
    """The budget of the request this thread is making (or made last), if any."""
    return _current.get()


def start_budget(seconds: float, *, rate: float | None = None, limit: int | None = None) -> Budget:
    """Start a request's budget in this thread (it stays until the next one starts: the answer's body is read after
    the transport returns)."""
    b = Budget(time.monotonic(), seconds, rate, limit)
    _current.set(b)
    return b


@contextlib.contextmanager
def budget(seconds: float, *, rate: float | None = None, limit: int | None = None) -> Iterator[Budget]:
    """A budget for the requests made inside the block (a transport that starts its own replaces it per request)."""
    token = _current.set(Budget(time.monotonic(), seconds, rate, limit))
    try:
        b = _current.get()
        assert b is not None
        yield b
    finally:
        _current.reset(token)


def _network_backend() -> Any:
    """httpcore's own synchronous backend, every operation clamped to the current budget."""
    import httpcore

    class Stream(httpcore.NetworkStream):
        def __init__(self, inner: httpcore.NetworkStream) -> None:
            self._inner = inner

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            b = _current.get()
            if b is None:
                return self._inner.read(max_bytes, timeout)
            data = b.within(functools.partial(self._inner.read, max_bytes), timeout, httpcore.ReadTimeout)
            b.received += len(data)
            if b.limit is not None and b.received > b.limit:
                raise BoundExceededError(f"an answer larger than {b.limit} bytes")
            return data

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            b = _current.get()
            if b is None:
                self._inner.write(buffer, timeout)
                return
            b.within(functools.partial(self._inner.write, buffer), timeout, httpcore.WriteTimeout)
            b.sent += len(buffer)

        def close(self) -> None:
            self._inner.close()

        def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
            timeout = _connect_timeout(timeout, httpcore.ConnectTimeout)
            return Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))

        def get_extra_info(self, info: str) -> Any:
            return self._inner.get_extra_info(info)

    class Backend(httpcore.NetworkBackend):
        def __init__(self) -> None:
            self._inner = httpcore.SyncBackend()

        def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,
            local_address: str | None = None,
            socket_options: Any = None,
        ) -> httpcore.NetworkStream:
            timeout = _connect_timeout(timeout, httpcore.ConnectTimeout)
            return Stream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

        def connect_unix_socket(
            self, path: str, timeout: float | None = None, socket_options: Any = None
        ) -> httpcore.NetworkStream:
            timeout = _connect_timeout(timeout, httpcore.ConnectTimeout)
            return Stream(self._inner.connect_unix_socket(path, timeout, socket_options))

        def sleep(self, seconds: float) -> None:
            self._inner.sleep(seconds)

    return Backend()


@functools.cache
def transport_class() -> Any:
    """The ``httpx.HTTPTransport`` subclass whose socket operations are clamped to the current ``Budget`` (subclass
    it to start a budget per request in ``handle_request``)."""
    import httpx

    class Transport(httpx.HTTPTransport):
        """httpx's transport (request and response conversion, error mapping) over httpcore's connection pool with
        the budget-clamped network backend. httpx builds its pool in ``HTTPTransport.__init__`` from its arguments
        (``httpx/_transports/default.py``) and offers no argument for a network backend, so the pool is built again
        here with httpcore's public constructor and the same defaults."""

        def __init__(self) -> None:
            import httpcore

            super().__init__()
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
            self._pool = httpcore.ConnectionPool(
                ssl_context=httpx.create_ssl_context(),
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry,
                network_backend=_network_backend(),
            )

    return Transport


def bounded_transport() -> Any:
    """A new ``httpx.HTTPTransport`` whose every socket operation is clamped to the current ``Budget``."""
    return transport_class()()


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without ``user:password@``, and the (user, password) it carried, if any."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url, None
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    from urllib.parse import unquote

    return urlunsplit(parts._replace(netloc=hostport)), (unquote(user), unquote(password))


def public_url(url: str) -> str:
    """``url`` as it may be stored, logged or printed: without ``user:password@``."""
    return split_credentials(url)[0]


_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def scrub_credentials(text: str) -> str:
    """Free text (a library's error message) with ``user:password@`` removed from every URL in it."""
    return _URL_CREDENTIALS.sub(r"\1", text)
