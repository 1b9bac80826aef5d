"""JSON from files and servers mtpquant does not control: bounded size, bounded nesting, one error type.

``json.loads`` of a document nested a few thousand levels deep raises ``RecursionError`` (a traceback, not a
message), and nothing stops a reader from taking in hundreds of MB. ``loads`` refuses both as ``ValueError``
(``json.JSONDecodeError`` and ``UnicodeDecodeError`` are ``ValueError`` too), so a caller catches one type and
words it as its own one-line error.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JsonLimitError", "loads"]


class JsonLimitError(ValueError):
    """A JSON document larger, or nested deeper, than mtpquant reads."""


def loads(data: bytes | bytearray | memoryview | str, *, limit: int | None = None) -> Any:
    """Parse ``data`` (UTF-8 when bytes); ``ValueError`` for invalid JSON, a document over ``limit`` bytes, or one
    nested deeper than the parser's recursion allows."""
    if limit is not None and len(data) > limit:
        raise JsonLimitError(f"larger than the {limit}-byte limit ({len(data)} bytes)")
    try:
        return json.loads(data if isinstance(data, str) else bytes(data).decode("utf-8"))
    except RecursionError:
        raise JsonLimitError("nested deeper than the JSON parser allows") from None
