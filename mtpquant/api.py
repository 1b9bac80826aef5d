"""The public Python API: everything the CLI does, as functions with typed options and results.

The CLI (``mtpquant.cli``) is a thin layer over this module and ``mtpquant.render`` (the text forms of the
results). Imports are lazy so that ``inspect`` and ``graft`` start without torch, transformers or modelopt.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ACTIVATION_MODES",
    "TINY_MTP_ASSET",
    "TINY_MTP_ASSETS",
    "TINY_VARIANTS",
    "ConvertOptions",
    "ConvertPlan",
    "ConvertResult",
    "GraftOptions",
    "GraftResult",
    "InspectReport",
    "PublishOptions",
    "PublishResult",
    "Report",
    "ValidateOptions",
    "ValidationReport",
    "builtin_recipe_names",
    "convert",
    "fix_metadata",
    "graft",
    "inspect_checkpoint",
    "make_tiny_checkpoint",
    "plan_convert",
    "publish",
    "validate",
]

_WHERE = {
    "ACTIVATION_MODES": "mtpquant.validate",
    "TINY_MTP_ASSET": "mtpquant.synth.train",
    "TINY_MTP_ASSETS": "mtpquant.synth.train",
    "TINY_VARIANTS": "mtpquant.synth.tiny",
    "ConvertOptions": "mtpquant.convert.plan",
    "ConvertPlan": "mtpquant.convert.plan",
    "plan_convert": "mtpquant.convert.plan",
    "builtin_recipe_names": "mtpquant.convert.recipes",
    "ConvertResult": "mtpquant.convert.run",
    "convert": "mtpquant.convert.run",
    "GraftOptions": "mtpquant.graft.run",
    "GraftResult": "mtpquant.graft.run",
    "graft": "mtpquant.graft.run",
    "fix_metadata": "mtpquant.graft.run",
    "InspectReport": "mtpquant.inspect.report",
    "inspect_checkpoint": "mtpquant.inspect.report",
    "make_tiny_checkpoint": "mtpquant.synth.tiny",
    "PublishOptions": "mtpquant.hub.publish",
    "PublishResult": "mtpquant.hub.publish",
    "publish": "mtpquant.hub.publish",
    "Report": "mtpquant.validate.schema",
    "ValidationReport": "mtpquant.validate.schema",
    "ValidateOptions": "mtpquant.validate.options",
    "validate": "mtpquant.validate.run",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mtpquant.api' has no attribute {name!r}")
