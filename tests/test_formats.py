"""NVFP4 / FP8 formats: hand-computed cases, and differential tests against modelopt on CPU."""

from __future__ import annotations

import math
import warnings
import zlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mtpquant.formats import nvfp4
from mtpquant.formats.fp8 import (
    dequantize_fp8_block,
    dequantize_fp8_per_tensor,
    fp8_scale_from_amax,
    quantize_fp8_per_tensor,
)
from mtpquant.formats.nvfp4 import (
    E2M1_VALUES,
    NVFP4Weight,
    dequantize_nvfp4,
    from_compressed_tensors,
    global_scale_from_amax,
    input_scale_from_amax,
    quantize_activation_nvfp4,
    quantize_nvfp4,
    shared_global_scale,
    to_compressed_tensors,
    weight_amax,
)

pytestmark = pytest.mark.dev

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def mo() -> SimpleNamespace:
    """modelopt's reference pieces (imported once; modelopt's import is slow and noisy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.opt  # noqa: F401  (import first: avoids modelopt's circular-import warnings)
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export.quant_utils import preprocess_linear_fusion
        from modelopt.torch.export.unified_export_hf import _export_quantized_weight
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return SimpleNamespace(
        mtq=mtq, NVFP4QTensor=NVFP4QTensor, export=_export_quantized_weight, fuse=preprocess_linear_fusion
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 / +0.0 and NaN payloads count as different."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(view)


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    diff = (_bits(a) != _bits(b)).sum().item()
    assert diff == 0, f"{diff} of {a.numel()} elements differ"


def _modelopt_quantize(mo: SimpleNamespace, w: torch.Tensor, ws2: torch.Tensor | None) -> NVFP4Weight:
    q, scale, scale_2 = mo.NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=ws2)
    return NVFP4Weight(q._quantized_data, scale, scale_2.float())


def _assert_same_nvfp4(ours: NVFP4Weight, ref: NVFP4Weight) -> None:
    _assert_same_bits(ours.packed, ref.packed)
    _assert_same_bits(ours.weight_scale, ref.weight_scale)
    _assert_same_bits(ours.weight_scale_2, ref.weight_scale_2.reshape(()))


# --------------------------------------------------------------------------------------------------
# Hand-computed cases (weight_scale_2 = 1 and block amax 6 make every block scale exactly 1.0)

# fmt: off
_ROW = [
    6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 2.9, 4.9, 5.1, 0.0, -0.0, -0.1,
    -6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.3, -5.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.5,
]
# ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0;
# -0.0 is code 0 (modelopt's sign is `x < 0`), -0.1 rounds to zero but keeps its sign (code 8).
_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 0, 1, 5, 6, 7, 0, 0, 8,
          15, 8, 10, 10, 12, 12, 14, 14, 9, 15, 2, 3, 4, 5, 6, 1]
_BYTES = [0x07, 0x22, 0x44, 0x66, 0x10, 0x65, 0x07, 0x80,
          0x8F, 0xAA, 0xCC, 0xEE, 0xF9, 0x32, 0x54, 0x16]
# fmt: on


def test_e2m1_table() -> None:
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert E2M1_VALUES[9:] == (-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def test_rounding_ties_sign_and_nibble_order() -> None:
    w = torch.tensor([_ROW], dtype=BF16)
    q = quantize_nvfp4(w, weight_scale_2=torch.tensor(1.0))
    assert q.packed.tolist() == [_BYTES]
    assert [b & 0xF for b in _BYTES] == _CODES[0::2]  # element 2k is the low nibble
    assert [b >> 4 for b in _BYTES] == _CODES[1::2]
    assert _bits(q.weight_scale).tolist() == [[0x38, 0x38]]  # fp8 e4m3 1.0
    assert q.weight_scale_2.dim() == 0 and q.weight_scale_2.item() == 1.0
    expected = [abs(E2M1_VALUES[c]) * (-1 if c >= 8 else 1) for c in _CODES]
    assert q.dequantize().tolist() == [expected]
    assert q.shape == (1, 32) and q.block_size == 16


def test_block_scale_clamp_and_saturation() -> None:
    w = torch.zeros(3, 32, dtype=BF16)
    w[0, :16] = 600.0  # scale 600 / (6 * 0.1) = 1000 -> clamped to 448; 600 / 44.8 = 13.4 saturates at 6
    w[0, 16] = -600.0
    w[1, 0] = 0.001  # scale 0.001 / 0.6 < 2^-9 -> clamped up to 2^-9; 0.001 / (2^-9 * 0.1) = 5.12 -> 6
    # row 2 and the second block of row 1 are all zero -> scale 1.0, codes 0
    q = quantize_nvfp4(w, weight_scale_2=torch.tensor(0.1))
    assert _bits(q.weight_scale).tolist() == [[0x7E, 0x7E], [0x01, 0x38], [0x38, 0x38]]
    assert q.weight_scale.float()[0].tolist() == [448.0, 448.0] and q.weight_scale.float()[1, 0] == 2**-9
    assert q.packed[0, :8].tolist() == [0x77] * 8 and q.packed[0, 8:].tolist() == [0x0F] + [0] * 7
    assert q.packed[1].tolist() == [0x07] + [0] * 15
    assert q.packed[2].eq(0).all()


def test_block_scale_fp8_ties_to_even() -> None:
    w = torch.zeros(2, 16, dtype=BF16)
    w[0, 0] = 2400.0  # scale 400: midway between e4m3 384 (mantissa 100) and 416 (101) -> 384
    w[1, 0] = 2592.0  # scale 432: midway between 416 (101) and 448 (110) -> 448
    q = quantize_nvfp4(w, weight_scale_2=torch.tensor(1.0))
    assert q.weight_scale.float()[:, 0].tolist() == [384.0, 448.0]
    assert q.packed[:, 0].tolist() == [0x07, 0x07]  # 2400 / 384 = 6.25 and 2592 / 448 = 5.79 -> 6


def test_global_and_input_scales() -> None:
    amax = torch.tensor(3.0)
    assert global_scale_from_amax(amax).item() == (torch.tensor(3.0) / 2688.0).item()
    assert global_scale_from_amax(amax).dtype == torch.float32
    assert input_scale_from_amax(torch.tensor(12.5, dtype=BF16)).item() == pytest.approx(12.5 / 2688, rel=1e-7)
    # zero / NaN amax -> 6.0 (modelopt's export sanitizing) -> 1 / 448
    for bad in (0.0, float("nan")):
        assert global_scale_from_amax(torch.tensor(bad)).item() == pytest.approx(1 / 448, rel=1e-7)
        assert input_scale_from_amax(torch.tensor(bad)).item() == pytest.approx(1 / 448, rel=1e-7)
    a = torch.randn(8, 32, dtype=BF16)
    b = torch.randn(4, 32, dtype=BF16) * 3
    assert weight_amax(b).item() == b.float().abs().max().item()
    assert shared_global_scale([a, b]).item() == global_scale_from_amax(b.abs().max()).item()
    with pytest.raises(ValueError):
        shared_global_scale([])


def test_all_zero_weight_is_finite() -> None:
    # modelopt 0.47 exports weight_scale_2 = 0 and NaN block scales here; we use amax 6 -> 1/448.
    q = quantize_nvfp4(torch.zeros(3, 32, dtype=BF16))
    assert q.weight_scale_2.item() == pytest.approx(1 / 448, rel=1e-7)
    assert _bits(q.weight_scale).eq(0x38).all() and q.packed.eq(0).all()
    assert q.dequantize().eq(0).all()


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(torch.tensor([[float("nan")] + [0.0] * 15], dtype=BF16))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(torch.tensor([[float("inf")] + [0.0] * 15], dtype=BF16), weight_scale_2=torch.tensor(1.0))
    with pytest.raises(ValueError, match="multiple"):
        quantize_nvfp4(torch.zeros(2, 24, dtype=BF16))
    with pytest.raises(ValueError, match="2-D"):
        quantize_nvfp4(torch.zeros(32, dtype=BF16))
    with pytest.raises(ValueError, match="positive"):
        quantize_nvfp4(torch.ones(2, 16, dtype=BF16), weight_scale_2=torch.tensor(0.0))


# --------------------------------------------------------------------------------------------------
# Differential: NVFP4QTensor.quantize (what export_hf_checkpoint calls), bit for bit


def _weight(kind: str, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(shape, generator=gen)
    if kind == "tiny":
        w *= 1e-30
    elif kind == "huge":
        w = w.clamp(-3, 3) * 1e38
    elif kind == "spread":  # magnitudes over 16 decades inside one tensor
        w *= 10.0 ** torch.randint(-8, 8, shape, generator=gen).float()
    elif kind == "ties":  # exact E2M1 midpoints, scaled by powers of two per row
        grid = torch.tensor(
            [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, -0.0, -0.25, -0.75, -1.75, -3.5, -5.0, -6.0]
        )
        w = grid[torch.randint(0, 16, shape, generator=gen)]
        w *= 2.0 ** torch.randint(-3, 4, (shape[0], 1), generator=gen).float()
    elif kind == "zeros":  # all-zero and all-(-0.0) blocks, negative zeros among values
        blocks = w.view(shape[0], -1, 16)
        blocks[:, 0::3] = 0.0
        blocks[:, 1::3, ::2] = -0.0
        blocks[:, 2::3, 5] = -0.0
    return w.to(BF16)


@pytest.mark.parametrize("kind", ["randn", "tiny", "huge", "spread", "ties", "zeros"])
@pytest.mark.parametrize("shape", [(1, 16), (5, 48), (67, 320)])
def test_quantize_matches_modelopt(mo: SimpleNamespace, kind: str, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{shape}".encode()))
    w = _weight(kind, shape, gen)
    if not w.any():  # all zeros: the one documented deviation (see test_all_zero_weight_is_finite)
        w[0, 0] = 1.0
    _assert_same_nvfp4(quantize_nvfp4(w), _modelopt_quantize(mo, w, None))
    # a given (shared) weight_scale_2: larger than this tensor's own (the usual fused case), and far
    # smaller (block scales clamp at 448 and codes saturate) or far larger (clamp at 2^-9)
    amax = w.float().abs().max()
    for factor in (3.0, 1e-3, 1e5):
        ws2 = global_scale_from_amax(amax * factor)
        _assert_same_nvfp4(quantize_nvfp4(w, ws2), _modelopt_quantize(mo, w, ws2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_matches_modelopt_other_dtypes(mo: SimpleNamespace, dtype: torch.dtype) -> None:
    w = (torch.randn(33, 64, generator=torch.Generator().manual_seed(1)) * 0.05).to(dtype)
    w[3, :16] = 0
    _assert_same_nvfp4(quantize_nvfp4(w), _modelopt_quantize(mo, w, None))


def test_chunking_and_threads_do_not_change_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(97, 256, generator=torch.Generator().manual_seed(2), dtype=torch.float32).to(BF16)
    ref = quantize_nvfp4(w, num_threads=1)
    before = torch.get_num_threads()
    monkeypatch.setattr(nvfp4, "_CHUNK_ELEMENTS", 3 * 256)  # 33 chunks of 3 rows (last one 1 row)
    for threads in (1, 2, 3):
        _assert_same_nvfp4(quantize_nvfp4(w, num_threads=threads), ref)
    _assert_same_nvfp4(quantize_nvfp4(w.t().contiguous().t()), ref)  # non-contiguous input
    assert torch.get_num_threads() == before


def test_export_of_fused_linears_matches(mo: SimpleNamespace) -> None:
    """What modelopt's exporter writes for a q/k-style fused pair and a lone Linear, with max calibration."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, n, bias=False) for n in (48, 32, 32))).to(BF16)
    with torch.no_grad():
        model[1].weight.mul_(7)
    x = torch.randn(4, 64, dtype=BF16) * 3
    weights = [lin.weight.detach().clone() for lin in model]

    def forward_loop(m: Any) -> None:
        for lin in m:
            lin(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mo.mtq.quantize(model, mo.mtq.NVFP4_DEFAULT_CFG, forward_loop)
        mo.fuse([model[0], model[1]])  # what export does for q/k/v and gate/up: one max amax
        for lin in model:
            mo.export(lin, BF16)
    shared = shared_global_scale(weights[:2])
    ours = [quantize_nvfp4(weights[0], shared), quantize_nvfp4(weights[1], shared), quantize_nvfp4(weights[2])]
    for lin, q in zip(model, ours):
        _assert_same_nvfp4(q, NVFP4Weight(lin.weight, lin.weight_scale, lin.weight_scale_2))
        _assert_same_bits(input_scale_from_amax(x.abs().max()), lin.input_scale)


# --------------------------------------------------------------------------------------------------
# Dequantize


def test_dequantize_matches_modelopt_and_error_bound(mo: SimpleNamespace) -> None:
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(4)).to(BF16)
    w[0, :16] = 0
    q = quantize_nvfp4(w)
    qt, scale, scale_2 = mo.NVFP4QTensor.quantize(w, 16)
    for dtype in (torch.float32, BF16):
        ref = qt.dequantize(dtype=dtype, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
        _assert_same_bits(dequantize_nvfp4(q.packed, q.weight_scale, q.weight_scale_2, dtype), ref)
    # per element |W - deq| <= one E2M1 half-step at the top of the range (1.0) times the block's
    # scale, which is at most amax/6 times the fp8 rounding (1 + 2^-4)
    deq = q.dequantize()
    block_amax = w.float().abs().view(40, -1, 16).amax(-1, keepdim=True)
    err = (w.float() - deq).abs().view(40, -1, 16)
    assert (err <= block_amax / 6 * (1 + 2**-4) + 1e-12).all()
    rel = ((w.float() - deq).norm() / w.float().norm()).item()
    assert 0.01 < rel < 0.12, rel  # NVFP4 on Gaussian data is ~9% RMS error; not zero, not garbage


def test_dequantize_validates_shapes() -> None:
    with pytest.raises(ValueError):
        dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.float8_e4m3fn), 1.0)
    with pytest.raises(ValueError):
        dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.float8_e4m3fn), 1.0)


