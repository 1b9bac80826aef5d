"""The MTP's own shards: one deterministic layout shared by convert (keep/extract) and graft.

Tensors are sorted by name and split greedily under the byte budget into
``mtp-00001-of-0000N.safetensors`` with ``{"format": "pt"}`` metadata, each tensor's bytes copied
exactly as stored in the source. Because the layout depends only on the names, their bytes and the
budget, ``convert --mtp extract`` followed by ``graft`` writes the same MTP shard files, byte for
byte, as ``convert --mtp keep``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mtpquant.checkpoint.dtypes import planned_copy
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor

__all__ = ["MTP_SHARD_METADATA", "MTP_SHARD_PATTERN", "mtp_planned_tensors", "write_mtp_shards", "write_planned_mtp"]

MTP_SHARD_PATTERN = "mtp-{index:05d}-of-{count:05d}.safetensors"
MTP_SHARD_METADATA = {"format": "pt"}


def mtp_planned_tensors(ckpt: Checkpoint, names: Iterable[str] | None = None) -> list[PlannedTensor]:
    """Planned copies of the MTP tensors of ``ckpt`` (all of them by default), sorted by name."""
    chosen = sorted(names) if names is not None else [e.name for e in ckpt.mtp_tensors()]
    ckpt.prefetch(chosen)  # a remote source reads adjacent tensors in one request
    return [planned_copy(ckpt, ckpt.tensors[n]) for n in chosen]


def write_planned_mtp(od: OutputDir, tensors: Sequence[PlannedTensor], max_bytes: int) -> list[str]:
    """Write already-planned MTP tensors (sorted by name here) as ``mtp-*`` shards; returns their names."""
    ordered = sorted(tensors, key=lambda t: t.name)
    if not ordered:
        return []
    return od.write_shards(ordered, max_bytes=max_bytes, pattern=MTP_SHARD_PATTERN, metadata=MTP_SHARD_METADATA)


def write_mtp_shards(od: OutputDir, ckpt: Checkpoint, names: Iterable[str] | None, max_bytes: int) -> list[str]:
    """Copy MTP tensors byte for byte from ``ckpt`` into ``mtp-*`` shards of ``od``; returns the shard names."""
    return write_planned_mtp(od, mtp_planned_tensors(ckpt, names), max_bytes)
