"""A running vLLM OpenAI-compatible server, over HTTP (requests): version, models, completions, counters.

Every failure is one line naming the server: unreachable (connection refused, DNS, timeout), not a vLLM
server (no ``/version`` with a version, no vLLM metrics), an unexpected answer. mtpquant never imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtpquant.engine.counters import CounterSnapshot, parse_metrics
from mtpquant.engine.sampling import SamplingSettings
from mtpquant.errors import EngineAnswerError, EngineModelError, EngineUnreachableError

__all__ = ["Completion", "EngineClient", "ServerInfo"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself."""

    url: str
    version: str
    models: tuple[str, ...]
    max_model_len: int | None


@dataclass(frozen=True)
class Completion:
    """One greedy completion: the prompt's token ids and the generated ones."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str | None


class EngineClient:
    """Talks to one server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, timeout: float = 30.0, generate_timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.generate_timeout = generate_timeout
        import requests

        self._session = requests.Session()
        self._session.trust_env = False  # a local engine: never through a proxy from the environment

    # ---- transport ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None) -> Any:
        import requests

        try:
            resp = self._session.request(method, self.url + path, json=json, timeout=timeout or self.timeout)
        except requests.Timeout:
            wait = timeout or self.timeout
            raise EngineUnreachableError(f"{self.url}: no answer to {path} within {wait:g} s") from None
        except requests.ConnectionError as exc:
            raise EngineUnreachableError(f"{self.url}: cannot connect ({_reason(exc)})") from None
        except requests.RequestException as exc:
            raise EngineUnreachableError(f"{self.url}: {type(exc).__name__} on {path}") from None
        return resp

    def _json(self, path: str, *, payload: Any = None, timeout: float | None = None) -> Any:
        resp = self._request("POST" if payload is not None else "GET", path, json=payload, timeout=timeout)
        if resp.status_code != 200:
            detail = _detail(resp)
            raise EngineAnswerError(f"{self.url}{path}: HTTP {resp.status_code}{': ' + detail if detail else ''}")
        try:
            return resp.json()
        except ValueError:
            raise EngineAnswerError(
                f"{self.url}{path}: the answer is not JSON (is this a vLLM OpenAI server?)"
            ) from None

    # ---- endpoints ------------------------------------------------------------------------------
    def info(self) -> ServerInfo:
        """``/version`` and ``/v1/models``; refuses a server that is not vLLM."""
        try:
            version = self._json("/version")
        except EngineAnswerError:
            raise EngineAnswerError(
                f'{self.url}: not a vLLM server (no /version answering {{"version": ...}})'
            ) from None
        if not isinstance(version, dict) or not isinstance(version.get("version"), str):
            raise EngineAnswerError(f"{self.url}: not a vLLM server (/version answered {str(version)[:60]!r})")
        models = self._json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data:
            raise EngineAnswerError(f"{self.url}/v1/models: no model listed")
        ids = tuple(str(m.get("id")) for m in data if isinstance(m, dict))
        mml = data[0].get("max_model_len") if isinstance(data[0], dict) else None
        return ServerInfo(self.url, version["version"], ids, mml if isinstance(mml, int) else None)

    def resolve_model(self, info: ServerInfo, expected: str | None) -> str:
        """The model to ask for: ``expected`` (which must be served), or the only one served."""
        if expected is None:
            if len(info.models) != 1:
                served = ", ".join(info.models)
                raise EngineModelError(f"{self.url}: serves {len(info.models)} models ({served}); name one")
            return info.models[0]
        if expected not in info.models:
            raise EngineModelError(f"{self.url}: serves {', '.join(info.models)}, not {expected}")
        return expected

    def counters(self, model: str) -> CounterSnapshot:
        """The speculative-decoding counters of ``model`` now."""
        resp = self._request("GET", "/metrics")
        if resp.status_code != 200:
            raise EngineAnswerError(f"{self.url}/metrics: HTTP {resp.status_code}")
        try:
            snap = parse_metrics(resp.text, model)
        except ValueError as exc:
            raise EngineAnswerError(f"{self.url}/metrics: not Prometheus text ({exc})") from None
        if not snap.models:
            raise EngineAnswerError(f"{self.url}/metrics: no vllm:* metrics (is this a vLLM server?)")
        return snap

    def tokenize(self, model: str, text: str) -> list[int]:
        """The server's own tokenization of ``text`` (no special tokens), as the built-in path tokenizes."""
        body = self._json("/tokenize", payload={"model": model, "prompt": text, "add_special_tokens": False})
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineAnswerError(f"{self.url}/tokenize: no token list in the answer")
        return [int(t) for t in tokens]

    def complete(
        self,
        model: str,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        sampling: SamplingSettings | None = None,
        *,
        first_index: int = 0,
    ) -> list[Completion]:
        """Completions of token-id prompts (``ignore_eos``), one request each, sampled with ``sampling`` (default
        greedy); prompt i (counting from ``first_index``) carries the seed ``sampling.for_prompt(i)``."""
        return [
            self.complete_one(model, ids, n, (sampling or SamplingSettings()).for_prompt(first_index + i))
            for i, (ids, n) in enumerate(zip(prompts, max_tokens))
        ]

    def complete_one(
        self, model: str, prompt: Sequence[int], max_tokens: int, sampling: SamplingSettings
    ) -> Completion:
        """One ``/v1/completions`` request with token ids, ``ignore_eos`` and ``sampling``'s fields."""
        payload = {
            "model": model,
            "prompt": [int(i) for i in prompt],
            "max_tokens": int(max_tokens),
            "ignore_eos": True,
            "return_token_ids": True,
            **sampling.vllm_fields(),
        }
        body = self._json("/v1/completions", payload=payload, timeout=self.generate_timeout)
        try:
            choice = body["choices"][0]
            tokens = tuple(int(t) for t in choice["token_ids"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineAnswerError(
                f"{self.url}/v1/completions: no token_ids in the answer (vLLM >= 0.10 returns them)"
            ) from None
        return Completion(tuple(int(i) for i in prompt), tokens, choice.get("finish_reason"))


def _reason(exc: Exception) -> str:
    text = str(exc)
    for marker in ("Connection refused", "Name or service not known", "No route to host", "timed out"):
        if marker in text:
            return marker.lower()
    return type(exc).__name__


def _detail(resp: Any) -> str:
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
