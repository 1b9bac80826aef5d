"""The HTTP transport to one engine server: the one place every request to vLLM or SGLang goes through.

- **Bounded.** Each request has one overall deadline (``timeout``: from its start through the last byte of the
  answer, headers included; ``mtpquant.net.http``), so a server that drips its answer cannot hold a run; an answer
  is read streamed and refused past its byte cap (``JSON_CAP``, ``METRICS_CAP``); of an error answer only the first
  ``ERROR_CAP`` bytes are read. Answers are asked for unencoded (``Accept-Encoding: identity``) and an encoded one
  is refused, so a cap on the wire is a cap in memory.
- **Redirects** are followed only to the same server (scheme, host and port) and at most ``MAX_REDIRECTS`` times:
  a redirect to another host is refused, because following it would send the prompts there.
- **Credentials** never leave the transport: ``user:password@`` in the URL is removed from the URL every report and
  message uses (``url``) and sent as HTTP Basic auth instead; a server key (vLLM's and SGLang's ``--api-key``) comes
  from ``--api-key-file`` or ``MTPQUANT_ENGINE_API_KEY`` (``engine_api_key``) and is sent as ``Authorization:
  Bearer``, never logged or stored.
- No proxy from the environment (the server is one the user names, often 127.0.0.1).

Every failure is one line naming the server and the route: unreachable (connection refused, DNS failure, no
complete answer in time: exit 40), an error status or an answer that is not what the route gives (exit 41).
mtpquant never imports an engine.
"""

from __future__ import annotations

import json as jsonlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

from mtpquant.errors import EngineAnswerError, EngineUnreachableError, UsageError
from mtpquant.net.http import BoundExceededError, bounded_transport, budget, split_credentials

__all__ = [
    "API_KEY_ENV",
    "ERROR_CAP",
    "JSON_CAP",
    "MAX_REDIRECTS",
    "METRICS_CAP",
    "Answer",
    "EngineClientBase",
    "EngineHttp",
    "engine_api_key",
]

log = logging.getLogger(__name__)

