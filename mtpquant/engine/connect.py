"""Which engine serves at a URL: vLLM (``/version``) or SGLang (``/get_server_info``), and its client.

One probe each, vLLM's first: a vLLM server answers ``GET /version`` with ``{"version": ...}``; SGLang has no such
route (404) and answers ``GET /get_server_info`` with its arguments and ``version``. Anything else is one line,
exit 41; a server that cannot be reached, exit 40.
"""

from __future__ import annotations

from mtpquant.engine.http import EngineHttp
from mtpquant.engine.server import EngineServer, ServerInfo
from mtpquant.engine.sglang import SglangClient, sglang_settings
from mtpquant.engine.vllm import VllmClient, is_vllm
from mtpquant.errors import EngineAnswerError

__all__ = ["ENGINES", "client_for", "connect"]

ENGINES = ("vllm", "sglang")


def client_for(engine: str, url: str, *, generate_timeout: float = 600.0) -> VllmClient | SglangClient:
    """The client of a server known to run ``engine`` (one mtpquant started)."""
    if engine == "sglang":
        return SglangClient(url, generate_timeout=generate_timeout)
    return VllmClient(url, generate_timeout=generate_timeout)


def connect(
    url: str, *, timeout: float = 30.0, generate_timeout: float = 600.0, api_key: str | None = None
) -> tuple[EngineServer, ServerInfo]:
    """The client of the server at ``url`` and what it says about itself (engine, version, models, settings); the URL
    each keeps has no credentials (``engine.http``), ``api_key`` goes with every request."""
    http = EngineHttp(url, timeout=timeout, api_key=api_key)
    if is_vllm(http) is not None:
        vllm = VllmClient(http.url, generate_timeout=generate_timeout, http=http)
        return vllm, vllm.info()
    settings = sglang_settings(http)
    if settings is not None:
        sglang = SglangClient(http.url, generate_timeout=generate_timeout, http=http)
        return sglang, sglang.info_from(settings)
    raise EngineAnswerError(
        f'{http.url}: not a vLLM server (no /version answering {{"version": ...}}) and not an SGLang server '
        '(no /get_server_info answering {"version": ..., "model_path": ...})'
    )
