"""graft's plan, decided from headers before anything is written: which shards are kept, rewritten or dropped,
which MTP tensors are added or replaced, the new index (with the right ``total_size``)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.index import INDEX_NAME, SINGLE_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.surgery.metadata import MetadataPlan

__all__ = ["Plan", "new_index", "plan_change", "strays", "total_size_fix", "weight_map_of"]


@dataclass(frozen=True)
class Plan:
    """The whole change, decided from headers before anything is written (``plan_change`` makes one)."""

    quant: Checkpoint
    weight_map: Mapping[str, str]  # QUANT's current map (implied for a single-file checkpoint)
    metadata: MetadataPlan  # the JSON changes, the index corrections' lines included
    link: tuple[str, ...] = ()  # shards kept as they are
    rewrite: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # shard -> tensors kept (MTP removed)
    drop: tuple[str, ...] = ()  # shards holding only the MTP being replaced
    add: tuple[str, ...] = ()  # MTP tensor names to write
    removed: tuple[str, ...] = ()  # QUANT's MTP tensors being replaced
    mtp_layers: int = 0
    index_fix: str | None = None  # QUANT's index declares a wrong total_size: the change line that corrects it
    lost: tuple[str, ...] = ()  # index entries of shards that do not exist (MTP only), dropped
    # MTP tensors in shards the index forgot, indexed as they are (the shard linked like any other): name -> entry
    adopted: Mapping[str, TensorEntry] = field(default_factory=dict)


def plan_change(
    quant: Checkpoint,
    metadata: MetadataPlan,
    *,
    add: Iterable[str] = (),
    removed: Iterable[str] = (),
    mtp_layers: int = 0,
    adopted: Mapping[str, TensorEntry] | None = None,
) -> Plan:
    """The change that writes ``add`` (new MTP tensors) in place of ``removed`` (QUANT's), with ``metadata``: which
    shards are linked, rewritten without the removed tensors or dropped, and the index corrections (a wrong
    ``total_size``; the entries of shards that do not exist), whose lines join the metadata's changes. ``adopted``:
    MTP tensors of a shard the index forgot, indexed as they are."""
    weight_map = weight_map_of(quant)
    gone = set(removed)
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in weight_map.items():
        by_shard[shard].append(name)
    link, drop, rewrite = [], [], {}
    for shard in sorted(by_shard):
        names = by_shard[shard]
        taken = [n for n in names if n in gone]
        if not taken:
            link.append(shard)
        elif len(taken) == len(names):
            drop.append(shard)
        else:
            rewrite[shard] = tuple(sorted(n for n in names if n not in gone))
    index_fix = total_size_fix(quant)
    changes = [index_fix] if index_fix is not None else []
    lost: list[str] = []
    for shard, names in quant.lost_tensors().items():
        lost += names
        changes.append(
            f"{INDEX_NAME}: the {len(names)} entries of {shard!r} (a shard that does not exist) dropped; SRC's MTP "
            "takes their place"
        )
    return Plan(
        quant,
        weight_map,
        dataclasses.replace(metadata, changes=(*metadata.changes, *changes)),
        tuple(link),
        rewrite,
        tuple(drop),
        tuple(sorted(add)),
        tuple(sorted(gone)),
        mtp_layers,
        index_fix,
        tuple(lost),
        dict(adopted or {}),
    )


def weight_map_of(ckpt: Checkpoint) -> dict[str, str]:
    """QUANT's index as graft keeps it: entries of a shard that does not exist (a lost MTP) are left out."""
    if ckpt.index is not None:
        return {str(k): str(v) for k, v in ckpt.index["weight_map"].items() if v in ckpt.headers}
    return dict.fromkeys(ckpt.tensors, SINGLE_NAME)


def total_size_fix(ckpt: Checkpoint) -> str | None:
    """The change line when QUANT's index declares a wrong ``metadata.total_size`` (None when it is right).

    No loader reads total_size (peers write it from file sizes, or as 0), so it is no reason to refuse;
    but what graft writes carries the right one.
    """
    if ckpt.index is None or not any(p.code == "total_size" for p in ckpt.problems):
        return None
    meta = ckpt.index.get("metadata")
    old = meta.get("total_size") if isinstance(meta, dict) else None
    return f"{INDEX_NAME}: metadata.total_size = {ckpt.total_bytes} (was {old!r})"


def strays(ckpt: Checkpoint, weight_map: Mapping[str, str]) -> list[str]:
    """Top-level ``*.safetensors`` files of ``ckpt`` its index does not reference."""
    referenced = set(weight_map.values())
    return sorted(
        f for f in ckpt.source.list_files() if f.endswith(".safetensors") and "/" not in f and f not in referenced
    )


def new_index(plan: Plan, mtp_entries: dict[str, TensorEntry], new_shard_of: dict[str, str]) -> dict[str, Any]:
    """QUANT's index with the replaced MTP entries removed and the new ones added; total_size updated."""
    removed = set(plan.removed)
    weight_map = {n: s for n, s in plan.weight_map.items() if n not in removed}
    weight_map.update(new_shard_of)
    total = sum(plan.quant.tensors[n].nbytes for n in weight_map if n not in new_shard_of)
    total += sum(mtp_entries[n].nbytes for n in new_shard_of)
    old = plan.quant.index or {}
    raw_meta = old.get("metadata")
    meta: dict[str, Any] = dict(raw_meta) if isinstance(raw_meta, dict) else {}
    metadata = {**meta, "total_size": total} if "total_size" in meta else {"total_size": total, **meta}
    index = {k: v for k, v in old.items() if k not in ("metadata", "weight_map")}
    # existing top-level key order kept; an index created here has build_index's layout
    out: dict[str, Any] = {}
    for key in [*list(old), "metadata", "weight_map"]:
        if key in out:
            continue
        if key == "metadata":
            out[key] = metadata
        elif key == "weight_map":
            out[key] = dict(sorted(weight_map.items()))
        else:
            out[key] = index[key]
    return out
