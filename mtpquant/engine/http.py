"""The HTTP transport to one engine server: the one place every request to vLLM or SGLang goes through.

A ``requests`` session that never uses a proxy from the environment (the server is one the user names, often
127.0.0.1), a timeout on every request, and every failure as a one-line error naming the server and the route:
unreachable (connection refused, DNS failure, no answer in time: exit 40), an error status or an answer that is
not what the route gives (exit 41). mtpquant never imports an engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from mtpquant.errors import EngineAnswerError, EngineUnreachableError

__all__ = ["EngineClientBase", "EngineHttp"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class EngineHttp:
    """Requests to the server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        import requests

        self._session = requests.Session()
        self._session.trust_env = False  # a server the user names: never through a proxy from the environment

    def request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None) -> Any:
        """The response to one request (any status); unreachable servers are ``EngineUnreachableError``."""
        import requests

        wait = timeout or self.timeout
        try:
            resp = self._session.request(method, self.url + path, json=json, timeout=wait)
        except requests.Timeout:
            raise EngineUnreachableError(f"{self.url}: no answer to {path} within {wait:g} s") from None
        except requests.ConnectionError as exc:
            raise EngineUnreachableError(f"{self.url}: cannot connect ({_reason(exc)})") from None
        except requests.RequestException as exc:
            raise EngineUnreachableError(f"{self.url}: {type(exc).__name__} on {path}") from None
        log.debug("%s %s%s -> %s", method, self.url, path, resp.status_code)
        return resp

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

    def text(self, path: str) -> str | None:
        """The text of a 200 answer to GET ``path``; None for any other status."""
        resp = self.request("GET", path)
        return str(resp.text) if resp.status_code == 200 else None


class EngineClientBase:
    """What the vLLM and SGLang clients share: the transport to one server, the generation timeout, and the
    OpenAI-style ``POST /tokenize`` both engines serve."""

    def __init__(
        self, url: str, *, timeout: float = 30.0, generate_timeout: float = 600.0, http: EngineHttp | None = None
    ) -> None:
        self.http = http or EngineHttp(url, timeout=timeout)
        self.url = self.http.url
        self.generate_timeout = generate_timeout

    def each(self, items: Sequence[T], call: Callable[[EngineHttp, T], R], concurrency: int = 1) -> list[R]:
        """``call(http, item)`` for every item, in order, ``concurrency`` requests in flight at once (each worker
        thread with its own transport: a session is not shared between threads)."""
        if concurrency <= 1 or len(items) <= 1:
            return [call(self.http, item) for item in items]
        local = threading.local()

        def work(item: T) -> R:
            if not hasattr(local, "http"):
                local.http = EngineHttp(self.url, timeout=self.http.timeout)
            return call(local.http, item)

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(work, items))

    def tokenize(self, model: str, text: str) -> list[int]:
        """The server's own tokenization of ``text`` without special tokens, as the built-in path tokenizes."""
        body = self.http.json("/tokenize", payload={"model": model, "prompt": text, "add_special_tokens": False})
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineAnswerError(f"{self.url}/tokenize: no token list in the answer")
        return [int(t) for t in tokens]


def _reason(exc: Exception) -> str:
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "No route to host", "timed out"):
        if marker in text:
            return marker.lower()
    return type(exc).__name__


def _detail(resp: Any) -> str:
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
