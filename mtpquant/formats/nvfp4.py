"""NVFP4 in ModelOpt's checkpoint layout, in pure torch, bit-identical to nvidia-modelopt 0.47 on CPU.

Layout per quantized Linear: ``weight`` uint8 ``[out, in/2]`` with
element 2k in the low nibble, ``weight_scale`` float8_e4m3fn ``[out, in/16]``, ``weight_scale_2``
float32 0-d. The math mirrors ``NVFP4QTensor.quantize`` and its scale helpers
(``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``) operation for operation, so the bytes
equal what ``export_hf_checkpoint`` writes; only the E2M1 rounding and the block amax are computed
differently (integer tricks instead of ``searchsorted`` plus a ``[N, 3]`` tie test), and the work is
split into row chunks run on a small thread pool so memory stays bounded.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SCALE",
    "NVFP4Weight",
    "dequantize_nvfp4",
    "from_compressed_tensors",
    "global_scale_from_amax",
    "input_scale_from_amax",
    "quantize_activation_nvfp4",
    "quantize_nvfp4",
    "shared_global_scale",
    "to_compressed_tensors",
    "weight_amax",
]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# modelopt's `_cast_per_block_scale_to_fp8` clamps block scales to [2^-9, 448] before the fp8 cast.
E4M3_MIN_SCALE = 2.0**-9
# Value of each 4-bit code (sign << 3 | magnitude). Code 8 is +0.0, as in modelopt's `e2m1_values`,
# so dequantization matches modelopt bit for bit (E2M1 itself would call it -0).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

# Elements per work chunk: small enough that a chunk's float32 temporaries stay in a core's L2.
_CHUNK_ELEMENTS = 1 << 17
# Rounding |x| to E2M1 without searchsorted (bit-identical to modelopt's `_cast_fp4`, ties to even):
#  lo = round_half_even(2|x|): adding 2^22 leaves a float32 grid of 0.5, so the sum's bit pattern
#       minus that of 2^22 counts halves; exact for |x| < 2 (codes 0..4).
#  hi = round |x| (clamped to >= 1) to one mantissa bit, ties to even, on the integer bits; the
#       result's (exponent << 1 | mantissa bit) - 252 is the code for 1, 1.5, 2, 3, 4, 6, 8, ...
#  For |x| >= 1, lo >= hi; for |x| < 1, hi is the code of 1.0 (2) >= lo; so min(lo, hi), clamped to
#  the code of 6.0 (saturation), is the magnitude code. Inf and NaN land on 7, as in modelopt.
_MAGIC = 2.0**22
_HI_BIAS = 252  # (127 << 1) - 2: biased (exponent << 1 | mantissa bit) of 1.0, minus its code
_LO_OFFSET = 0x4A800000 - _HI_BIAS  # bits of 2^22, shifted so lo shares hi's bias


@dataclass(frozen=True)
class NVFP4Weight:
    """A weight in ModelOpt NVFP4 layout: packed codes, per-block fp8 scales, per-tensor fp32 scale."""

    packed: Tensor  # uint8 [out, in/2]; element 2k in the low nibble
    weight_scale: Tensor  # float8_e4m3fn [out, in/block]
    weight_scale_2: Tensor  # float32 0-d

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the unquantized weight."""
        return (int(self.packed.shape[0]), int(self.packed.shape[1]) * 2)

    @property
    def block_size(self) -> int:
        """Elements per block scale."""
        return self.shape[1] // int(self.weight_scale.shape[-1])

    def tensors(self) -> dict[str, Tensor]:
        """The tensors under their ModelOpt checkpoint suffixes (``weight``, ``weight_scale``, ...)."""
        return {
            "weight": self.packed,
            "weight_scale": self.weight_scale,
            "weight_scale_2": self.weight_scale_2,
        }

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Dequantize to ``dtype``."""
        return dequantize_nvfp4(self.packed, self.weight_scale, self.weight_scale_2, dtype)


# --------------------------------------------------------------------------------------------------
# Scales


def _sanitize_amax(amax: Tensor | float) -> Tensor:
    """Zero/NaN amax -> 6.0, as modelopt's ``TensorQuantizer._sanitize_export_amax`` (in amax's dtype)."""
    a = torch.as_tensor(amax)
    if not a.is_floating_point():
        a = a.to(torch.float32)
    return torch.nan_to_num(torch.where(a == 0, torch.full_like(a, E2M1_MAX), a), nan=E2M1_MAX)


def global_scale_from_amax(amax: Tensor | float) -> Tensor:
    """Per-tensor ``weight_scale_2 = amax / (6 * 448)`` in float32, zero/NaN amax replaced by 6.0."""
    # modelopt: `_amax.float() / (E2M1_MAX * E4M3_MAX)`. For weights modelopt 0.47 does not sanitize,
    # so an all-zero weight exports weight_scale_2 = 0 and NaN block scales; we apply the rule its
    # exporter uses for activation amax instead, which gives finite scales and exact zeros.
    return _sanitize_amax(amax).to(torch.float32) / (E2M1_MAX * E4M3_MAX)


def input_scale_from_amax(amax: Tensor | float) -> Tensor:
    """Activation ``input_scale = amax / (6 * 448)`` in float32, zero/NaN amax replaced by 6.0."""
    # modelopt: `NVFP4QTensor.get_activation_scaling_factor` on `quantizer.export_amax()`.
    return _sanitize_amax(amax).to(torch.float32) / (E2M1_MAX * E4M3_MAX)


def _abs_max(w: Tensor) -> Tensor:
    """max|w| in w's dtype without a full-size temporary (modelopt's `reduce_amax`)."""
    mm = torch.aminmax(w)
    return torch.maximum(mm.min.abs(), mm.max.abs())


def weight_amax(weight: Tensor) -> Tensor:
    """max|W| as float32 0-d, the amax that max calibration records for a weight."""
    return _abs_max(weight.detach()).to(torch.float32)


def shared_global_scale(weights: Sequence[Tensor]) -> Tensor:
    """One ``weight_scale_2`` for a fused group (q/k/v, gate/up): from the max of their amaxes."""
    if not weights:
        raise ValueError("shared_global_scale needs at least one weight")
    amax = torch.stack([weight_amax(w) for w in weights]).amax()
    if not bool(torch.isfinite(amax)):
        raise ValueError("a weight of the group has NaN or Inf values")
    return global_scale_from_amax(amax)


def _as_scale_scalar(value: Tensor | float, name: str) -> Tensor:
    """A positive finite float32 0-d tensor from a scalar or one-element tensor."""
    t = torch.as_tensor(value).detach()
    if t.numel() != 1:
        raise ValueError(f"{name} must have one element, got shape {tuple(t.shape)}")
    t = t.reshape(()).to(torch.float32)
    if not (bool(torch.isfinite(t)) and float(t) > 0):
        raise ValueError(f"{name} must be positive and finite, got {float(t)}")
    return t


# --------------------------------------------------------------------------------------------------
# Kernels on one chunk


def _e2m1_codes(q: Tensor) -> Tensor:
    """4-bit E2M1 codes (uint8) of float32 ``q``: ties to even, saturating, sign from ``q < 0``."""
    a = q.abs()
    lo = (a + _MAGIC).view(torch.int32).sub_(_LO_OFFSET)
    ab = a.clamp_(min=1.0).view(torch.int32)
    hi = (ab >> 22).bitwise_and_(1).add_(ab).add_(0x1FFFFF).bitwise_right_shift_(22)
    mag = torch.minimum(lo, hi, out=lo).clamp_(max=_HI_BIAS + 7).sub_(_HI_BIAS).to(torch.uint8)
    # modelopt takes the sign from `weight < 0`: -0.0 gets code 0, a small negative that rounds to
    # zero keeps its sign (code 8), and NaN counts as positive.
    neg = torch.lt(q, 0).view(torch.uint8).bitwise_left_shift_(3)
    return mag.bitwise_or_(neg)


def _pack_nibbles(codes: Tensor) -> Tensor:
    """Pack codes ``[..., n]`` (uint8, contiguous) into ``[..., n/2]``: element 2k in the low nibble."""
    if sys.byteorder == "little":
        # Each int16 holds (code[2k] | code[2k+1] << 8); shifting by 4 and or-ing puts code[2k+1] into
        # bits 4..7, and the uint8 cast keeps the low byte. One pass instead of two strided ones.
        v = codes.view(torch.int16)
        return v.bitwise_right_shift(4).bitwise_or_(v).to(torch.uint8)
    return codes[..., 1::2].bitwise_left_shift(4).bitwise_or_(codes[..., 0::2])


def _block_abs_max(blocks: Tensor) -> Tensor:
    """Per-block max|x| over the last dim, as float32; NaN propagates (it sorts above Inf as bits)."""
    if blocks.dtype in (torch.bfloat16, torch.float16):
        int_dtype, bits = torch.int16, 0x7FFF
    elif blocks.dtype == torch.float32:
        int_dtype, bits = torch.int32, 0x7FFFFFFF
    else:
        return blocks.float().abs().amax(-1)
    # Clearing the sign bit orders non-negative floats like their integer bits: an integer amax with
    # no float32 temporary of the block.
    return blocks.view(int_dtype).bitwise_and(bits).amax(-1).view(blocks.dtype).to(torch.float32)


def _quantize_rows(
    w: Tensor, g: Tensor, six_g: Tensor, check_finite: bool, packed_out: Tensor, scale_out: Tensor
) -> None:
    """Quantize rows ``w`` [r, in] into the preallocated output slices."""
    rows, cols = w.shape
    n_blocks = scale_out.shape[-1]
    blocks = w.view(rows, n_blocks, cols // n_blocks)
    amax = _block_abs_max(blocks)
    if check_finite and not bool(torch.isfinite(amax).all()):
        raise ValueError("weight has NaN or Inf values; refusing to quantize")
    # NVFP4QTensor.get_weights_scaling_factor: amax / (6 * wsf2); exact zeros -> 1.0; clamp; fp8 (RNE).
    scale = amax / six_g
    scale.masked_fill_(scale == 0, 1.0)
    scale8 = scale.clamp_(min=E4M3_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale_out.copy_(scale8)
    # NVFP4QTensor.quantize: a true division (not a reciprocal multiply) of the input dtype by the
    # float32 product scale * wsf2, computed in float32.
    q = blocks / (scale8.to(torch.float32) * g).unsqueeze(-1)
    packed_out.copy_(_pack_nibbles(_e2m1_codes(q).view(rows, cols)))


# --------------------------------------------------------------------------------------------------
# Threading


class _TorchThreads:
    """Holds torch's intra-op pool at one thread while chunk workers run, restoring it afterwards.

    Workers calling parallel torch ops would each start an OpenMP team (oversubscription, and a
    barrier per op that stalls whenever a core is busy elsewhere); one thread per worker avoids both.
    Reentrant and thread-safe: the first entrant saves the setting, the last one restores it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = 1

    @contextmanager
    def single(self) -> Iterator[None]:
        """Context in which torch runs single-threaded."""
        with self._lock:
            if self._depth == 0:
                self._saved = torch.get_num_threads()
                torch.set_num_threads(1)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    torch.set_num_threads(self._saved)


