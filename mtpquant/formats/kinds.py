"""Storage kinds: how one quantized Linear's weight is stored, as records read everywhere the format matters.

A kind owns its tensor names (the data tensor and its scales, by suffix), recognises itself from a Linear's tensor
names and dtypes (``kind_of``, the one detection: inspect's on-disk precision and validate's reader both call it),
dequantizes the stored tensors exactly, and, where mtpquant writes it, quantizes a weight (``formats.nvfp4`` /
``formats.fp8``: modelopt's export math, byte for byte) and plans the tensors that writes. Callers resolve a Linear's
kind once, where its weights are read, and use the record instead of comparing format strings again.

The MTP precision choices (``--mtp-format``, the search's ``--precisions``, ``quantize_mtp``'s ``precision``) are
strings at the command line: ``precision_kind`` turns one into the kind it writes (``bf16``: none, the Linear kept).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "FP8",
    "FP8_BLOCK",
    "FP8_PB",
    "KINDS",
    "NVFP4",
    "NVFP4_BLOCK",
    "NVFP4_CT",
    "OUTPUT_FORMATS",
    "SCALE_SUFFIXES",
    "UNQUANTIZED",
    "WRITTEN",
    "IncompleteKindError",
    "StorageKind",
    "by_label",
    "kind",
    "kind_of",
    "precision_kind",
    "quantizes",
]

NVFP4_BLOCK = 16  # elements per NVFP4 block scale: a quantized Linear's input dimension is a multiple of it
UNQUANTIZED = "bf16"  # the precision choice that keeps a Linear as the source stores it
_FP8_BLOCK = (128, 128)  # Qwen / DeepSeek block FP8 when the config names no weight_block_size

# Every scale suffix a kind owns (and AWQ's pre_quant_scale): a scale beside a float weight is an exported leftover.
SCALE_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "pre_quant_scale",
)


class _Entry(Protocol):
    """A header entry: what detection reads of a tensor."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Any: ...


Reader = Callable[[str], "Tensor"]  # full tensor name -> the stored tensor


class IncompleteKindError(ValueError):
    """A Linear whose data tensor is of a kind but whose scales are missing (``str``: what, after the module)."""


