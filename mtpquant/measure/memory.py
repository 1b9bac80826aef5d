"""Where a quantized target goes when it is measured (torch-free): convert's memory plan (``runtime.memory``) of the
target dequantized in the compute dtype, in memory when it fits, else capped by ``--max-memory`` with the rest read
from its files as it runs (``measure.target.load_target``'s ``max_memory``). heal plans its target with it, and the
precision search (``convert --mtp auto``, ``tune-mtp``) plans the target it measures on with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from mtpquant.errors import MemoryPlanError
from mtpquant.families import TensorClass

if TYPE_CHECKING:
    from mtpquant.runtime.memory import Block, MemoryPlan

__all__ = ["plan_target_memory", "target_blocks"]

_TARGET = (TensorClass.MAIN, TensorClass.EMBED, TensorClass.LM_HEAD)


def target_blocks(
    shapes: Iterable[tuple[str, tuple[int, ...]]], classify: Callable[[str], str], dtype_bytes: int
) -> list[Block]:
    """The quantized target as the measurement loads it (dequantized, in the compute dtype), in convert's blocks:
    ``shapes`` gives each tensor's logical (dequantized) shape."""
    from mtpquant.runtime.memory import model_blocks

    entries = []
    for name, shape in shapes:
        if classify(name) not in _TARGET:
            continue
        n = 1
        for d in shape:
            n *= d
        entries.append((name, n * dtype_bytes))
    return model_blocks(entries, is_vision={})


def plan_target_memory(
    shapes: Iterable[tuple[str, tuple[int, ...]]],
    classify: Callable[[str], str],
    dtype_bytes: int,
    device: str,
    *,
    max_memory: str | None,
    shard_bytes: int,
    who: str = "heal",
) -> MemoryPlan:
    """Where the target goes (convert's memory plan: in memory when it fits, else capped by ``max_memory``, the rest
    on disk); ``shapes``: its tensors' logical shapes (``target_blocks``); ``who`` names the command in a refusal."""
    from mtpquant.runtime.memory import available_cpu_bytes, plan_memory

    blocks = target_blocks(shapes, classify, dtype_bytes)
    available = {"cpu": a} if (a := available_cpu_bytes()) is not None else {}
    try:
        return plan_memory(
            blocks,
            device="cpu" if device == "cpu" else "cuda",
            max_memory=max_memory,
            layerwise=False,
            shard_bytes=shard_bytes,
            available=available,
        )
    except MemoryPlanError as exc:
        raise MemoryPlanError(str(exc).replace("convert needs", f"{who} needs")) from None
