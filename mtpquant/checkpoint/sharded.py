"""Tables a checkpoint stores in row shards: ``X.shard_{i}.weight`` (i = 0..n-1) for one ``X.weight``.

Qwen3.8-Flash-Next keeps each PLE n-gram embedding table (~95 GiB a layer at full size) as
``...ple.ple_embedding.ngram_embedding.shard_{i}.weight``; transformers concatenates the shards along the rows into
``ngram_embedding.weight`` when it loads the model, and vLLM accepts either form. mtpquant writes such a table as
the source's shards, byte for byte (convert), and builds the concatenated tensor where a model needs it (validate).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SHARD_INFIX", "sharded_tables"]

SHARD_INFIX = ".shard_"  # X.shard_{i}.weight: row shards of X.weight


def sharded_tables(src_names: Iterable[str]) -> dict[str, list[str]]:
    """``{"X.weight": [X.shard_0.weight, X.shard_1.weight, ...]}`` for every table the source stores only as row
    shards (shard order), e.g. ``...ple.ple_embedding.ngram_embedding``."""
    names = set(src_names)
    tables: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        stem, sep, rest = name.rpartition(SHARD_INFIX)
        index, dot, leaf = rest.partition(".")
        if sep and dot and index.isdigit() and leaf == "weight" and f"{stem}.weight" not in names:
            tables.setdefault(f"{stem}.weight", []).append((int(index), name))
    out = {}
    for table, shards in tables.items():
        shards.sort()
        if [i for i, _ in shards] == list(range(len(shards))):
            out[table] = [n for _, n in shards]
    return out
