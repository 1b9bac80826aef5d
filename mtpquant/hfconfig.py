"""config.json as transformers reads it: its config class's own validation, as a one-line error (exit 3).

transformers validates a config when it builds its config class (strict dataclasses: field types, ``layer_types``,
rope parameters, dtype names). A config it refuses would otherwise fail late and under another name: as a tokenizer
that cannot load (the tokenizer loader reads config.json), or a traceback when validate builds the target model.
Everything that hands a config to transformers goes through here first. (inspect does not import transformers: it
checks what it can without it, ``checkpoint.table``.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtpquant.errors import ConfigError

__all__ = ["refusal", "transformers_config"]


def refusal(exc: BaseException, where: str = "config.json") -> ConfigError:
    """The one line for a config transformers refused with ``exc``."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:2]) or type(exc).__name__
    text = text if len(text) <= 240 else text[:237] + "..."
    return ConfigError(f"{where}: transformers refuses it ({text})")


def transformers_config(config: Mapping[str, Any], cls: Any = None, where: str = "config.json") -> Any:
    """``config`` built into transformers' config class (``cls``, else the one its ``model_type`` names), or a
    ``ConfigError``; None when transformers does not know the model type (the family registry decides about that)."""
    from transformers import CONFIG_MAPPING

    if cls is None:
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            return None
        cls = CONFIG_MAPPING[model_type]
    try:
        return cls.from_dict(dict(config))
    except Exception as exc:  # transformers validates with many error types; each means "this config is invalid"
        raise refusal(exc, where) from None