API_KEY_ENV = "MTPQUANT_ENGINE_API_KEY"
JSON_CAP = 16 * 1024 * 1024  # an answer's bytes (completions of a few hundred tokens are a few KB)
METRICS_CAP = 16 * 1024 * 1024  # a /metrics page (vLLM's is ~100 KB per served model)
ERROR_CAP = 64 * 1024  # of an error answer, only this much is read (for its message)
MAX_REDIRECTS = 3
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class Answer:
    """A whole answer, read within its caps: status, headers and body bytes."""

    status_code: int
    content: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The body as text (UTF-8, undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` when it is not (nested too deeply included)."""
        from mtpquant.net.safejson import loads

        return loads(self.content)


def engine_api_key(path: Path | str | None) -> str | None:
    """The server key: the first line of ``path`` (``--api-key-file``), else ``MTPQUANT_ENGINE_API_KEY``, else None."""
    if path is not None:
        try:
            with Path(path).open("rb") as fh:
                raw = fh.read(4096)
        except OSError as exc:
            raise UsageError(f"{path}: cannot read the API key file ({exc.strerror})") from None
        key = raw.decode("utf-8", errors="replace").splitlines()[0].strip() if raw.strip() else ""
        if not key:
            raise UsageError(f"{path}: the API key file is empty")
        return key
    return os.environ.get(API_KEY_ENV, "").strip() or None
T = TypeVar("T")
R = TypeVar("R")


class EngineHttp:
    """Requests to the server at ``url`` (``http://host:port``); ``url`` as kept and printed has no credentials."""

    def __init__(self, url: str, *, timeout: float = 30.0, api_key: str | None = None) -> None:
        import httpx

        public, creds = split_credentials(url.rstrip("/"))
        self.url = public
        self.timeout = timeout
        self._given = (url, api_key)  # for clone(): the same server with the same credentials
        parts = urlsplit(public)
        self._origin = (parts.scheme, parts.hostname, parts.port)
        headers = {"Accept-Encoding": "identity"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.Client(
            transport=bounded_transport(),
            trust_env=False,
            follow_redirects=False,
            headers=headers,
            auth=httpx.BasicAuth(*creds) if creds and not api_key else None,
            timeout=timeout,
        )

    def clone(self) -> EngineHttp:
        """Another transport to the same server, with the same timeout and credentials (one per thread)."""
        url, api_key = self._given
        return EngineHttp(url, timeout=self.timeout, api_key=api_key)

    def _same_server(self, url: str) -> bool:
        parts = urlsplit(url)
        return (parts.scheme, parts.hostname, parts.port) == self._origin

    def request(
        self, method: str, path: str, *, json: Any = None, timeout: float | None = None, limit: int = JSON_CAP
    ) -> Answer:
        """The answer to one request (any status), within ``timeout`` seconds overall and ``limit`` bytes."""
        import httpx

        wait = timeout or self.timeout
        url = self.url + path
        body = None if json is None else jsonlib.dumps(json).encode("utf-8")
        try:
            with budget(wait, limit=limit + ERROR_CAP):  # the headers' bytes count too
                for _ in range(MAX_REDIRECTS + 1):
                    headers = {"Content-Type": "application/json"} if body is not None else None
                    with self._client.stream(method, url, content=body, headers=headers, timeout=wait) as resp:
                        if resp.status_code in _REDIRECTS and "location" in resp.headers:
                            target = urljoin(url, resp.headers["location"])
                            if not self._same_server(target):
                                other = urlsplit(target)
                                raise EngineAnswerError(
                                    f"{self.url}{path}: redirects to another server ({other.scheme}://"
                                    f"{other.hostname}{':' + str(other.port) if other.port else ''}); not followed "
                                    "(the request and its prompts would be sent there)"
                                )
                            url = target
                            if resp.status_code not in (307, 308):
                                method, body = "GET", None
                            continue
                        if resp.headers.get("content-encoding", "identity") not in ("identity", ""):
                            raise EngineAnswerError(
                                f"{self.url}{path}: the answer is {resp.headers['content-encoding']}-encoded "
                                "though an unencoded one was asked for; refused"
                            )
                        data = _read(resp, limit if resp.status_code == 200 else ERROR_CAP)
                        if data is None:
                            raise EngineAnswerError(f"{self.url}{path}: the answer is larger than {limit} bytes")
                        log.debug("%s %s%s -> %s", method, self.url, path, resp.status_code)
                        return Answer(resp.status_code, data, dict(resp.headers))
                raise EngineAnswerError(f"{self.url}{path}: more than {MAX_REDIRECTS} redirects")
        except BoundExceededError:
            raise EngineAnswerError(f"{self.url}{path}: the answer is larger than {limit} bytes") from None
        except httpx.TimeoutException:
            raise EngineUnreachableError(f"{self.url}: no answer to {path} within {wait:g} s") from None
        except httpx.ConnectError as exc:
            raise EngineUnreachableError(f"{self.url}: cannot connect ({_reason(exc)})") from None
        except httpx.HTTPError as exc:
            raise EngineUnreachableError(f"{self.url}: {type(exc).__name__} on {path}") from None

    def json(self, path: str, *, payload: Any = None, timeout: float | None = None, what: str = "an engine") -> Any:
        """The JSON body of a 200 answer (POST when ``payload`` is given); anything else is ``EngineAnswerError``."""
        resp = self.request("POST" if payload is not None else "GET", path, json=payload, timeout=timeout)
        if resp.status_code != 200:
            detail = _detail(resp)
            raise EngineAnswerError(f"{self.url}{path}: HTTP {resp.status_code}{': ' + detail if detail else ''}")
        try:
            return resp.json()
        except ValueError:
            raise EngineAnswerError(f"{self.url}{path}: the answer is not JSON (is this {what} server?)") from None

    def text(self, path: str, *, limit: int = METRICS_CAP) -> str | None:
        """The text of a 200 answer to GET ``path``; None for any other status."""
        resp = self.request("GET", path, limit=limit)
        return resp.text if resp.status_code == 200 else None

    def close(self) -> None:
        """Close the connections."""
        self._client.close()


class EngineClientBase:
    """What the vLLM and SGLang clients share: the transport to one server, the generation timeout, and the
    OpenAI-style ``POST /tokenize`` both engines serve."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        generate_timeout: float = 600.0,
        http: EngineHttp | None = None,
        api_key: str | None = None,
    ) -> None:
        self.http = http or EngineHttp(url, timeout=timeout, api_key=api_key)
        self.url = self.http.url
        self.generate_timeout = generate_timeout

    def each(self, items: Sequence[T], call: Callable[[EngineHttp, T], R], concurrency: int = 1) -> list[R]:
        """``call(http, item)`` for every item, in order, ``concurrency`` requests in flight at once (each worker
        thread with its own transport: a session is not shared between threads)."""
        if concurrency <= 1 or len(items) <= 1:
            return [call(self.http, item) for item in items]
        local = threading.local()
        made: list[EngineHttp] = []

        def work(item: T) -> R:
            if not hasattr(local, "http"):
                local.http = self.http.clone()
                made.append(local.http)
            return call(local.http, item)

        try:
            from concurrent.futures import ThreadPoolExecutor  # requests in flight together only: inspect never

            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                return list(pool.map(work, items))
        finally:
            for http in made:
                http.close()

    def listed_models(self, what: str) -> list[Any]:
        """``GET /v1/models``'s ``data`` list (``what``: the server kind its error names); refuses one listing none."""
        models = self.http.json("/v1/models", what=what)
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data:
            raise EngineAnswerError(f"{self.url}/v1/models: no model listed")
        return data

    def tokenize(self, model: str, text: str) -> list[int]:
        """The server's own tokenization of ``text`` without special tokens, as the built-in path tokenizes."""
        body = self.http.json("/tokenize", payload={"model": model, "prompt": text, "add_special_tokens": False})
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineAnswerError(f"{self.url}/tokenize: no token list in the answer")
        return [int(t) for t in tokens]


def _read(resp: Any, cap: int) -> bytes | None:
    """The body, streamed; None when it passes ``cap`` bytes (an error answer: its first ``cap`` bytes)."""
    declared = resp.headers.get("content-length", "")
    if resp.status_code == 200 and declared.isdigit() and int(declared) > cap:
        return None
    data = bytearray()
    for chunk in resp.iter_raw():
        data += chunk
        if len(data) > cap:
            if resp.status_code != 200:
                return bytes(data[:cap])
            return None
    return bytes(data)


def _reason(exc: Exception) -> str:
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "No route to host", "timed out"):
        if marker in text:
            return marker.lower()
    return type(exc).__name__


def _detail(resp: Answer) -> str:
    """The first line of an error answer's message (OpenAI ``error.message``, FastAPI ``detail``, ``message``)."""
    try:
        body = resp.json()
    except ValueError:
        return ""
    if isinstance(body, dict):
        err = body.get("error") or body.get("detail") or body.get("message")
        if isinstance(err, dict):
            err = err.get("message")
        if isinstance(err, str):
            return err.splitlines()[0][:200]
    return ""