# --------------------------------------------------------------------------------------------------
# Activation fake quantization (W4A4 emulation)


def test_activation_fake_quant_hand_computed() -> None:
    # input_scale 1 -> global 1; block amax 6 -> SF = fp8(6 * fp32(1/6)) = 1; values round like weights
    x = torch.tensor([_ROW, [0.0] * 32], dtype=torch.float32)
    y = quantize_activation_nvfp4(x, torch.tensor(1.0))
    expected = [abs(E2M1_VALUES[c]) * (-1 if c >= 8 else 1) for c in _CODES]
    assert y[0].tolist() == expected
    assert y[1].eq(0).all()
    # input_scale far too small: SF saturates at 448, so values saturate at 6 * 448 * input_scale
    s = 1e-4
    y = quantize_activation_nvfp4(torch.full((1, 16), 1.0), s)
    assert y[0].tolist() == pytest.approx([6 * 448 * s] * 16, rel=1e-6)


def test_activation_fake_quant_against_reference(mo: SimpleNamespace) -> None:
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(5)) * 4).to(BF16)
    x[0, 0, :16] = 0
    s_in = input_scale_from_amax(x.abs().max() / 2)  # some blocks' scales saturate
    y = quantize_activation_nvfp4(x, s_in)
    assert y.shape == x.shape and y.dtype == x.dtype
    # reference: the kernel recipe block by block, rounding with modelopt's own E2M1 cast
    xb = x.float().view(-1, 16)
    g = 1.0 / s_in
    sf = (g * (xb.abs().amax(-1) * torch.tensor(1 / 6))).clamp(max=448).to(torch.float8_e4m3fn).float()
    out_scale = torch.where(sf != 0, 1.0 / (sf * (1.0 / g)), torch.zeros_like(sf))
    codes = mo.NVFP4QTensor._cast_fp4(xb * out_scale[:, None]).long()
    values = torch.tensor(E2M1_VALUES)[codes] * (sf * s_in)[:, None]
    _assert_same_bits(y, values.view(x.shape).to(BF16))
    assert y[0, 0, :16].eq(0).all()


