"""Talking to the Hub over HTTP: one timeout, bounded retries that honour ``Retry-After``, ranged reads whose
length is checked, and every failure as a one-line error naming the repo, with its exit code.

Everything goes through huggingface_hub: its shared ``httpx`` client (``set_client_factory``), its URL and
header builders and its error types. What this module adds is what the client leaves open:

- **a deadline.** huggingface_hub's default client has no timeout, and some of its calls pass ``timeout=None``
  explicitly (the repo listing), so a server that accepts the connection and never answers hangs the
  process. The client's transport here (``mtpquant.net.http``) gives every request ``MTPQUANT_HUB_TIMEOUT``
  seconds (default 30) to connect and between bytes, and one overall deadline: the whole request, headers
  and body, must complete within that many seconds plus one second per ``MIN_RATE`` bytes it moves, so a
  server that drips its answer is cut off while a large download that makes progress is not.
- **byte caps.** An answer of the Hub's JSON API is read up to ``API_CAP`` bytes (and asked for unencoded,
  so the cap holds in memory), an error answer up to ``ERROR_CAP``: past it the request is refused.
- **ranged reads** (``read_range``): one GET with ``Range``, retried on 429/503 after the server's
  ``Retry-After`` (at most ``MAX_RETRIES`` times, each wait logged at INFO), the answer checked: a server
  that ignores ``Range`` (200 and the whole file) is refused after the first chunk, never read whole,
  and a body of the wrong length is an error.
- **error translation** (``hub_errors``): connection refused, DNS failure, time-outs, a connection broken
  mid-body and ``HF_HUB_OFFLINE`` are "unreachable" (exit 30); not found, private, gated and bad tokens
  are "no access" (31); HTTP errors, rate limits beyond the retries and answers that are not the Hub's
  JSON (a proxy or captive portal) are "refused" (32).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from mtpquant.errors import (
    HubAccessError,
    HubRefusedError,
    HubUnreachableError,
    MtpquantError,
    RangeIgnoredError,
    UsageError,
)
from mtpquant.net.http import (
    BoundExceededError,
    current_budget,
    public_url,
    scrub_credentials,
    start_budget,
    transport_class,
)

__all__ = [
    "API_CAP",
    "DEFAULT_TIMEOUT",
    "ERROR_CAP",
    "MAX_RETRIES",
    "MIN_RATE",
    "RangeIgnoredError",
    "configure_client",
    "hub_errors",
    "hub_timeout",
    "read_range",
    "request_count",
    "translate",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
MIN_RATE = 16 * 1024  # bytes a second: a request's deadline grows by 1 s for every 16 KiB it moves
API_CAP = 64 * 1024 * 1024  # bytes of one JSON answer of the Hub's API (a listing page, repo info)
ERROR_CAP = 1024 * 1024  # bytes of an answer with an error or redirect status (its message)
MAX_RETRIES = 3
_MAX_WAIT = 60.0  # longest Retry-After honoured; a longer one is reported instead of waited out
_RETRY_STATUS = (429, 503)
_configured: float | None = None
_requests = 0  # every request huggingface_hub's shared client has sent since configure_client (redirects too)


def hub_timeout() -> float:
    """Seconds to connect and between bytes read: ``MTPQUANT_HUB_TIMEOUT``, else 30; a value that is not a positive
    number of seconds is refused (UsageError), not replaced by the default unseen."""
    raw = os.environ.get("MTPQUANT_HUB_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise UsageError(f"MTPQUANT_HUB_TIMEOUT={raw!r}: not a positive number of seconds")
    return value


def request_count() -> int:
    """Requests sent by huggingface_hub's shared client so far (redirect hops included)."""
    return _requests


def _count(request: Any) -> None:
    del request
    global _requests
    _requests += 1