@dataclass(frozen=True)
class StorageKind:
    """One way a quantized Linear's weight is stored."""

    name: str  # validate's precision summary and LinearFormat's kind: nvfp4 | nvfp4-ct | fp8 | fp8-block | fp8-pb
    label: str  # inspect's on-disk precision (module_precision): NVFP4 | NVFP4-CT | FP8 | FP8-block | FP8-PB
    data: str  # suffix of the stored weight (``weight``, compressed-tensors ``weight_packed``)
    dtype: str  # the stored weight's safetensors dtype
    scales: tuple[str, ...]  # the weight's scale tensors
    input_scale: str | None  # the activation scale's suffix
    packed: bool  # two 4-bit codes a byte: the weight's input dimension is twice the stored one
    activation: str  # how the engines quantize its input: "nvfp4" (dynamic fp8 blocks) | "fp8" (static)
    scheme: str  # with its input scales: W4A4 | W8A8
    dynamic: str | None  # without an input scale the engines quantize it dynamically: how validate's caveat calls it
    reciprocal: bool = False  # global scales stored as reciprocals (compressed-tensors: 1 / ModelOpt's)
    static_inputs: bool = False  # written W8A8 only: the engines load it with a static input scale, not weight-only
    heal_writes: bool = False  # heal writes a healed MTP back in it (ModelOpt layout, modelopt's export math)
    group_size: int | None = None  # elements a block scale covers along a row (None: per tensor or 2-D blocks)
    shared_scale: bool = False  # Linears fed by one input (q/k/v, gate/up) share its global scale (weight_scale_2)
    blocks: bool = False  # its scales cover 2-D blocks of the weight (the config's ``weight_block_size``)
    layer_algo: str | None = None  # its ``quantized_layers`` quant_algo (None: the main model's NVFP4 algo)
    modelopt_cfg: Mapping[str, Any] = field(default_factory=dict, compare=False)  # modelopt's quantizer attributes
    # the kind's math (``formats.nvfp4`` / ``formats.fp8``): stored tensors -> float32 weight; weight -> stored tensors
    # (None: mtpquant does not write it); [rows, cols] -> the tensors writing it makes (suffix -> dtype, shape)
    reader: Callable[[Reader, str, tuple[int, int]], Tensor] | None = field(default=None, compare=False, repr=False)
    writer: Callable[[Tensor, Tensor | None], dict[str, Tensor]] | None = field(default=None, compare=False, repr=False)
    plan: Callable[[int, int], dict[str, tuple[str, tuple[int, ...]]]] | None = field(
        default=None, compare=False, repr=False
    )

    def __str__(self) -> str:
        return self.name

    def stores(self, dtype: str) -> bool:
        """Whether a tensor of safetensors ``dtype`` can be this kind's data tensor."""
        return dtype == self.dtype

    @property
    def input_amax_factor(self) -> float:
        """amax = input_scale x this: 6 x 448 for NVFP4 (E2M1 max times E4M3 max), 448 for FP8."""
        from mtpquant.formats.fp8 import FP8_E4M3_MAX
        from mtpquant.formats.nvfp4 import E2M1_MAX, E4M3_MAX

        return E2M1_MAX * E4M3_MAX if self.activation == "nvfp4" else FP8_E4M3_MAX

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The unquantized weight's shape from the stored data tensor's."""
        return (*stored[:-1], stored[-1] * 2) if self.packed else tuple(stored)

    # ---- reading -----------------------------------------------------------------------------------
    def dequantize(self, read: Reader, module: str, block: tuple[int, int] = _FP8_BLOCK) -> Tensor:
        """``module``'s weight in float32 from its stored tensors (``read``: full name -> tensor), exactly."""
        assert self.reader is not None  # every kind reads
        return self.reader(read, module, block)

    def read_input_scale(self, read: Reader, module: str) -> float:
        """The Linear's input scale in ModelOpt's convention (compressed-tensors' reciprocal undone)."""
        if self.input_scale is None:
            raise ValueError(f"{self.label} has no input scale")
        value = float(read(f"{module}.{self.input_scale}").float().max())
        return 1.0 / value if self.reciprocal else value

    # ---- writing (the kinds mtpquant writes) -------------------------------------------------------
    def quantize(self, weight: Tensor, weight_scale_2: Tensor | None = None) -> dict[str, Tensor]:
        """The stored tensors of ``weight`` by suffix, as modelopt's export writes them (``weight_scale_2``: a fused
        group's shared NVFP4 global scale)."""
        if self.writer is None:
            raise ValueError(f"mtpquant does not write {self.label}")
        return self.writer(weight, weight_scale_2)

    def input_scale_from_amax(self, amax: Tensor | float) -> Tensor:
        """The activation scale from a calibrated input amax (zero/NaN amax replaced, as modelopt's exporter)."""
        from mtpquant.formats.fp8 import fp8_scale_from_amax
        from mtpquant.formats.nvfp4 import input_scale_from_amax

        return input_scale_from_amax(amax) if self.activation == "nvfp4" else fp8_scale_from_amax(amax)

    def fake_quantize_input(self, x: Tensor, scale: float) -> Tensor:
        """``x`` quantized and dequantized as the engines quantize this kind's input with ``scale``."""
        import torch

        from mtpquant.formats.fp8 import FP8_E4M3_MAX
        from mtpquant.formats.nvfp4 import quantize_activation_nvfp4

        if self.activation == "nvfp4":
            return quantize_activation_nvfp4(x, scale)
        q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)

    def planned(self, rows: int, cols: int, activations: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The tensors writing a ``[rows, cols]`` weight in this kind makes: suffix -> (dtype, shape)."""
        if self.plan is None:
            raise ValueError(f"mtpquant does not write {self.label}")
        out = self.plan(rows, cols)
        if activations and self.input_scale is not None:
            out[self.input_scale] = ("F32", ())
        return out

    def layer_entry(self, main_algo: str) -> dict[str, Any]:
        """Its ``quantized_layers`` entry: NVFP4 as the main model's (its quant_algo, group 16), FP8 per tensor."""
        if self.layer_algo is None:
            return {"quant_algo": main_algo, "group_size": NVFP4_BLOCK}
        return {"quant_algo": self.layer_algo}


# ---- dequantization, per kind ---------------------------------------------------------------------------------
def _nvfp4(read: Reader, module: str, _block: tuple[int, int]) -> Tensor:
    from mtpquant.formats.nvfp4 import dequantize_nvfp4

    return dequantize_nvfp4(read(f"{module}.weight"), read(f"{module}.weight_scale"), read(f"{module}.weight_scale_2"))


def _nvfp4_ct(read: Reader, module: str, _block: tuple[int, int]) -> Tensor:
    from mtpquant.formats.nvfp4 import from_compressed_tensors

    packed, scale = read(f"{module}.weight_packed"), read(f"{module}.weight_scale")
    return from_compressed_tensors(packed, scale, read(f"{module}.weight_global_scale")).dequantize()


def _fp8(read: Reader, module: str, _block: tuple[int, int]) -> Tensor:
    from mtpquant.formats.fp8 import dequantize_fp8_per_tensor

    scale = read(f"{module}.weight_scale").float()
    q = read(f"{module}.weight")
    if scale.numel() == 1:
        return dequantize_fp8_per_tensor(q, scale)
    return q.float() * scale.reshape(-1, *([1] * (q.dim() - 1)))  # per output channel, [out] or [out, 1]


def _fp8_block(read: Reader, module: str, block: tuple[int, int]) -> Tensor:
    from mtpquant.formats.fp8 import dequantize_fp8_block

    return dequantize_fp8_block(read(f"{module}.weight"), read(f"{module}.weight_scale_inv").float(), block)


def _fp8_pb(read: Reader, module: str, block: tuple[int, int]) -> Tensor:
    from mtpquant.formats.fp8 import dequantize_fp8_block

    weight = read(f"{module}.weight")
    scale = read(f"{module}.weight_scale").float()
    if scale.dim() == 4:  # ModelOpt FP8_PB_WO: [out/128, 1, in/128, 1]
        scale = scale.reshape(scale.shape[0], scale.shape[2])
    return dequantize_fp8_block(weight, scale, block)


def _quantize_nvfp4(weight: Tensor, weight_scale_2: Tensor | None) -> dict[str, Tensor]:
    from mtpquant.formats.nvfp4 import quantize_nvfp4

    return quantize_nvfp4(weight, weight_scale_2=weight_scale_2).tensors()


def _quantize_nvfp4_ct(weight: Tensor, weight_scale_2: Tensor | None) -> dict[str, Tensor]:
    from mtpquant.formats.nvfp4 import quantize_nvfp4, to_compressed_tensors

    return to_compressed_tensors(quantize_nvfp4(weight, weight_scale_2=weight_scale_2))


def _quantize_fp8(weight: Tensor, _weight_scale_2: Tensor | None) -> dict[str, Tensor]:
    from mtpquant.formats.fp8 import quantize_fp8_per_tensor

    w8, scale = quantize_fp8_per_tensor(weight)
    return {"weight": w8, "weight_scale": scale}


def _planned_nvfp4(rows: int, cols: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        "weight": ("U8", (rows, cols // 2)),
        "weight_scale": ("F8_E4M3", (rows, cols // NVFP4_BLOCK)),
        "weight_scale_2": ("F32", ()),
    }


def _planned_fp8(rows: int, cols: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {"weight": ("F8_E4M3", (rows, cols)), "weight_scale": ("F32", ())}

_NVFP4_CFG: dict[str, Any] = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
_FP8_CFG: dict[str, Any] = {"num_bits": (4, 3), "axis": None}

# ModelOpt NVFP4: weight uint8 [out, in/2] (element 2k in the low nibble), weight_scale fp8 [out, in/16],
# weight_scale_2 fp32 [] (modelopt/torch/export/unified_export_hf.py, NVFP4QTensor)
NVFP4 = StorageKind(
    name="nvfp4", label="NVFP4", data="weight", dtype="U8", scales=("weight_scale", "weight_scale_2"),
    input_scale="input_scale", packed=True, activation="nvfp4", scheme="W4A4", dynamic=None,
    heal_writes=True, group_size=NVFP4_BLOCK, shared_scale=True, modelopt_cfg=_NVFP4_CFG,
    reader=_nvfp4, writer=_quantize_nvfp4, plan=_planned_nvfp4,
)  # fmt: skip
# compressed-tensors nvfp4-pack-quantized: weight_packed, weight_scale fp8, weight_global_scale = 1 / weight_scale_2
NVFP4_CT = StorageKind(
    name="nvfp4-ct", label="NVFP4-CT", data="weight_packed", dtype="U8", scales=("weight_scale", "weight_global_scale"),
    input_scale="input_global_scale", packed=True, activation="nvfp4", scheme="W4A4", dynamic=None,
    reciprocal=True, group_size=NVFP4_BLOCK, shared_scale=True, reader=_nvfp4_ct, writer=_quantize_nvfp4_ct,
)  # fmt: skip
# ModelOpt FP8: weight fp8, weight_scale fp32 per tensor (or per output channel, [out] / [out, 1])
FP8 = StorageKind(
    name="fp8", label="FP8", data="weight", dtype="F8_E4M3", scales=("weight_scale",), input_scale="input_scale",
    packed=False, activation="fp8", scheme="W8A8", dynamic="dynamic FP8", heal_writes=True, layer_algo="FP8",
    static_inputs=True,
    modelopt_cfg=_FP8_CFG, reader=_fp8, writer=_quantize_fp8, plan=_planned_fp8,
)  # fmt: skip
# Qwen / DeepSeek block FP8: weight fp8, weight_scale_inv [ceil(out/128), ceil(in/128)] (multiplies)
FP8_BLOCK = StorageKind(
    name="fp8-block", label="FP8-block", data="weight", dtype="F8_E4M3", scales=("weight_scale_inv",),
    input_scale="input_scale", packed=False, activation="fp8", scheme="W8A8", dynamic="block FP8", blocks=True,
    reader=_fp8_block,
)  # fmt: skip
# ModelOpt FP8_PB_WO: weight fp8, block scales as weight_scale [out/128, 1, in/128, 1] (or 2-D)
FP8_PB = StorageKind(
    name="fp8-pb", label="FP8-PB", data="weight", dtype="F8_E4M3", scales=("weight_scale",),
    input_scale="input_scale", packed=False, activation="fp8", scheme="W8A8", dynamic="block FP8", blocks=True,
    reader=_fp8_pb,
)  # fmt: skip

KINDS: tuple[StorageKind, ...] = (NVFP4, NVFP4_CT, FP8, FP8_BLOCK, FP8_PB)
_BY_NAME = {k.name: k for k in KINDS}
_BY_LABEL = {k.label: k for k in KINDS}
# The MTP precision choices mtpquant writes a Linear in (--mtp-format, the search's precisions), to their kinds.
WRITTEN: Mapping[str, StorageKind] = {"nvfp4": NVFP4, "fp8": FP8}
# The NVFP4 kind each output format (convert's --format) stores a quantized Linear in.
OUTPUT_FORMATS: Mapping[str, StorageKind] = {"modelopt": NVFP4, "compressed-tensors": NVFP4_CT}


def kind(name: str) -> StorageKind:
    """The kind called ``name`` (``StorageKind.name``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown storage kind {name!r} (known: {', '.join(_BY_NAME)})") from None


def by_label(label: str) -> StorageKind | None:
    """The kind inspect's on-disk precision ``label`` names (``StorageKind.label``); None for any other precision."""
    return _BY_LABEL.get(label)


def precision_kind(precision: str) -> StorageKind | None:
    """The kind a precision choice writes (``nvfp4``, ``fp8``); None for ``bf16`` (the Linear kept as stored)."""
    if precision == UNQUANTIZED:
        return None
    try:
        return WRITTEN[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r} is not one of {UNQUANTIZED}, {', '.join(WRITTEN)}") from None


def quantizes(precision: str) -> bool:
    """Whether a precision choice quantizes (anything but ``bf16``)."""
    return precision_kind(precision) is not None


# ---- detection --------------------------------------------------------------------------------------------------
def _per_channel(scale: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """A weight_scale of one value per tensor or per output channel (``[]``, ``[1]``, ``[out]``, ``[out, 1]``)."""
    return len(scale) <= 1 or (len(scale) == 2 and scale[-1] == 1 and len(weight) == 2 and scale[0] == weight[0])


def kind_of(tensors: Mapping[str, _Entry], module: str, *, strict: bool = False) -> StorageKind | None:
    """The kind Linear ``module`` is stored in, from the header entries of ``tensors`` (full names) alone; None when
    its weight is not one of the kinds (a float weight, missing, another dtype). ``strict``: a data tensor of a kind
    whose scales are missing raises IncompleteKindError instead of giving None."""
    get = tensors.get
    if get(module + ".weight_packed") is not None:
        if get(module + ".weight_global_scale") is not None and get(module + ".weight_scale") is not None:
            return NVFP4_CT
        if strict:
            raise IncompleteKindError("weight_packed without its scales")
        return None
    w = get(module + ".weight")
    if w is None:
        return None
    dtype = w.dtype
    if NVFP4.stores(dtype):
        scale = get(module + ".weight_scale")
        if scale is not None and FP8.stores(scale.dtype) and get(module + ".weight_scale_2") is not None:
            return NVFP4
        if strict:
            raise IncompleteKindError("weight is uint8 but weight_scale (fp8) / weight_scale_2 are missing")
        return None
    if FP8.stores(dtype):
        if get(module + ".weight_scale_inv") is not None:
            return FP8_BLOCK
        scale = get(module + ".weight_scale")
        if scale is not None:
            return FP8 if _per_channel(tuple(scale.shape), tuple(w.shape)) else FP8_PB
        if strict:
            raise IncompleteKindError("weight is fp8 but has no weight_scale / weight_scale_inv")
    return None


def block_shape(weight: tuple[int, ...], scale: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int] | None:
    """The block-scale grid ``block`` gives a ``weight`` (None when ``scale`` fits it: nothing to say)."""
    scale2 = (scale[0], scale[2]) if len(scale) == 4 else tuple(scale)
    want = (math.ceil(weight[0] / block[0]), math.ceil(weight[1] / block[1]))
    return None if scale2 == want else want

