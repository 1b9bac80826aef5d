"""A checkpoint's tensors for evaluation, read header-first and dequantized per Linear by what its tensors are.

Weights are read through :class:`mtpquant.checkpoint.table.Checkpoint`, one tensor at a time, and dequantized
exactly per the formats (``mtpquant.formats``):

- BF16/FP16/FP32 tensors as they are (cast to the compute dtype; BF16 -> FP32 is exact);
- ModelOpt NVFP4: ``weight`` uint8 + ``weight_scale`` fp8 + ``weight_scale_2`` fp32;
- compressed-tensors NVFP4: ``weight_packed`` + ``weight_scale`` + ``weight_global_scale`` (reciprocal);
- FP8 per tensor (ModelOpt: ``weight`` fp8 + ``weight_scale`` fp32 scalar; per-channel scales too);
- FP8 blocks (Qwen: ``weight`` fp8 + ``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``).

The format is recognised per Linear from tensor names and dtypes alone, so MIXED_PRECISION checkpoints and
hand-made ones need no metadata.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import ConfigError, ValidateLoadError
from mtpquant.formats.kinds import SCALE_SUFFIXES, IncompleteKindError, StorageKind, block_shape, kind_of

__all__ = ["CheckpointWeights", "LinearFormat"]

log = logging.getLogger(__name__)

# KV-cache scales (modelopt ``k_proj.k_scale`` ...): not weights; the KV cache is not emulated.
_KV_SCALE_SUFFIXES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class LinearFormat:
    """How one Linear's weight is stored."""

    module: str
    kind: StorageKind  # resolved once, from the Linear's tensor names and dtypes (``formats.kinds.kind_of``)
    input_scale: float | None = None  # modelopt convention (compressed-tensors' reciprocal undone)
    has_pre_quant_scale: bool = False


