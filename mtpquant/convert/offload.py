"""Disk offload of the weights transformers builds from several SRC tensors while loading (the MoE experts it
fuses, the row-sharded tables it concatenates), read from SRC's own files (no re-save).

transformers 5.x fuses a per-expert checkpoint (Qwen3-Next: ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``)
into the 3-D ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` while loading. A fused weight that goes to
disk has no tensor in SRC to point at, so transformers re-saves it into the offload folder: a copy of most of
an MoE model, written once. ``fused_offload`` records instead where its pieces lie in SRC (an extra kind of entry
in transformers' offload index) and ``FusedWeightsLoader`` (accelerate's ``OffloadedWeightsLoader``, the one
``weights_map`` behind every offload hook) builds the weight from them whenever a hook needs it: per expert the
gate rows then the up rows, experts stacked in order, cast to the dtype transformers chose. That is what
transformers' converter computes (stack, then concatenate: copies), so the bytes are the same, and the
capped-memory tests compare every output tensor with the in-memory convert's.

Qwen3.8-Flash-Next's PLE n-gram tables (``ngram_embedding.shard_{i}.weight``, ~95 GiB a layer at full size) are
the other case: transformers concatenates the shards into ``ngram_embedding.weight``; an offloaded table is recorded
as its shards (``ROWS_ENTRY``) and concatenated on read, never re-saved.

transformers has no public switch for this: the one function it calls to offload a converted weight
(``transformers.core_model_loading.offload_and_maybe_resave_param``) is replaced for the duration of
``from_pretrained`` and restored after. A weight this module cannot describe (another layout, a missing expert)
goes to transformers' own re-save, as before.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils.offload import OffloadedWeightsLoader

from mtpquant.checkpoint.sharded import sharded_tables
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.families import FUSED_EXPERT_PIECES
from mtpquant.runtime.memory import release_file_pages

__all__ = [
    "FUSED_ENTRY",
    "ROWS_ENTRY",
    "FusedWeightsLoader",
    "fused_entry",
    "fused_offload",
    "install_fused_loader",
    "rows_entry",
]

log = logging.getLogger(__name__)

FUSED_ENTRY = "mtpquant_fused_experts"  # offload-index key: per expert, the (file, tensor) pieces in SRC
ROWS_ENTRY = "mtpquant_row_shards"  # offload-index key: the (file, tensor) row shards of a table in SRC, in order

_FUSED = re.compile(r"^(?P<stem>.+\.experts)\.(?P<proj>" + "|".join(FUSED_EXPERT_PIECES) + ")$")


def fused_entry(target: str, param: torch.Tensor, ckpt: Checkpoint, src_dir: Path) -> dict[str, Any] | None:
    """The offload-index entry that rebuilds fused experts weight ``target`` (built as ``param``) from SRC's
    per-expert tensors, or None when SRC does not hold exactly those pieces with matching shapes."""
    m = _FUSED.match(target)
    if m is None or param.dim() != 3:
        return None
    experts = int(param.shape[0])
    pieces = FUSED_EXPERT_PIECES[m["proj"]]
    if f"{m['stem']}.{experts}.{pieces[0]}.weight" in ckpt.tensors:
        return None  # more experts in SRC than in the fused weight
    layout: list[list[list[str]]] = []
    for e in range(experts):
        entries = [ckpt.tensors.get(f"{m['stem']}.{e}.{p}.weight") for p in pieces]
        if any(x is None or len(x.shape) != 2 for x in entries):
            return None
        rows = sum(x.shape[0] for x in entries if x is not None)
        if any(x is not None and x.shape[1] != param.shape[2] for x in entries) or rows != param.shape[1]:
            return None
        layout.append([[str(src_dir / x.shard), x.name] for x in entries if x is not None])
    return {FUSED_ENTRY: layout, "dtype": str(param.dtype).removeprefix("torch.")}


def rows_entry(target: str, param: torch.Tensor, ckpt: Checkpoint, src_dir: Path) -> dict[str, Any] | None:
    """The offload-index entry that rebuilds table ``target`` from SRC's row shards (``X.shard_{i}.weight``), or
    None when SRC does not store it that way with matching shapes."""
    shards = sharded_tables(ckpt.tensors).get(target)
    if not shards:
        return None
    entries = [ckpt.tensors[n] for n in shards]
    rows = sum(e.shape[0] for e in entries)
    if rows != param.shape[0] or any(tuple(e.shape[1:]) != tuple(param.shape[1:]) for e in entries):
        return None
    pieces = [[str(src_dir / e.shard), e.name] for e in entries]
    return {ROWS_ENTRY: pieces, "dtype": str(param.dtype).removeprefix("torch.")}


def _build(entry: dict[str, Any], device: Any) -> torch.Tensor:
    """The weight ``entry`` describes, copied piece by piece into one tensor (what transformers' converter computes:
    per expert the pieces' rows concatenated, experts stacked; the row shards concatenated), the pages of SRC each
    piece was read from given back after each expert (safetensors reads through a mapping of the whole file): the
    build holds the weight once, not its pieces and a stacked copy beside it (2.95 GB more for a GLM-4.5-Air
    layer's ``gate_up_proj``)."""
    from safetensors import safe_open

    dtype = getattr(torch, entry["dtype"])
    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}

        def handle(file: str) -> Any:
            if file not in files:
                files[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            return files[file]

        groups = [entry[ROWS_ENTRY]] if ROWS_ENTRY in entry else entry[FUSED_ENTRY]
        shapes = [[handle(f).get_slice(n).get_shape() for f, n in group] for group in groups]
        rows, rest = sum(s[0] for s in shapes[0]), shapes[0][0][1:]
        fused = torch.empty((len(groups), rows, *rest) if FUSED_ENTRY in entry else (rows, *rest), dtype=dtype)
        for g, group in enumerate(groups):
            out = fused[g] if FUSED_ENTRY in entry else fused
            at = 0
            for f, n in group:
                piece = handle(f).get_tensor(n)
                out[at : at + piece.shape[0]].copy_(piece)
                at += piece.shape[0]
                del piece
            release_file_pages(files)
    return fused if device is None else fused.to(device)


class FusedWeightsLoader(OffloadedWeightsLoader):
    """accelerate's loader, plus entries that fuse experts from SRC's per-expert tensors on every read."""

    @classmethod
    def over(cls, base: OffloadedWeightsLoader) -> FusedWeightsLoader:
        """A loader over the same state dict, folder, index and device as accelerate's ``base``."""
        return cls(state_dict=base.state_dict, save_folder=base.save_folder, index=base.index, device=base.device)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.state_dict:  # modelopt's write-backs and accelerate's own state dict come first
            info = self.index.get(key)
            if isinstance(info, dict) and (FUSED_ENTRY in info or ROWS_ENTRY in info):
                return _build(info, self.device)
        tensor: torch.Tensor = super().__getitem__(key)
        return tensor


@contextlib.contextmanager
def fused_offload(ckpt: Checkpoint, src_dir: Path) -> Iterator[list[str]]:
    """While transformers loads from ``src_dir``, offloaded fused experts are recorded, not re-saved; yields the
    names recorded (``install_fused_loader`` must then run on the loaded model)."""
    import transformers.core_model_loading

    loading: Any = transformers.core_model_loading
    shards = [str(src_dir / shard) for shard in ckpt.shards]
    recorded: list[str] = []
    original = getattr(loading, "offload_and_maybe_resave_param", None)
    converter = getattr(loading, "WeightConverter", None)
    if original is None or converter is None:
        log.info("this transformers has no offload hook point: fused experts that go to disk are re-saved")
        yield recorded
        return

    def offload(target: str, param: torch.Tensor, info: Any, folder: str, index: dict[str, Any], ops: Any) -> Any:
        entry = None
        if isinstance(ops, converter):
            entry = fused_entry(target, param, ckpt, src_dir) or rows_entry(target, param, ckpt, src_dir)
        if entry is None:
            return original(target, param, info, folder, index, ops)
        info.missing_keys.discard(target)
        index[target] = entry
        recorded.append(target)
        # the pieces just fused were read through transformers' mappings of SRC, which live as long as the model:
        # give their pages back now, or each offloaded MoE layer's experts stay in RSS through the whole load
        release_file_pages(shards)
        return index

    loading.offload_and_maybe_resave_param = offload
    try:
        yield recorded
    finally:
        loading.offload_and_maybe_resave_param = original


def install_fused_loader(model: Any, recorded: list[str]) -> None:
    """Put ``FusedWeightsLoader`` behind every offload hook of ``model`` whose index holds recorded entries."""
    if not recorded:
        return
    from accelerate.hooks import SequentialHook
    from accelerate.utils.offload import PrefixedDataset

    replaced: dict[int, Any] = {}

    def swap(loader: Any) -> Any:
        if type(loader) is not OffloadedWeightsLoader or not any(name in loader.index for name in recorded):
            return loader
        return replaced.setdefault(id(loader), FusedWeightsLoader.over(loader))

    for module in model.modules():
        hook: Any = getattr(module, "_hf_hook", None)
        for h in hook.hooks if isinstance(hook, SequentialHook) else [hook]:
            weights_map = getattr(h, "weights_map", None)
            if isinstance(weights_map, PrefixedDataset):
                weights_map.dataset = swap(weights_map.dataset)
            elif isinstance(weights_map, OffloadedWeightsLoader):
                h.weights_map = swap(weights_map)
    if not replaced:
        raise RuntimeError(f"internal: {len(recorded)} fused expert weights offloaded, but no offload hook reads them")
    log.info("%d fused expert weights are read from SRC's per-expert tensors when used (not re-saved)", len(recorded))
