"""Which engine serves at a URL, and its client: the engines of the table (``engine/table.py``) probe in turn
(``PROBE_ORDER``), each through its module's ``probe``: TensorRT-LLM ``GET /prometheus/metrics`` with ``trtllm_``
metrics (asked first: its ``/version`` answers as vLLM's does), vLLM ``GET /version`` answering ``{"version": ...}``,
SGLang ``GET /get_server_info`` with its arguments and ``version``. Anything else is one line, exit 41; a server
that cannot be reached, exit 40.
"""

from __future__ import annotations

from mtpquant.engine.http import EngineHttp
from mtpquant.engine.server import EngineServer, ServerInfo
from mtpquant.engine.table import ENGINES, PROBE_ORDER
from mtpquant.engine.table import engine as engine_row
from mtpquant.errors import EngineAnswerError

__all__ = ["client_for", "connect"]


def client_for(engine: str, url: str, *, generate_timeout: float = 600.0) -> EngineServer:
    """The client of a server known to run ``engine`` (one mtpquant started)."""
    client: EngineServer = engine_row(engine).adapter.Client(url, generate_timeout=generate_timeout)
    return client


def connect(
    url: str, *, timeout: float = 30.0, generate_timeout: float = 600.0, api_key: str | None = None
) -> tuple[EngineServer, ServerInfo]:
    """The client of the server at ``url`` and what it says about itself (engine, version, models, settings); the URL
    each keeps has no credentials (``engine.http``), ``api_key`` goes with every request."""
    http = EngineHttp(url, timeout=timeout, api_key=api_key)
    for row in PROBE_ORDER:
        found: tuple[EngineServer, ServerInfo] | None = row.adapter.probe(http, generate_timeout)
        if found is not None:
            return found
    raise EngineAnswerError(f"{http.url}: " + " and ".join(row.adapter.PROBE_MISS for row in ENGINES))
