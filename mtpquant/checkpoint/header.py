"""safetensors header parsing and validation, from the first bytes of a shard only.

The safetensors library reads headers too, but it neither exposes byte offsets nor explains
defects in terms a user can act on; both matter here (ranged reads, one-line errors). The format
is the library's: 8-byte little-endian header length, JSON header, contiguous data region.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from mtpquant.errors import CheckpointError

__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "ShardHeader", "TensorEntry", "parse_header", "tensor_nbytes"]

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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its shard header describes it; ``start``/``end`` are absolute file offsets."""

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
        n = 1
        for d in self.shape:
            n *= d
        return n


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


def parse_header(shard: str, header_bytes: bytes, file_size: int) -> ShardHeader:
    """Validate a header (the JSON after the 8-byte length) against the file size."""
    n = len(header_bytes)
    try:
        raw: Any = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{shard}: header is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{shard}: header is not a JSON object")
    data_start = 8 + n
    data_len = file_size - data_start
    metadata: dict[str, str] = {}
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise CheckpointError(f"{shard}: __metadata__ must map strings to strings")
            metadata = dict(info)
            continue
        tensors[name] = _entry(shard, name, info, data_start, data_len)
    _check_layout(shard, tensors, data_start, data_len)
    return ShardHeader(shard, file_size, data_start, metadata, tensors)


def _entry(shard: str, name: str, info: Any, data_start: int, data_len: int) -> TensorEntry:
    # Fast path for a well-formed entry (every header of a real checkpoint): the same checks as
    # ``_checked_entry`` with exact types and no per-entry message formatting. Anything unusual
    # (bools, subclasses, any defect) goes to ``_checked_entry``, which accepts or refuses it with
    # the one-line error; an entry returned here is exactly the one ``_checked_entry`` would return.
    if type(info) is dict:
        dtype: Any = info.get("dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
        if bits is not None and type(shape) is list and type(offsets) is list and len(offsets) == 2:
            begin, end = offsets
            if type(begin) is int and type(end) is int and 0 <= begin <= end <= data_len:
                n = 1
                for d in shape:
                    if type(d) is not int or d < 0:
                        break
                    n *= d
                else:
                    if end - begin == (n * bits + 7) // 8:
                        return TensorEntry(name, dtype, tuple(shape), shard, data_start + begin, data_start + end)
    return _checked_entry(shard, name, info, data_start, data_len)


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


_START_END = attrgetter("start", "end")


def _check_layout(shard: str, tensors: dict[str, TensorEntry], data_start: int, data_len: int) -> None:
    cursor = data_start
    previous = None
    for entry in sorted(tensors.values(), key=_START_END):
        if entry.start < cursor:
            raise CheckpointError(f"{shard}: tensors {previous!r} and {entry.name!r} overlap")
        if entry.start > cursor:
            raise CheckpointError(f"{shard}: {entry.start - cursor} bytes before tensor {entry.name!r} are unused")
        cursor, previous = entry.end, entry.name
    if cursor != data_start + data_len:
        raise CheckpointError(
            f"{shard}: file has {data_start + data_len - cursor} bytes after the last tensor"
            if cursor < data_start + data_len
            else f"{shard}: truncated: tensors need {cursor} bytes, the file has {data_start + data_len}"
        )