_TORCH_THREADS = _TorchThreads()


def _run_chunks(
    fn: Callable[[int, int], None], n_rows: int, rows_per_chunk: int, num_threads: int | None, device: torch.device
) -> None:
    """Call ``fn(start, stop)`` for each row chunk: on CPU on a pool of single-threaded torch workers."""
    bounds = [(s, min(s + rows_per_chunk, n_rows)) for s in range(0, n_rows, rows_per_chunk)]
    if device.type != "cpu":
        for start, stop in bounds:
            fn(start, stop)
        return
    workers = torch.get_num_threads() if num_threads is None else num_threads
    workers = max(1, min(workers, len(bounds)))
    with _TORCH_THREADS.single():
        if workers == 1:
            for start, stop in bounds:
                fn(start, stop)
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="nvfp4") as pool:
            # list() re-raises the first worker exception here.
            list(pool.map(lambda b: fn(*b), bounds))


# --------------------------------------------------------------------------------------------------
# Public quantize / dequantize


def quantize_nvfp4(
    weight: Tensor,
    weight_scale_2: Tensor | float | None = None,
    block_size: int = 16,
    *,
    num_threads: int | None = None,
) -> NVFP4Weight:
    """Quantize a 2-D weight to ModelOpt NVFP4, byte for byte what modelopt's export writes."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"expected a bf16/fp16/fp32 weight, got {weight.dtype}")
    if block_size <= 0 or block_size % 2 or weight.shape[1] % block_size:
        raise ValueError(f"in_features {weight.shape[1]} is not a multiple of block size {block_size}")
    w = weight.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    if weight_scale_2 is None:
        amax = _abs_max(w)
        if not bool(torch.isfinite(amax)):
            raise ValueError("weight has NaN or Inf values; refusing to quantize")
        g = global_scale_from_amax(amax)
    else:
        g = _as_scale_scalar(weight_scale_2, "weight_scale_2").to(w.device)
    out_f, in_f = w.shape
    packed = torch.empty((out_f, in_f // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((out_f, in_f // block_size), dtype=torch.float8_e4m3fn, device=w.device)
    if out_f == 0 or in_f == 0:
        return NVFP4Weight(packed, scale, g)
    six_g = E2M1_MAX * g  # `E2M1_MAX * weights_scaling_factor_2`, a float32 0-d tensor as in modelopt
    check_finite = weight_scale_2 is not None

    def run(start: int, stop: int) -> None:
        _quantize_rows(w[start:stop], g, six_g, check_finite, packed[start:stop], scale[start:stop])

    rows_per_chunk = max(1, _CHUNK_ELEMENTS // in_f)
    _run_chunks(run, out_f, rows_per_chunk, num_threads, w.device)
    return NVFP4Weight(packed, scale, g)


def _pair_lut(device: torch.device) -> Tensor:
    """[256, 2] float32: the values of a packed byte's low and high nibble."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1)


