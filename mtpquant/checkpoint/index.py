"""The shard index (``model.safetensors.index.json``): path safety and consistency checks.

Every check is classified by what the loaders (transformers, vLLM, SGLang) enforce. What they enforce, or
what makes loaders disagree about which tensors a checkpoint holds, is *fatal*: a shard the index names is
missing, a tensor is missing from its shard, a shard tensor is absent from the index, a tensor sits in two
shards, an unsafe shard name. What no loader reads is *advisory* (a warning, never a refusal):
``metadata.total_size`` (peers write it from file sizes, or as 0), shards the index does not reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from mtpquant.checkpoint.header import ShardHeader
from mtpquant.errors import CheckpointError

__all__ = [
    "ADVISORY_CODES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "Problem",
    "build_index",
    "check_shard_name",
    "parse_index",
    "validate_index",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


# Problem codes no loader enforces: reported as warnings, never a refusal.
ADVISORY_CODES = frozenset({"total_size", "stray_shard"})


@dataclass(frozen=True)
class Problem:
    """One integrity defect: a stable code and a one-line message naming file and tensor."""

    code: str
    message: str

    @property
    def fatal(self) -> bool:
        """Whether loaders enforce it (False: advisory, a warning at most)."""
        return self.code not in ADVISORY_CODES


def check_shard_name(name: Any, where: str = INDEX_NAME) -> str:
    """A shard name must be a plain relative path ending in ``.safetensors``, without ``..``."""
    ok = isinstance(name, str) and name.endswith(".safetensors") and "\\" not in name and "\x00" not in name
    if ok:
        p = PurePosixPath(name)
        ok = not p.is_absolute() and ".." not in p.parts and name == p.as_posix() and not name.startswith("/")
        ok = ok and not (len(name) > 1 and name[1] == ":")
    if not ok:
        raise CheckpointError(f"{where}: shard name {name!r} is not a relative .safetensors file name")
    return str(name)


def parse_index(raw: Any) -> tuple[dict[str, str], Any]:
    """The weight map and the declared ``metadata.total_size`` (as written) of an index, shard names checked."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("weight_map"), Mapping):
        raise CheckpointError(f"{INDEX_NAME}: no 'weight_map' object")
    weight_map: dict[str, str] = dict(raw["weight_map"])  # parsed JSON: the keys are strings
    try:
        shards = list(dict.fromkeys(weight_map.values()))  # a few dozen names for up to ~10^5 tensors, in order
    except TypeError:  # a value that is not even hashable: check_shard_name names it
        shards = list(weight_map.values())
    for shard in shards:
        check_shard_name(shard)
    meta = raw.get("metadata") or {}
    return weight_map, meta.get("total_size") if isinstance(meta, Mapping) else None


def validate_index(
    weight_map: Mapping[str, str],
    total_size: Any,
    headers: Mapping[str, ShardHeader],
    missing_shards: set[str],
) -> list[Problem]:
    """Every indexed name exists in its shard; every shard tensor is indexed; sizes add up."""
    problems: list[Problem] = []
    for shard in sorted(missing_shards):
        problems.append(Problem("missing_shard", f"{INDEX_NAME}: shard {shard!r} does not exist"))
    # Fast path (every intact checkpoint): the index maps exactly the tensors the headers hold, each to its shard,
    # and no name is in two shards; compared as whole dicts. Anything else is found and named entry by entry.
    held: dict[str, str] = {}
    count = 0
    for shard, header in headers.items():
        held.update(dict.fromkeys(header.tensors, shard))
        count += len(header.tensors)
    if missing_shards or count != len(held) or held != weight_map:
        problems += _mapping_problems(weight_map, headers)
    if total_size is not None and not missing_shards:
        # a parsed header's tensors tile its data region exactly (``header._check_layout``)
        actual = sum(h.file_size - h.data_start for h in headers.values())
        if _as_int(total_size) != actual:
            problems.append(
                Problem(
                    "total_size",
                    f"{INDEX_NAME}: metadata.total_size is {total_size!r} but the tensors hold {actual} bytes "
                    "(advisory: no loader reads it)",
                )
            )
    return problems


def _mapping_problems(weight_map: Mapping[str, str], headers: Mapping[str, ShardHeader]) -> list[Problem]:
    """Every disagreement between the index and the shard headers, one problem each."""
    problems: list[Problem] = []
    for tensor, shard in weight_map.items():
        header = headers.get(shard)
        if header is not None and tensor not in header.tensors:
            problems.append(
                Problem(
                    "missing_tensor",
                    f"{INDEX_NAME}: tensor {tensor!r} is mapped to {shard} but {shard} does not contain it",
                )
            )
    for shard, header in headers.items():
        for tensor in header.tensors:
            mapped = weight_map.get(tensor)
            if mapped is None:
                problems.append(
                    Problem("unindexed_tensor", f"{shard}: tensor {tensor!r} is not listed in {INDEX_NAME}")
                )
            elif mapped != shard:
                problems.append(
                    Problem(
                        "duplicate_tensor",
                        f"{shard}: tensor {tensor!r} also appears in {mapped}, where the index maps it",
                    )
                )
    return problems


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def build_index(headers: Mapping[str, ShardHeader], extra_metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An index for a set of shard headers; ``total_size`` is the sum of tensor bytes."""
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(headers):
        for name, entry in headers[shard].tensors.items():
            if name in weight_map:
                raise CheckpointError(f"{shard}: tensor {name!r} also appears in {weight_map[name]}")
            weight_map[name] = shard
            total += entry.nbytes
    metadata: dict[str, Any] = {"total_size": total, **(extra_metadata or {})}
    return {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