def _split(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


class CheckpointWeights:
    """A dequantizing view of one checkpoint: logical (unquantized) tensor names to float tensors."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.spec = ckpt.spec
        self.formats: dict[str, LinearFormat] = {}
        # logical name -> stored name of its data tensor
        self._logical: dict[str, str] = {}
        self.skipped: list[str] = []
        self._analyse()

    @classmethod
    def open(cls, ref: str | Path) -> CheckpointWeights:
        """Open a local directory or Hub repo id header-first (index defects raise, naming the checkpoint: validate
        reads two)."""
        return cls(Checkpoint.open(ref, name_errors=True))

    @property
    def label(self) -> str:
        """Path or repo id."""
        return self.ckpt.label

    # ---- layout analysis ----------------------------------------------------------------------
    def _analyse(self) -> None:
        tensors = self.ckpt.tensors
        by_module: dict[str, set[str]] = defaultdict(set)
        for name in tensors:
            module, suffix = _split(name)
            by_module[module].add(suffix)
        block = self._block_size()
        for module, parts in by_module.items():
            kind = self._kind(module)
            if kind is not None:
                self.formats[module] = LinearFormat(
                    module,
                    kind,
                    self._input_scale(module, kind, parts),
                    "pre_quant_scale" in parts,
                )
                if kind.blocks:
                    self._check_block(module, kind, block)
        for name in tensors:
            module, suffix = _split(name)
            if suffix in _KV_SCALE_SUFFIXES:
                self.skipped.append(name)
                continue
            fmt = self.formats.get(module)
            if fmt is not None:
                if suffix == fmt.kind.data:
                    self._logical[f"{module}.weight"] = name
                elif suffix not in SCALE_SUFFIXES:
                    self._logical[name] = name
                continue
            if suffix in SCALE_SUFFIXES:
                # A scale next to a float weight: an exported leftover; engines reject it, we ignore it.
                self.skipped.append(name)
                continue
            self._logical[name] = name
        if self.skipped:
            log.info("%s: ignoring %d scale tensors of unquantized modules / KV cache", self.label, len(self.skipped))

    def _kind(self, module: str) -> StorageKind | None:
        try:
            kind = kind_of(self.ckpt.tensors, module, strict=True)
        except IncompleteKindError as exc:
            raise ValidateLoadError(f"{self.label}: {module}.{exc}") from None
        w = self.ckpt.tensors.get(f"{module}.weight")
        if kind is None and w is not None and w.dtype not in FLOAT_DTYPES:
            raise ValidateLoadError(f"{self.label}: {module}.weight has unsupported dtype {w.dtype}")
        return kind

    def _input_scale(self, module: str, kind: StorageKind, parts: set[str]) -> float | None:
        if kind.input_scale in parts:
            return kind.read_input_scale(self.ckpt.read_tensor, module)
        return None

    def _block_size(self) -> tuple[int, int]:
        qc = self.ckpt.config.get("quantization_config") or {}
        size = qc.get("weight_block_size") if isinstance(qc, dict) else None
        if isinstance(size, list) and len(size) == 2:
            return int(size[0]), int(size[1])
        return 128, 128

    def _check_block(self, module: str, kind: StorageKind, block: tuple[int, int]) -> None:
        scale_name = f"{module}.{kind.scales[0]}"
        got = tuple(self.ckpt.tensors[scale_name].shape)
        want = block_shape(tuple(self.ckpt.tensors[f"{module}.weight"].shape), got, block)
        if want is not None:
            raise ValidateLoadError(f"{self.label}: {scale_name} shape {got} does not fit blocks {block} (want {want})")

    # ---- queries ------------------------------------------------------------------------------
    def names(self, klass: str | None = None) -> list[str]:
        """Logical tensor names (optionally of one class: main / mtp / vision / embed / lm_head)."""
        names = sorted(self._logical)
        if klass is None:
            return names
        return [n for n in names if self.ckpt.classify(n) == klass]

    def has(self, name: str) -> bool:
        """Whether a logical tensor exists."""
        return name in self._logical

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a logical (dequantized) tensor."""
        stored = self.ckpt.tensors[self._logical[name]]
        module, _ = _split(name)
        fmt = self.formats.get(module)
        if fmt is not None and name == f"{module}.weight":
            return fmt.kind.logical_shape(tuple(stored.shape))
        return tuple(stored.shape)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, *, fold_pre_quant: bool = True) -> Tensor:
        """The logical tensor, dequantized exactly and cast to ``dtype``.

        ``fold_pre_quant`` multiplies an AWQ ``pre_quant_scale`` into the weight's columns (exact for
        unquantized activations); activation emulation applies it to the input instead.
        """
        stored = self._logical[name]
        module, _ = _split(name)
        fmt = self.formats.get(module)
        read = self.ckpt.read_tensor
        if fmt is None or name != f"{module}.weight":
            t = read(stored)
            return t.to(dtype) if t.is_floating_point() else t  # integer buffers (PLE hashing) keep their dtype
        w = fmt.kind.dequantize(read, module, self._block_size())
        if fmt.has_pre_quant_scale and fold_pre_quant:
            w = w * read(f"{module}.pre_quant_scale").float()
        return w.to(dtype)

    def pre_quant_scale(self, module: str) -> Tensor | None:
        """The AWQ input scale of a Linear, if the checkpoint has one."""
        fmt = self.formats.get(module)
        if fmt is None or not fmt.has_pre_quant_scale:
            return None
        return self.ckpt.read_tensor(f"{module}.pre_quant_scale").float()

    # ---- summaries ----------------------------------------------------------------------------
    def precision_summary(self) -> dict[str, dict[str, int]]:
        """Linear count per storage kind for each tensor class, e.g. ``{"mtp": {"bf16": 6, "nvfp4": 0}}``."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for name in self._logical:
            module, suffix = _split(name)
            if suffix != "weight" or len(self.shape(name)) < 2:
                continue
            klass = self.ckpt.classify(name)
            fmt = self.formats.get(module)
            kind = fmt.kind.name if fmt else self.ckpt.tensors[self._logical[name]].dtype.lower()
            out[klass][kind] += 1
        return {k: dict(v) for k, v in sorted(out.items())}

    @property
    def main_prefix(self) -> str:
        """The main-model tensor prefix (``model.language_model.`` or ``model.``)."""
        return self.ckpt.main_prefix

    def embed_name(self) -> str:
        """Logical name of ``embed_tokens.weight`` (Nemotron-H's ``backbone.embeddings.weight``)."""
        name = f"{self.main_prefix}embed_tokens.weight"
        other = f"{self.main_prefix}embeddings.weight"
        return other if not self.has(name) and self.has(other) else name

    def lm_head_name(self) -> str:
        """Logical name of the output head (the embeddings when tied and no ``lm_head.weight`` exists)."""
        if self.has("lm_head.weight"):
            return "lm_head.weight"
        if self.spec.tied_embeddings:
            return self.embed_name()
        raise ConfigError(f"{self.label}: lm_head.weight is missing and tie_word_embeddings is false")

    def embedding_and_head(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """The embedding and the LM head in ``dtype`` on ``device``: one tensor, read once, when they are tied."""
        embed = self.tensor(self.embed_name(), dtype).to(device)
        if self.lm_head_name() == self.embed_name():
            return embed, embed
        return embed, self.tensor(self.lm_head_name(), dtype).to(device)


# ---- activation emulation -------------------------------------------------------------------------
