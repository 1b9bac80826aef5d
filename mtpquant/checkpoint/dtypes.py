"""Mapping between torch dtypes and safetensors dtype names, raw tensor bytes, and the two ways a tensor is planned
for a written shard: from memory (``planned``) or copied byte for byte from a checkpoint (``planned_copy``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtpquant.checkpoint.writer import PlannedTensor

if TYPE_CHECKING:
    import torch

    from mtpquant.checkpoint.header import TensorEntry
    from mtpquant.checkpoint.table import Checkpoint

__all__ = ["planned", "planned_copy", "st_dtype", "tensor_bytes", "torch_dtype"]


def _table() -> dict[str, torch.dtype]:
    import torch

    return {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "U16": torch.uint16,
        "U32": torch.uint32,
        "U64": torch.uint64,
    }


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    return _table()[name]


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype name of a torch dtype."""
    for k, v in _table().items():
        if v == dtype:
            return k
    raise ValueError(f"dtype {dtype} has no safetensors name")


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian raw bytes of a tensor, as safetensors stores them."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def planned(name: str, t: torch.Tensor) -> PlannedTensor:
    """A PlannedTensor whose bytes come from an in-memory tensor (on any device; 0-d tensors keep their shape)."""
    data = t.detach().cpu().contiguous()
    return PlannedTensor(name, st_dtype(data.dtype), tuple(data.shape), lambda: tensor_bytes(data))


def planned_copy(ckpt: Checkpoint, entry: TensorEntry) -> PlannedTensor:
    """A PlannedTensor that copies ``entry``'s stored bytes exactly: a local source in the kernel
    (``copy_file_range``), or through a buffer when the source watches the bytes (graft's checksums); a remote one
    through ranged reads, front to back."""
    local = ckpt.local_range(entry)
    order = None if local is not None else (entry.shard, entry.start)
    observe = ckpt.copy_observer(entry) if local is not None else None
    return PlannedTensor(entry.name, entry.dtype, entry.shape, lambda: ckpt.read_raw(entry), local, order, observe)
