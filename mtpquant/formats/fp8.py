"""FP8 (E4M3) weights: ModelOpt per-tensor FP8 (quantize and dequantize) and Qwen block FP8 (dequantize).

ModelOpt FP8 export (``_export_quantized_weight`` with ``QUANTIZATION_FP8`` in
``modelopt/torch/export/unified_export_hf.py``): ``weight_scale = amax / 448`` in float32 and
``weight = (W / weight_scale).to(float8_e4m3fn)``. The division runs in the weight's dtype (a 0-d
float32 scale does not promote a bf16 tensor), so a bf16 weight is rounded to bf16 before the fp8 cast;
we keep that double rounding to stay byte-identical. Qwen's own FP8 checkpoints store 128x128 blocks
with a ``weight_scale_inv`` that multiplies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "FP8_E4M3_MAX",
    "dequantize_fp8_block",
    "dequantize_fp8_per_tensor",
    "fp8_scale_from_amax",
    "quantize_fp8_per_tensor",
]

FP8_E4M3_MAX = 448.0
_CHUNK_ELEMENTS = 1 << 22


def fp8_scale_from_amax(amax: Tensor | float) -> Tensor:
    """Per-tensor FP8 scale ``amax / 448`` in float32; zero/NaN amax replaced by 448 (scale 1)."""
    # modelopt: `amax.float() / maxbound`. Its exporter sanitizes zero/NaN activation amax to maxbound
    # (`TensorQuantizer._sanitize_export_amax`) and clamps to the dtype's finite range; the weight path
    # does neither (an all-zero weight would export scale 0 and NaN codes), so we apply the activation
    # rule to both.
    a = torch.as_tensor(amax)
    if not a.is_floating_point():
        a = a.to(torch.float32)
    a = torch.nan_to_num(torch.where(a == 0, torch.full_like(a, FP8_E4M3_MAX), a), nan=FP8_E4M3_MAX)
    info = torch.finfo(a.dtype)
    return a.clamp(min=info.tiny, max=info.max).to(torch.float32) / FP8_E4M3_MAX


def quantize_fp8_per_tensor(
    weight: Tensor, weight_scale: Tensor | float | None = None
) -> tuple[Tensor, Tensor]:
    """``(weight_fp8, weight_scale)`` as ModelOpt's FP8 export writes them; scale from max|W| unless given."""
    if not weight.is_floating_point() or weight.element_size() < 2:
        raise ValueError(f"expected a bf16/fp16/fp32 weight, got {weight.dtype}")
    w = weight.detach()
    if weight_scale is None:
        mm = torch.aminmax(w)
        amax = torch.maximum(mm.min.abs(), mm.max.abs())
        if not bool(torch.isfinite(amax)):
            raise ValueError("weight has NaN or Inf values; refusing to quantize")
        scale = fp8_scale_from_amax(amax)
    else:
        scale = torch.as_tensor(weight_scale).detach().reshape(()).to(device=w.device, dtype=torch.float32)
        if not (bool(torch.isfinite(scale)) and float(scale) > 0):
            raise ValueError(f"weight_scale must be positive and finite, got {float(scale)}")
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    flat_w = w.reshape(-1, w.shape[-1]) if w.dim() > 1 else w.reshape(1, -1)
    flat_out = out.view(flat_w.shape)
    rows = max(1, _CHUNK_ELEMENTS // max(1, flat_w.shape[1]))
    for start in range(0, flat_w.shape[0], rows):
        # modelopt: `(weight / weights_scaling_factor).to(torch.float8_e4m3fn)`. The clamp only matters
        # for a caller-supplied scale that is too small: torch turns |x| >= 464 into NaN, we saturate.
        scaled = (flat_w[start : start + rows] / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        flat_out[start : start + rows] = scaled.to(torch.float8_e4m3fn)
    return out, scale


def dequantize_fp8_per_tensor(
    weight: Tensor, weight_scale: Tensor | float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``float(weight) * weight_scale`` cast to ``dtype``."""
    scale = torch.as_tensor(weight_scale).reshape(()).to(device=weight.device, dtype=torch.float32)
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_fp8_block(
    weight: Tensor,
    weight_scale_inv: Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Block FP8 (Qwen ``weight_scale_inv``): each block times its scale; edge blocks may be partial."""
    if weight.dim() != 2 or weight_scale_inv.dim() != 2:
        raise ValueError(
            f"expected 2-D weight and weight_scale_inv, got {tuple(weight.shape)} and "
            f"{tuple(weight_scale_inv.shape)}"
        )
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(weight_scale_inv.shape)} does not match weight "
            f"{tuple(weight.shape)} with blocks {block} (expected {expected})"
        )
    # One row of scales per block row, spread over the columns and cut at the ragged edge.
    col_scales = weight_scale_inv.to(torch.float32).repeat_interleave(block_cols, dim=1)[:, :cols]
    out = torch.empty((rows, cols), dtype=dtype, device=weight.device)
    for i in range(expected[0]):
        r0, r1 = i * block_rows, min((i + 1) * block_rows, rows)
        out[r0:r1] = (weight[r0:r1].to(torch.float32) * col_scales[i]).to(dtype)
    return out