def configure_client() -> None:
    """Give huggingface_hub's shared client a transport that applies ``hub_timeout()`` (idempotent).

    The factory is process-wide: an embedding program's own huggingface_hub calls go through this transport too
    from the first mtpquant Hub call on (documented at ``mtpquant.api``)."""
    global _configured
    timeout = hub_timeout()
    if _configured == timeout:
        return
    import httpx
    from huggingface_hub import set_client_factory

    try:  # the client's own request hook (request ids in its debug log), when this version has it
        from huggingface_hub.utils._http import hf_request_event_hook

        hooks: dict[str, list[Any]] = {"request": [hf_request_event_hook, _count]}
    except ImportError:  # pragma: no cover - older/newer huggingface_hub
        hooks = {"request": [_count]}

    limits = httpx.Timeout(timeout).as_dict()

    class _Transport(transport_class()):  # type: ignore[misc]
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            given = request.extensions.get("timeout") or {}
            if all(v is None for v in given.values()):
                request.extensions["timeout"] = limits
            api = "/api/" in request.url.path  # the Hub's JSON answers (file reads are /resolve/)
            if api:
                request.headers["Accept-Encoding"] = "identity"  # a byte cap on the wire is a cap in memory
            spend = start_budget(timeout, rate=MIN_RATE, limit=API_CAP if api else None)
            response: httpx.Response = super().handle_request(request)
            if response.status_code >= 300:  # an error (or redirect) answer: its message, not a body to keep
                spend.limit = min(spend.limit or ERROR_CAP + spend.received, ERROR_CAP + spend.received)
            if api and response.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                response.close()
                encoding = response.headers["Content-Encoding"]
                raise BoundExceededError(f"an encoded answer ({encoding}) to {request.url.path}")
            return response

    def factory() -> httpx.Client:
        return httpx.Client(transport=_Transport(), event_hooks=hooks, follow_redirects=True, timeout=timeout)

    set_client_factory(factory)
    _configured = timeout


def _host(url: str | None) -> str:
    """The server of ``url`` as it may be printed: host and port, never ``user:password@``."""
    if not url:
        from huggingface_hub import constants

        url = constants.ENDPOINT
    try:
        parts = urlsplit(url)
        host = parts.hostname
        port = parts.port
    except ValueError:
        return "the Hub endpoint"
    if not host:
        return public_url(url)
    return f"{host}:{port}" if port else host


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return scrub_credentials(text.splitlines()[0]) if text else type(exc).__name__


def translate(exc: BaseException, label: str, what: str, endpoint: str | None = None) -> MtpquantError | None:
    """The one-line MtpquantError for a failure of huggingface_hub / httpx, or None if ``exc`` is not one."""
    import httpx
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    host = _host(endpoint)
    if isinstance(exc, MtpquantError):
        return exc
    if isinstance(exc, OfflineModeIsEnabled):
        return HubUnreachableError(f"{label}: HF_HUB_OFFLINE is set and {what} needs the Hub (not in the local cache)")
    if isinstance(exc, LocalEntryNotFoundError):
        # raised by downloads when the Hub cannot be reached (or offline mode) and the file is not cached
        cause = exc.__cause__ or exc.__context__
        inner = translate(cause, label, what, endpoint) if cause is not None else None
        if isinstance(inner, (HubUnreachableError, HubAccessError, HubRefusedError)):
            return inner
        return HubUnreachableError(f"{label}: {what}: cannot reach {host} and the file is not in the local cache")
    if isinstance(exc, GatedRepoError):
        return HubAccessError(
            f"{label}: gated repo: accept its conditions on its Hub page, then pass a token that has access "
            "(HF_TOKEN or `hf auth login`)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubAccessError(
            f"{label}: repository not found on {host}, or private and not readable with the token given "
            "(HF_TOKEN or `hf auth login`)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return HubAccessError(f"{label}: revision not found on {host}")
    if isinstance(exc, EntryNotFoundError):
        return HubAccessError(f"{label}: {what}: file not found on {host}")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            return HubAccessError(f"{label}: {what}: access denied by {host} (HTTP {status}); check the token")
        if status == 404:
            return HubAccessError(f"{label}: {what}: not found on {host} (HTTP 404)")
        if status == 429:
            return HubRefusedError(
                f"{label}: {what}: rate-limited by {host} (HTTP 429) beyond {MAX_RETRIES} retries; wait and "
                "rerun, or log in for a higher limit"
            )
        return HubRefusedError(f"{label}: {what}: {host} answered HTTP {status} ({_first_line(exc)})")
    if isinstance(exc, BoundExceededError):
        return HubRefusedError(f"{label}: {what}: {host} sent {exc}; refused")
    if isinstance(exc, httpx.TimeoutException):
        spent = current_budget()
        if spent is not None and spent.expired and spent.received:  # a stalled answer, not a silent server
            return HubUnreachableError(
                f"{label}: {what}: {host} did not complete its answer within {hub_timeout():g} s plus 1 s per "
                f"{MIN_RATE // 1024} KiB received (a stalled server; MTPQUANT_HUB_TIMEOUT sets the limit)"
            )
        return HubUnreachableError(
            f"{label}: {what}: no answer from {host} within {hub_timeout():g} s (MTPQUANT_HUB_TIMEOUT sets the limit)"
        )
    if isinstance(exc, httpx.ConnectError):
        return HubUnreachableError(f"{label}: cannot reach {host} ({_first_line(exc)})")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.NetworkError)):
        return HubUnreachableError(f"{label}: {what}: the connection to {host} broke off ({_first_line(exc)})")
    if isinstance(exc, json.JSONDecodeError):
        return HubRefusedError(
            f"{label}: {what}: {host} answered something that is not the Hub's JSON (a proxy, mirror or captive "
            "portal in the way?)"
        )
    if isinstance(exc, httpx.HTTPError):
        return HubUnreachableError(f"{label}: {what}: {host}: {_first_line(exc)}")
    return None


