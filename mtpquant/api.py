"""The public Python API: everything the CLI does, as functions with typed options and results.

Imports are lazy so that ``inspect`` and ``graft`` start without torch, transformers or modelopt.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ConvertOptions",
    "GraftOptions",
    "PublishOptions",
    "ValidateOptions",
    "convert",
    "fix_metadata",
    "graft",
    "inspect_checkpoint",
    "make_tiny_checkpoint",
    "publish",
    "validate",
]

_WHERE = {
    "inspect_checkpoint": "mtpquant.inspect.report",
    "make_tiny_checkpoint": "mtpquant.synth.tiny",
    "convert": "mtpquant.convert.run",
    "ConvertOptions": "mtpquant.convert.run",
    "graft": "mtpquant.graft.run",
    "GraftOptions": "mtpquant.graft.run",
    "fix_metadata": "mtpquant.graft.run",
    "validate": "mtpquant.validate.run",
    "ValidateOptions": "mtpquant.validate.run",
    "publish": "mtpquant.hub.publish",
    "PublishOptions": "mtpquant.hub.publish",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mtpquant.api' has no attribute {name!r}")
