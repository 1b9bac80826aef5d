"""Test support shipped inside the package so tests, scripts and benchmarks can share it.

`mtpquant.testing.hubserver.LocalHub` is a stdlib-only HTTP server on 127.0.0.1 that serves model repos stored
as plain directories in the Hugging Face Hub's URL layout. Point the real `huggingface_hub` client at it with
`endpoint=hub.endpoint` (or `hub.client_env(...)`) to test Hub-facing code without network access and without
patching the client's HTTP behaviour.
"""

from __future__ import annotations

__all__ = ["LocalHub", "RequestRecord"]


def __getattr__(name: str) -> object:
    # Lazy so that `import mtpquant.testing` stays free of side effects.
    if name in __all__:
        from mtpquant.testing import hubserver

        return getattr(hubserver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