@contextlib.contextmanager
def hub_errors(label: str, what: str, endpoint: str | None = None) -> Iterator[None]:
    """Run a block of Hub calls; what fails leaves it as a one-line MtpquantError (``translate``)."""
    try:
        yield
    except MtpquantError:
        raise
    except Exception as exc:
        err = translate(exc, label, what, endpoint)
        if err is None:
            raise
        raise err from None


def _retry_wait(headers: Mapping[str, str], attempt: int) -> float:
    raw = (headers.get("Retry-After") or "").strip()
    if raw.isdigit():
        return float(raw)
    return float(min(2**attempt, 8))


def read_range(
    url: str, start: int, end: int, headers: Mapping[str, str], *, label: str, what: str
) -> tuple[bytes, int]:
    """Bytes ``[start, end)`` of ``url`` with one ranged GET (retried on 429/503); returns them and the number
    of requests made. The answer must be a 206 of exactly that length."""
    from huggingface_hub import get_session
    from huggingface_hub.utils import hf_raise_for_status

    configure_client()
    want = end - start
    requests = 0
    with hub_errors(label, what, url):
        for attempt in range(MAX_RETRIES + 1):
            requests += 1
            session = get_session()
            with session.stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end - 1}"}) as resp:
                if resp.status_code in _RETRY_STATUS and attempt < MAX_RETRIES:
                    wait = _retry_wait(resp.headers, attempt)
                    if wait > _MAX_WAIT:
                        raise HubRefusedError(
                            f"{label}: {what}: {_host(url)} asks to wait {wait:g} s (HTTP {resp.status_code}, "
                            "Retry-After); rerun later"
                        )
                    log.info(
                        "%s: %s: %s answered HTTP %d; waiting %g s (%s) before retry %d of %d",
                        label, what, _host(url), resp.status_code, wait,
                        "Retry-After" if resp.headers.get("Retry-After") else "backoff", attempt + 1, MAX_RETRIES,
                    )
                    time.sleep(wait)
                    continue
                if resp.status_code == 200:
                    size = resp.headers.get("Content-Length", "?")
                    raise RangeIgnoredError(
                        f"{label}: {what}: {_host(url)} ignores HTTP Range requests (it answered the whole "
                        f"{size}-byte file to a read of {want} bytes); mtpquant reads only the headers and tensors "
                        "it needs: use a server that honours Range, or download the repo and pass its directory"
                    )
                if resp.status_code != 206:
                    resp.read()
                    hf_raise_for_status(resp)
                    raise HubRefusedError(f"{label}: {what}: {_host(url)} answered HTTP {resp.status_code}")
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > want:
                        break
                if len(data) != want:
                    raise HubRefusedError(
                        f"{label}: {what}: {_host(url)} sent {len(data)} bytes for a range of {want} "
                        f"(bytes {start}-{end - 1})"
                    )
                return bytes(data), requests
    raise AssertionError("unreachable")  # pragma: no cover
