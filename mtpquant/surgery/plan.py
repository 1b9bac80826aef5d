"""graft's plan, decided from headers before anything is written: which shards are kept, rewritten or dropped,
which MTP tensors are added or replaced, the new index (with the right ``total_size``)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from mtpquant.checkpoint.header import TensorEntry
from mtpquant.checkpoint.index import INDEX_NAME, SINGLE_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.surgery.metadata import MetadataPlan

__all__ = ["Plan", "new_index", "plan_index_fix", "plan_shards", "strays", "total_size_fix", "weight_map_of"]


@dataclass
class Plan:
    """The whole change, decided from headers before anything is written."""

    quant: Checkpoint
    hfq: dict[str, Any] | None
    weight_map: dict[str, str]  # QUANT's current map (implied for a single-file checkpoint)
    link: list[str] = field(default_factory=list)  # shards kept as they are
    rewrite: dict[str, list[str]] = field(default_factory=dict)  # shard -> tensors kept (MTP removed)
    drop: list[str] = field(default_factory=list)  # shards holding only the MTP being replaced
    add: list[str] = field(default_factory=list)  # MTP tensor names to write
    removed: list[str] = field(default_factory=list)  # QUANT's MTP tensors being replaced
    strays: list[str] = field(default_factory=list)  # unreferenced *.safetensors in QUANT
    metadata: MetadataPlan = field(default_factory=MetadataPlan)
    mtp_layers: int = 0
    index_fix: str | None = None  # QUANT's index declares a wrong total_size: the change line that corrects it
    lost: list[str] = field(default_factory=list)  # index entries of shards that do not exist (MTP only), dropped
    # MTP tensors in shards the index forgot, indexed as they are (the shard linked like any other): name -> entry
    adopted: dict[str, TensorEntry] = field(default_factory=dict)


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


def strays(ckpt: Checkpoint, weight_map: dict[str, str]) -> list[str]:
    referenced = set(weight_map.values())
    return sorted(
        f for f in ckpt.source.list_files() if f.endswith(".safetensors") and "/" not in f and f not in referenced
    )


def plan_shards(plan: Plan, removed: set[str]) -> None:
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in plan.weight_map.items():
        by_shard[shard].append(name)
    for shard in sorted(by_shard):
        names = by_shard[shard]
        gone = [n for n in names if n in removed]
        if not gone:
            plan.link.append(shard)
        elif len(gone) == len(names):
            plan.drop.append(shard)
        else:
            plan.rewrite[shard] = sorted(n for n in names if n not in removed)


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


def plan_index_fix(plan: Plan) -> None:
    """Add the index corrections to the metadata changes: total_size (when QUANT's is wrong), and the entries of
    shards that do not exist (an MTP lost with its shards) removed."""
    plan.index_fix = total_size_fix(plan.quant)
    if plan.index_fix is not None:
        plan.metadata.changes.append(plan.index_fix)
    for shard, names in plan.quant.lost_tensors().items():
        plan.lost += names
        plan.metadata.changes.append(
            f"{INDEX_NAME}: the {len(names)} entries of {shard!r} (a shard that does not exist) dropped; SRC's MTP "
            "takes their place"
        )