def dequantize_nvfp4(
    packed: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``e2m1[code] * float(weight_scale) * weight_scale_2``, cast to ``dtype`` (as modelopt's dequantize)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.dim() < 1 or weight_scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"shape mismatch: packed {tuple(packed.shape)}, weight_scale {tuple(weight_scale.shape)}")
    cols = int(packed.shape[-1]) * 2
    n_blocks = int(weight_scale.shape[-1])
    if n_blocks == 0 or cols % n_blocks:
        raise ValueError(f"{cols} elements per row do not split into {n_blocks} blocks")
    lead = tuple(packed.shape[:-1])
    g = torch.as_tensor(weight_scale_2).reshape(()).to(device=packed.device, dtype=torch.float32)
    lut = _pair_lut(packed.device)
    values = torch.index_select(lut, 0, packed.reshape(-1).to(torch.int32))
    values = values.view(*lead, n_blocks, cols // n_blocks)
    # modelopt: `per_block_scale = scale.float() * double_scale`, then values * per_block_scale.
    values.mul_((weight_scale.to(torch.float32) * g).unsqueeze(-1))
    return values.view(*lead, cols).to(dtype)


def quantize_activation_nvfp4(x: Tensor, input_scale: Tensor | float, block_size: int = 16) -> Tensor:
    """Fake-quantize an activation as NVFP4 W4A4 kernels do (dynamic fp8 block scales), same dtype out."""
    # Mirrors vLLM / TensorRT-LLM `cvt_warp_fp16_to_fp4`: SF = fp8_satfinite(G * amax / 6) with the
    # global G = 1 / input_scale; x is multiplied by 1 / (SF / G), rounded to E2M1 (RNE, saturating);
    # the GEMM then applies SF and input_scale. The kernels use approximate reciprocals, so this is
    # a faithful emulation, not bit-exact.
    if x.shape[-1] % block_size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of block size {block_size}")
    s_in = _as_scale_scalar(input_scale, "input_scale").to(x.device)
    if x.numel() == 0:
        return x.clone()
    g = 1.0 / s_in
    inv_g = 1.0 / g
    inv_six = torch.tensor(1.0 / 6.0, dtype=torch.float32)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    cols = x.shape[-1]
    flat = x.detach().reshape(-1, cols)
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    rows_per_chunk = max(1, (_CHUNK_ELEMENTS * 8) // cols)
    for start in range(0, flat.shape[0], rows_per_chunk):
        xb = flat[start : start + rows_per_chunk].to(torch.float32).view(-1, cols // block_size, block_size)
        amax = xb.abs().amax(-1)
        sf = (g * (amax * inv_six)).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
        out_scale = torch.where(sf != 0, 1.0 / (sf * inv_g), torch.zeros_like(sf))
        q = values[_e2m1_codes(xb * out_scale.unsqueeze(-1)).long()]
        deq = q * (sf * s_in).unsqueeze(-1)
        out[start : start + rows_per_chunk] = deq.view(-1, cols)
    return out.view(x.shape)


# --------------------------------------------------------------------------------------------------
# compressed-tensors layout


def to_compressed_tensors(w: NVFP4Weight, input_scale: Tensor | float | None = None) -> dict[str, Tensor]:
    """compressed-tensors ``nvfp4-pack-quantized`` tensors; global scales are reciprocals, shape [1]."""
    out = {
        "weight_packed": w.packed,
        "weight_scale": w.weight_scale,
        "weight_global_scale": (1.0 / w.weight_scale_2.to(torch.float32)).reshape(1),
    }
    if input_scale is not None:
        s_in = _as_scale_scalar(input_scale, "input_scale")
        out["input_global_scale"] = (1.0 / s_in).reshape(1)
    return out


def from_compressed_tensors(weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor) -> NVFP4Weight:
    """An NVFP4Weight from compressed-tensors tensors (``weight_scale_2 = 1 / weight_global_scale``)."""
    if weight_packed.dtype != torch.uint8 or weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"expected uint8 weight_packed and float8_e4m3fn weight_scale, got {weight_packed.dtype} and "
            f"{weight_scale.dtype}"
        )
    if weight_packed.dim() != 2 or weight_scale.dim() != 2 or weight_scale.shape[0] != weight_packed.shape[0]:
        raise ValueError(
            f"shape mismatch: weight_packed {tuple(weight_packed.shape)}, weight_scale {tuple(weight_scale.shape)}"
        )
    # Same nibble order and block scales; only the global scale is stored inverted. 1 / (1 / s) can
    # differ from s by one float32 ulp, so a round trip is exact only up to that.
    g = 1.0 / _as_scale_scalar(weight_global_scale, "weight_global_scale")
    return NVFP4Weight(weight_packed, weight_scale, g.reshape(()))
