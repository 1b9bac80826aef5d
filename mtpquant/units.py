"""Byte sizes: parsing ``5GB`` / ``500MiB`` and printing ``2.13 MB`` (decimal SI; one place for both)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["ByteSize", "format_bytes", "parse_bytes"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# GB = 10^9 and GiB = 2^30, as huggingface_hub's max_shard_size reads them.
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: str | int) -> int | None:
    """Bytes from ``5GB`` / ``500MiB`` / ``1000000`` or an int; None when it is not a size at all."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            return None
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    return size


@dataclass(frozen=True)
class ByteSize:
    """A positive byte count as written (``5GB``, ``500MiB``, ``1000000``) and its value, parsed once (``of``): the
    one rule for every size a user gives (--max-shard-size, --max-memory's, a recipe's ``output.max_shard_size``)."""

    text: str
    bytes: int

    @classmethod
    def of(cls, value: Any) -> ByteSize:
        """``value`` read as a size; ``ValueError`` saying what is wrong (the caller names where it came from)."""
        if isinstance(value, ByteSize):
            return value
        size = None
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):  # YAML may read a count as a number
            size = parse_bytes(value if isinstance(value, (str, int)) else str(value))
        if size is None:
            raise ValueError(f"{value!r} is not a size (for example 5GB, 500MiB or a byte count)")
        if size <= 0:
            raise ValueError(f"size must be positive, got {value!r}")
        return cls(str(value), size)


def format_bytes(n: int) -> str:
    """Bytes in decimal SI units, labelled as such (``B``, ``kB``, ``MB``, ``GB``, ``TB``), e.g. ``2.13 MB``.

    The one formatter: every size mtpquant prints goes through it. Decimal, as the Hub and ``max_shard_size``
    ("5GB") count.
    """
    if n < 1000:
        return f"{n} B"
    size = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        size /= 1000
        if size < 1000 or unit == "TB":
            return f"{size:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