# --------------------------------------------------------------------------------------------------
# compressed-tensors


def test_compressed_tensors_round_trip() -> None:
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(6)).to(BF16)
    q = quantize_nvfp4(w)
    ct = to_compressed_tensors(q, input_scale=torch.tensor(0.01))
    assert set(ct) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
    assert ct["weight_global_scale"].shape == (1,) and ct["weight_global_scale"].dtype == torch.float32
    assert ct["weight_global_scale"].item() == pytest.approx(1 / q.weight_scale_2.item(), rel=1e-7)
    assert ct["input_global_scale"].item() == pytest.approx(100.0, rel=1e-7)
    back = from_compressed_tensors(ct["weight_packed"], ct["weight_scale"], ct["weight_global_scale"])
    assert torch.equal(back.packed, q.packed) and torch.equal(_bits(back.weight_scale), _bits(q.weight_scale))
    assert back.weight_scale_2.shape == () and back.weight_scale_2.dtype == torch.float32
    ulp = math.ulp(q.weight_scale_2.item())
    assert abs(back.weight_scale_2.item() - q.weight_scale_2.item()) <= ulp
    assert torch.allclose(back.dequantize(), q.dequantize(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError):
        from_compressed_tensors(ct["weight_packed"].to(torch.int8), ct["weight_scale"], ct["weight_global_scale"])


# --------------------------------------------------------------------------------------------------
# FP8


def test_fp8_per_tensor_matches_modelopt_export(mo: SimpleNamespace) -> None:
    torch.manual_seed(7)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 40, bias=False)).to(BF16)
    w = lin[0].weight.detach().clone()
    x = torch.randn(4, 64, dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mo.mtq.quantize(lin, mo.mtq.FP8_DEFAULT_CFG, lambda m: m(x))
        mo.export(lin[0], BF16)
    q, scale = quantize_fp8_per_tensor(w)
    _assert_same_bits(q, lin[0].weight)
    _assert_same_bits(scale, lin[0].weight_scale.reshape(()))
    _assert_same_bits(fp8_scale_from_amax(x.abs().max()), lin[0].input_scale)


def test_fp8_per_tensor_hand_computed() -> None:
    w = torch.tensor([[448.0, -224.0, 1.0, 0.0], [3.0, -0.5, 100.0, 7.0]], dtype=BF16)
    q, scale = quantize_fp8_per_tensor(w)
    assert scale.dim() == 0 and scale.item() == 1.0
    assert q.float().tolist() == [[448.0, -224.0, 1.0, 0.0], [3.0, -0.5, 96.0, 7.0]]  # 100 -> 96 (3 bits)
    assert dequantize_fp8_per_tensor(q, scale).tolist() == q.float().tolist()
    q2, scale2 = quantize_fp8_per_tensor(w, weight_scale=torch.tensor(0.5))  # too small: saturates
    assert scale2.item() == 0.5 and q2.float()[0, 0].item() == 448.0 and not q2.float().isnan().any()
    qz, sz = quantize_fp8_per_tensor(torch.zeros(2, 4, dtype=BF16))
    assert sz.item() == 1.0 and qz.float().eq(0).all()
    with pytest.raises(ValueError):
        quantize_fp8_per_tensor(torch.tensor([[float("nan")]], dtype=BF16))


def test_fp8_block_dequant_with_ragged_edges() -> None:
    gen = torch.Generator().manual_seed(8)
    w = (torch.randn(130, 300, generator=gen) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=gen) + 0.5
    out = dequantize_fp8_block(w, s, (128, 128), BF16)
    assert out.shape == (130, 300) and out.dtype == BF16
    for i, j in [(0, 0), (0, 2), (1, 0), (1, 2)]:  # (1, 2) is the 2 x 44 corner block
        blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float() * s[i, j]
        _assert_same_bits(out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128], blk.to(BF16))
    assert dequantize_fp8_block(w, s, (128, 128))[129, 299] == w[129, 299].float() * s[1, 2]
    with pytest.raises(ValueError, match="does not match"):
        dequantize_fp8_block(w, torch.ones(1, 3), (128, 128))
