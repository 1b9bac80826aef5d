"""safetensors header parsing and validation, from the first bytes of a shard only.

The safetensors library reads headers too, but it neither exposes byte offsets nor explains
defects in terms a user can act on; both matter here (ranged reads, one-line errors). The format
is the library's: 8-byte little-endian header length, JSON header, contiguous data region.
"""

from __future__ import annotations

import gc
import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from operator import attrgetter
from typing import Any, NamedTuple

from mtpquant.errors import CheckpointError

__all__ = [
    "DTYPE_BITS",
    "FLOAT_DTYPES",
    "MAX_HEADER_BYTES",
    "ShardHeader",
    "TensorEntry",
    "bulk_parse",
    "parse_header",
    "tensor_nbytes",
]

# The unquantized float dtypes: a tensor stored in one of these holds its values as they are (BF16 / F16 / F32 / F64);
# every other dtype of a weight is a quantized or packed format.
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})

# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
}

# Same ceiling the safetensors library applies before it parses a header.
MAX_HEADER_BYTES = 100_000_000


class TensorEntry(NamedTuple):
    """One tensor as its shard header describes it; ``start``/``end`` are absolute file offsets.

    A named tuple: a fine-grained MoE quant has ~300,000 of them, and a tuple is the cheapest immutable record.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        """Number of elements."""
        return prod(self.shape)


@dataclass(frozen=True)
class ShardHeader:
    """A parsed shard header."""

    shard: str
    file_size: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes that ``dtype`` x ``shape`` occupy (sub-byte dtypes rounded up)."""
    n = 1
    for d in shape:
        n *= d
    return (n * DTYPE_BITS[dtype] + 7) // 8


def read_header_length(shard: str, first8: bytes, file_size: int) -> int:
    """Header length from the first 8 bytes, checked against the file size."""
    if file_size < 8 or len(first8) < 8:
        raise CheckpointError(f"{shard}: truncated file ({file_size} bytes): no safetensors header")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > file_size - 8:
        raise CheckpointError(f"{shard}: header length {n} is larger than the file ({file_size} bytes)")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{shard}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    return int(n)


@contextmanager
def bulk_parse() -> Iterator[None]:
    """The cyclic garbage collector paused while a table of many small objects is built (JSON headers and index,
    tensor entries): they hold no cycles, and the collector's passes over them cost more than building them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def parse_header(shard: str, header_bytes: bytes, file_size: int) -> ShardHeader:
    """Validate a header (the JSON after the 8-byte length) against the file size."""
    n = len(header_bytes)
    with bulk_parse():
        try:
            raw: Any = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{shard}: header is not valid JSON ({exc.__class__.__name__})") from None
        except RecursionError:
            raise CheckpointError(f"{shard}: header is nested deeper than the JSON parser allows") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{shard}: header is not a JSON object")
        data_start = 8 + n
        data_len = file_size - data_start
        metadata: dict[str, str] = {}
        info = raw.pop("__metadata__", None)
        if info is not None or "__metadata__" in raw:
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CheckpointError(f"{shard}: __metadata__ must map strings to strings")
            metadata = dict(info)
        tensors = _entries(shard, raw, data_start, data_len)
    _check_layout(shard, tensors, data_start, data_len)
    return ShardHeader(shard, file_size, data_start, metadata, tensors)


def _entries(shard: str, raw: dict[str, Any], data_start: int, data_len: int) -> dict[str, TensorEntry]:
    """Every entry of a header, checked. Fast path for a well-formed entry (every entry of a real checkpoint):
    the same checks as ``_checked_entry`` without per-entry calls or message formatting; anything unusual (bools,
    floats, any defect) goes to ``_checked_entry``, which accepts or refuses it with the one-line error. An entry
    made here is exactly the one ``_checked_entry`` would return (bool dimensions included: both accept them)."""
    bits_of = DTYPE_BITS.get
    make = tuple.__new__
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        # ``raw`` is parsed JSON: an entry that is not an object, a shape that is not a list, offsets that are not
        # a pair of integers all fail one of these lookups or type checks and take the checked path
        try:
            dtype = info["dtype"]
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            count = prod(shape)
            bits = bits_of(dtype) if type(dtype) is str else None
            ok = (
                bits is not None
                and type(begin) is int
                and type(end) is int
                and type(count) is int
                and 0 <= begin <= end <= data_len
                and end - begin == (count * bits + 7) // 8
                and (not shape or min(shape) >= 0)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if ok:
            tensors[name] = make(TensorEntry, (name, dtype, shape, shard, data_start + begin, data_start + end))
        else:
            tensors[name] = _checked_entry(shard, name, info, data_start, data_len)
    return tensors


def _checked_entry(shard: str, name: str, info: Any, data_start: int, data_len: int) -> TensorEntry:
    where = f"{shard}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] are not an increasing pair")
    if end > data_len:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes): truncated file?"
        )
    expected = tensor_nbytes(dtype, tuple(shape))
    if end - begin != expected:
        raise CheckpointError(f"{where}: holds {end - begin} bytes but {dtype} x {shape} needs {expected} bytes")
    return TensorEntry(name, dtype, tuple(shape), shard, data_start + begin, data_start + end)


def _check_layout(shard: str, tensors: dict[str, TensorEntry], data_start: int, data_len: int) -> None:
    """The tensors tile the data region exactly: no overlap, no gap, nothing after the last one."""
    # Bulk check: non-empty intervals tile [start, end of data) exactly iff their sorted starts begin at the start,
    # their sorted ends finish at the end, and each sorted start after the first equals the sorted end before it
    # (the interval with the largest start must take the largest end, and so on down). A zero-length tensor could
    # sit inside another one unseen, so any of those takes the ordered walk below, as does any defect (its message).
    starts = sorted(e.start for e in tensors.values())
    ends = sorted(e.end for e in tensors.values())
    end_of_data = data_start + data_len
    if not tensors:
        if data_len == 0:
            return
    elif (
        starts[0] == data_start
        and ends[-1] == end_of_data
        and starts[1:] == ends[:-1]
        and all(e.end > e.start for e in tensors.values())
    ):
        return
    cursor = data_start
    previous = None
    for entry in sorted(tensors.values(), key=_START_END):
        if entry.start < cursor:
            raise CheckpointError(f"{shard}: tensors {previous!r} and {entry.name!r} overlap")
        if entry.start > cursor:
            raise CheckpointError(f"{shard}: {entry.start - cursor} bytes before tensor {entry.name!r} are unused")
        cursor, previous = entry.end, entry.name
    if cursor != end_of_data:
        raise CheckpointError(
            f"{shard}: file has {end_of_data - cursor} bytes after the last tensor"
            if cursor < end_of_data
            else f"{shard}: truncated: tensors need {cursor} bytes, the file has {end_of_data}"
        )


_START_END = attrgetter("start", "end")
