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
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import ConfigError, ValidateLoadError
from mtpquant.formats.fp8 import dequantize_fp8_block, dequantize_fp8_per_tensor
from mtpquant.formats.nvfp4 import dequantize_nvfp4, from_compressed_tensors

__all__ = ["CheckpointWeights", "LinearFormat"]

log = logging.getLogger(__name__)

_SCALE_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "pre_quant_scale",
)
# KV-cache scales (modelopt ``k_proj.k_scale`` ...): not weights; the KV cache is not emulated.
_KV_SCALE_SUFFIXES = ("k_scale", "v_scale")


@dataclass(frozen=True)
class LinearFormat:
    """How one Linear's weight is stored."""

    module: str
    kind: str  # nvfp4 | nvfp4-ct | fp8 | fp8-block
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
        by_module: dict[str, dict[str, str]] = defaultdict(dict)
        for name, entry in tensors.items():
            module, suffix = _split(name)
            by_module[module][suffix] = entry.dtype
        block = self._block_size()
        for module, parts in by_module.items():
            kind = self._kind(module, parts)
            if kind is not None:
                self.formats[module] = LinearFormat(
                    module,
                    kind,
                    self._input_scale(module, parts),
                    "pre_quant_scale" in parts,
                )
                if kind == "fp8-block":
                    self._check_block(module, block)
        for name in tensors:
            module, suffix = _split(name)
            if suffix in _KV_SCALE_SUFFIXES:
                self.skipped.append(name)
                continue
            if module in self.formats:
                if suffix in ("weight", "weight_packed"):
                    self._logical[f"{module}.weight"] = name
                elif suffix not in _SCALE_SUFFIXES:
                    self._logical[name] = name
                continue
            if suffix in _SCALE_SUFFIXES:
                # A scale next to a float weight: an exported leftover; engines reject it, we ignore it.
                self.skipped.append(name)
                continue
            self._logical[name] = name
        if self.skipped:
            log.info("%s: ignoring %d scale tensors of unquantized modules / KV cache", self.label, len(self.skipped))

    def _kind(self, module: str, parts: dict[str, str]) -> str | None:
        w = parts.get("weight")
        if "weight_packed" in parts:
            if "weight_global_scale" not in parts or "weight_scale" not in parts:
                raise ValidateLoadError(f"{self.label}: {module}.weight_packed without its scales")
            return "nvfp4-ct"
        if w == "U8":
            if parts.get("weight_scale") != "F8_E4M3" or "weight_scale_2" not in parts:
                raise ValidateLoadError(
                    f"{self.label}: {module}.weight is uint8 but weight_scale (fp8) / weight_scale_2 are missing"
                )
            return "nvfp4"
        if w == "F8_E4M3":
            if "weight_scale_inv" in parts:
                return "fp8-block"
            if "weight_scale" in parts:
                shape = self.ckpt.tensors[f"{module}.weight_scale"].shape
                wshape = self.ckpt.tensors[f"{module}.weight"].shape
                if len(shape) == 2 and shape[-1] > 1 and len(wshape) == 2:
                    return "fp8-block"
                return "fp8"
            raise ValidateLoadError(f"{self.label}: {module}.weight is fp8 but has no weight_scale / weight_scale_inv")
        if w is not None and w not in FLOAT_DTYPES:
            raise ValidateLoadError(f"{self.label}: {module}.weight has unsupported dtype {w}")
        return None

    def _input_scale(self, module: str, parts: dict[str, str]) -> float | None:
        if "input_scale" in parts:
            return float(self.ckpt.read_tensor(f"{module}.input_scale").float().max())
        if "input_global_scale" in parts:
            return float(1.0 / self.ckpt.read_tensor(f"{module}.input_global_scale").float().max())
        return None

    def _block_size(self) -> tuple[int, int]:
        qc = self.ckpt.config.get("quantization_config") or {}
        size = qc.get("weight_block_size") if isinstance(qc, dict) else None
        if isinstance(size, list) and len(size) == 2:
            return int(size[0]), int(size[1])
        return 128, 128

    def _check_block(self, module: str, block: tuple[int, int]) -> None:
        rows, cols = self.ckpt.tensors[f"{module}.weight"].shape
        scale_name = self._scale_name(module)
        got = tuple(self.ckpt.tensors[scale_name].shape)
        want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if got != want:
            raise ValidateLoadError(f"{self.label}: {scale_name} shape {got} does not fit blocks {block} (want {want})")

    def _scale_name(self, module: str) -> str:
        inv = f"{module}.weight_scale_inv"
        return inv if inv in self.ckpt.tensors else f"{module}.weight_scale"

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
        if fmt is not None and fmt.kind in ("nvfp4", "nvfp4-ct") and name == f"{module}.weight":
            return (*stored.shape[:-1], stored.shape[-1] * 2)
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
        if fmt.kind == "nvfp4":
            w = dequantize_nvfp4(read(stored), read(f"{module}.weight_scale"), read(f"{module}.weight_scale_2"))
        elif fmt.kind == "nvfp4-ct":
            w = from_compressed_tensors(
                read(stored), read(f"{module}.weight_scale"), read(f"{module}.weight_global_scale")
            ).dequantize()
        elif fmt.kind == "fp8":
            scale = read(f"{module}.weight_scale").float()
            q = read(stored)
            if scale.numel() == 1:
                w = dequantize_fp8_per_tensor(q, scale)
            else:  # per output channel, [out] or [out, 1]
                w = q.float() * scale.reshape(-1, *([1] * (q.dim() - 1)))
        else:
            w = dequantize_fp8_block(read(stored), read(self._scale_name(module)).float(), self._block_size())
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
            kind = fmt.kind if fmt else self.ckpt.tensors[self._logical[name]].dtype.lower()
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
