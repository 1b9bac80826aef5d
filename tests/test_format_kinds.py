"""Storage kinds (``formats.kinds``): each kind's dequantization against values computed by hand from the format's
published layout, detection of each kind on the tensor names of real checkpoints, the tensors writing one makes, and
a check that no module outside ``mtpquant/formats/`` re-decides a Linear's format by comparing format strings.

The oracles are the formats' own specs (/work/shared/reference/nvfp4-formats.md): E2M1 magnitudes by code
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` with the sign in bit 3, element 2k in a byte's low nibble, E4M3 scale bytes written out
bit by bit, ``W = e2m1[code] * weight_scale * weight_scale_2`` (compressed-tensors: ``/ weight_global_scale``), FP8
``W = q * weight_scale``, block FP8 ``W = q * weight_scale_inv[r // 128, c // 128]``.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.precision import module_precision
from mtpquant.formats.kinds import (
    FP8,
    FP8_BLOCK,
    FP8_PB,
    KINDS,
    NVFP4,
    NVFP4_CT,
    OUTPUT_FORMATS,
    WRITTEN,
    IncompleteKindError,
    StorageKind,
    kind,
    kind_of,
    precision_kind,
    quantizes,
)
from tests.support.layouts import expand_layout

pytestmark = pytest.mark.dev

PACKAGE = Path(__file__).resolve().parents[1] / "mtpquant"
LAYOUTS = Path(__file__).resolve().parent / "fixtures" / "real-layouts"

# E2M1 by code, from the spec: magnitude codes 0..7, code | 8 negative
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# E4M3 bytes written out: sign | exponent (bias 7) << 3 | mantissa
_E4M3 = {0x30: 0.5, 0x3C: 1.5, 0x40: 2.0, 0x7E: 448.0}


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * _E2M1[code & 7]


def _reader(tensors: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    return tensors.__getitem__


def _e4m3(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8).view(torch.float8_e4m3fn)


# Two rows, two 16-element blocks each. Row 0: codes 0..15 then 15..0; row 1: 7, 15 alternating, then 1..8 twice.
_CODES = [list(range(16)) + list(range(15, -1, -1)), [7, 15] * 8 + list(range(1, 9)) * 2]
_SCALES = [[0x3C, 0x30], [0x40, 0x7E]]  # 1.5, 0.5 / 2.0, 448
_GLOBAL = 0.25


def _packed() -> torch.Tensor:
    """Two codes a byte, element 2k in the low nibble (written byte by byte)."""
    return torch.tensor([[row[2 * k] | row[2 * k + 1] << 4 for k in range(16)] for row in _CODES], dtype=torch.uint8)


def _nvfp4_expected() -> torch.Tensor:
    return torch.tensor(
        [[_e2m1(c) * _E4M3[_SCALES[r][i // 16]] * _GLOBAL for i, c in enumerate(row)] for r, row in enumerate(_CODES)]
    )


def test_the_planted_bytes_are_the_spec() -> None:
    """The hand-written bytes: the first byte of row 0 holds codes 0 (low) and 1 (high); E4M3 0x3C is 1.5."""
    assert _packed()[0, 0] == 0x10 and _packed()[0, 7] == 0xFE
    assert _e4m3([[0x3C, 0x7E]]).float().tolist() == [[1.5, 448.0]]


def test_nvfp4_dequantizes_to_the_hand_computed_values() -> None:
    t = {"m.weight": _packed(), "m.weight_scale": _e4m3(_SCALES), "m.weight_scale_2": torch.tensor(_GLOBAL)}
    got = NVFP4.dequantize(_reader(t), "m")
    want = _nvfp4_expected()
    assert got.dtype == torch.float32 and got.shape == (2, 32)
    assert torch.equal(got, want)
    assert got[0, :8].tolist() == [0.0, 0.1875, 0.375, 0.5625, 0.75, 1.125, 1.5, 2.25]  # code * 1.5 * 0.25
    assert got[1, 31].item() == -0.0 and got[1, 16].item() == 0.5 * 448 * 0.25  # code 8 is zero; code 1 x 448


def test_compressed_tensors_nvfp4_dequantizes_with_the_reciprocal_global_scale() -> None:
    t = {
        "m.weight_packed": _packed(),
        "m.weight_scale": _e4m3(_SCALES),
        "m.weight_global_scale": torch.tensor([1.0 / _GLOBAL]),
    }
    assert torch.equal(NVFP4_CT.dequantize(_reader(t), "m"), _nvfp4_expected())
    assert NVFP4_CT.read_input_scale(_reader({"m.input_global_scale": torch.tensor([8.0])}), "m") == 0.125


def _fp8(values: list[list[float]]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    q = t.to(torch.float8_e4m3fn)
    assert torch.equal(q.float(), t)  # every planted value is exactly an E4M3 value
    return q


def test_fp8_per_tensor_and_per_channel_dequantize_by_hand() -> None:
    q = _fp8([[1.0, -2.0, 0.5, 448.0], [0.015625, 3.0, -0.25, 6.0]])
    per_tensor = FP8.dequantize(_reader({"m.weight": q, "m.weight_scale": torch.tensor(0.125)}), "m")
    assert per_tensor.tolist() == [[0.125, -0.25, 0.0625, 56.0], [0.001953125, 0.375, -0.03125, 0.75]]
    per_channel = FP8.dequantize(_reader({"m.weight": q, "m.weight_scale": torch.tensor([[2.0], [0.5]])}), "m")
    assert per_channel.tolist() == [[2.0, -4.0, 1.0, 896.0], [0.0078125, 1.5, -0.125, 3.0]]


# 3 x 5 ones (and a -2) in 2 x 2 blocks: scale grid 2 x 3, the last block row and column ragged
_BLOCK_Q = [[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, -2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
_BLOCK_S = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
_BLOCK_W = [[1.0, 1.0, 2.0, 2.0, 3.0], [1.0, -2.0, 2.0, 2.0, 3.0], [4.0, 4.0, 5.0, 5.0, 6.0]]


def test_fp8_blocks_dequantize_by_hand() -> None:
    t = {"m.weight": _fp8(_BLOCK_Q), "m.weight_scale_inv": torch.tensor(_BLOCK_S)}
    assert FP8_BLOCK.dequantize(_reader(t), "m", (2, 2)).tolist() == _BLOCK_W


def test_modelopt_fp8_pb_blocks_dequantize_by_hand() -> None:
    """ModelOpt FP8_PB_WO stores the same grid as ``weight_scale`` [rows/b, 1, cols/b, 1]."""
    scale = torch.tensor(_BLOCK_S).reshape(2, 1, 3, 1)
    t = {"m.weight": _fp8(_BLOCK_Q), "m.weight_scale": scale}
    assert FP8_PB.dequantize(_reader(t), "m", (2, 2)).tolist() == _BLOCK_W


# ---- detection on real layouts -------------------------------------------------------------------------------------
class _Entry(NamedTuple):
    dtype: str
    shape: tuple[int, ...]


def _planted(o: int, i: int) -> dict[str, dict[str, _Entry]]:
    """Each kind's tensors for an [o, i] weight, written from the formats' specs (suffix -> entry)."""
    blocks = (math.ceil(o / 128), math.ceil(i / 128))
    return {
        "NVFP4": {
            "weight": _Entry("U8", (o, i // 2)),
            "weight_scale": _Entry("F8_E4M3", (o, i // 16)),
            "weight_scale_2": _Entry("F32", ()),
            "input_scale": _Entry("F32", ()),
        },
        "NVFP4-CT": {
            "weight_packed": _Entry("U8", (o, i // 2)),
            "weight_scale": _Entry("F8_E4M3", (o, i // 16)),
            "weight_global_scale": _Entry("F32", (1,)),
            "input_global_scale": _Entry("F32", (1,)),
        },
        "FP8": {
            "weight": _Entry("F8_E4M3", (o, i)),
            "weight_scale": _Entry("F32", ()),
            "input_scale": _Entry("F32", ()),
        },
        "FP8-block": {"weight": _Entry("F8_E4M3", (o, i)), "weight_scale_inv": _Entry("F32", blocks)},
        "FP8-PB": {"weight": _Entry("F8_E4M3", (o, i)), "weight_scale": _Entry("F32", (blocks[0], 1, blocks[1], 1))},
    }


def _real_linears() -> list[tuple[str, tuple[int, int]]]:
    """Every 2-D Linear of the real layout tables (Qwen3.5 dense and MoE, Qwen3-Next): (module, [out, in])."""
    out: list[tuple[str, tuple[int, int]]] = []
    for table in sorted(LAYOUTS.glob("*_weights_table.md")):
        stem = table.name.removesuffix("_weights_table.md")
        config = next(LAYOUTS.glob(stem + "_config*.json"))
        rows = {r.name: r for r in expand_layout(table, json.loads(config.read_text()))}
        for m in linear_modules({n: r.shape for n, r in rows.items()}):
            row = rows.get(m + ".weight")  # None: a fused 3-D expert bank, not one Linear
            # the MTP and two main layers (a linear- and a full-attention one, with their experts) of each table
            if row is not None and (m.startswith("mtp.") or any(f".layers.{i}." in m for i in (0, 3))):
                out.append((m, (row.shape[0], row.shape[1])))
    return out


REAL = _real_linears()


def test_the_real_layouts_were_read() -> None:
    names = {m for m, _ in REAL}
    assert len(REAL) > 1_000  # the MoE tables' experts expanded
    assert "mtp.layers.0.self_attn.q_proj" in names and "mtp.fc" in names
    assert any(".mlp.experts.255.down_proj" in m for m in names)


@pytest.mark.parametrize("stored", [k.label for k in KINDS])
def test_each_kind_is_detected_on_every_real_linear(stored: str) -> None:
    tensors: dict[str, _Entry] = {}
    for m, (o, i) in REAL:
        tensors |= {f"{m}.{suffix}": e for suffix, e in _planted(o, i)[stored].items()}
    want = next(k for k in KINDS if k.label == stored)
    for m, _ in REAL:
        assert kind_of(tensors, m) is want, m
        assert module_precision(tensors, m) == stored, m


def test_a_float_linear_is_no_kind() -> None:
    bf16 = {f"{m}.weight": _Entry("BF16", s) for m, s in REAL[:500]}
    assert all(kind_of(bf16, m) is None and module_precision(bf16, m) == "BF16" for m, _ in REAL[:500])


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("weight_scale_2", "weight is uint8 but weight_scale (fp8) / weight_scale_2 are missing"),
        ("weight_scale", "weight is uint8 but weight_scale (fp8) / weight_scale_2 are missing"),
    ],
)
def test_an_incomplete_nvfp4_is_no_kind_and_named_when_strict(drop: str, message: str) -> None:
    t = {f"m.{s}": e for s, e in _planted(64, 64)["NVFP4"].items() if s != drop}
    assert kind_of(t, "m") is None
    assert module_precision(t, "m") == "other (U8)"
    with pytest.raises(IncompleteKindError, match=message.replace("(", r"\(").replace(")", r"\)")):
        kind_of(t, "m", strict=True)


def test_incomplete_compressed_tensors_and_fp8_are_named() -> None:
    packed = {"m.weight_packed": _Entry("U8", (4, 8)), "m.weight_scale": _Entry("F8_E4M3", (4, 1))}
    fp8 = {"m.weight": _Entry("F8_E4M3", (4, 16))}
    assert kind_of(packed, "m") is None and module_precision(packed, "m") == "other (weight_packed)"
    assert kind_of(fp8, "m") is None and module_precision(fp8, "m") == "other (F8_E4M3)"
    with pytest.raises(IncompleteKindError, match="weight_packed without its scales"):
        kind_of(packed, "m", strict=True)
    with pytest.raises(IncompleteKindError, match="has no weight_scale / weight_scale_inv"):
        kind_of(fp8, "m", strict=True)


def test_a_per_channel_fp8_scale_is_fp8_not_blocks() -> None:
    """``[out, 1]`` is one scale per output channel (ModelOpt FP8_PER_CHANNEL_PER_TOKEN), ``[rows/128, cols/128]``
    blocks."""
    per_channel = {"m.weight": _Entry("F8_E4M3", (256, 512)), "m.weight_scale": _Entry("F32", (256, 1))}
    blocks = {"m.weight": _Entry("F8_E4M3", (256, 512)), "m.weight_scale": _Entry("F32", (2, 4))}
    assert kind_of(per_channel, "m") is FP8 and kind_of(blocks, "m") is FP8_PB


# ---- writing ------------------------------------------------------------------------------------------------------
def _on_grid(rows: int, cols: int) -> torch.Tensor:
    """A weight whose every 16-block holds 6.0 (the E2M1 maximum) and values of the E2M1 grid."""
    g = torch.tensor([_e2m1(c) for c in range(16)])
    w = g[torch.arange(rows * cols).reshape(rows, cols) % 16]
    w[:, ::16] = 6.0
    return w.to(torch.bfloat16)


def _on_fp8_grid(rows: int, cols: int) -> torch.Tensor:
    """E2M1 values x 64 (E4M3 values: 32, 96, 192, 384, ...) and one 448, so the per-tensor scale is 448 / 448 = 1."""
    w = _on_grid(rows, cols) * 64
    w[0, 1] = 448.0
    return w


@pytest.mark.parametrize(("written", "grid"), [(NVFP4, _on_grid), (FP8, _on_fp8_grid)], ids=["nvfp4", "fp8"])
def test_quantize_writes_the_planned_tensors_and_round_trips(
    written: StorageKind, grid: Callable[[int, int], torch.Tensor]
) -> None:
    assert written in WRITTEN.values()
    w = grid(32, 64)
    stored = written.quantize(w)
    plan = written.planned(32, 64, activations=False)
    assert {s: (str(t.dtype), tuple(t.shape)) for s, t in stored.items()} == {
        s: ({"U8": "torch.uint8", "F8_E4M3": "torch.float8_e4m3fn", "F32": "torch.float32"}[d], shape)
        for s, (d, shape) in plan.items()
    }
    back = written.dequantize(_reader({f"m.{s}": t for s, t in stored.items()}), "m")
    # every value is on both grids: exact up to the float32 rounding of the global scale (one ulp of it)
    torch.testing.assert_close(back, w.float(), rtol=2e-7, atol=0)
    assert "input_scale" in written.planned(32, 64, activations=True)


def test_compressed_tensors_writes_modelopt_nvfp4_with_the_reciprocal_global_scale() -> None:
    w = _on_grid(16, 32)
    a, b = NVFP4.quantize(w), NVFP4_CT.quantize(w)
    assert torch.equal(a["weight"], b["weight_packed"]) and torch.equal(a["weight_scale"], b["weight_scale"])
    assert b["weight_global_scale"].shape == (1,)
    assert float(b["weight_global_scale"]) == pytest.approx(1.0 / float(a["weight_scale_2"]), rel=1e-7)


def test_the_block_kinds_are_read_only() -> None:
    for stored in (FP8_BLOCK, FP8_PB):
        with pytest.raises(ValueError, match="mtpquant does not write"):
            stored.quantize(torch.ones(4, 16))


def test_input_scales_and_activation_quantization_by_hand() -> None:
    assert float(NVFP4.input_scale_from_amax(torch.tensor(2688.0))) == 1.0  # amax / (6 * 448)
    assert float(FP8.input_scale_from_amax(torch.tensor(448.0))) == 1.0  # amax / 448
    assert (NVFP4.input_amax_factor, FP8.input_amax_factor) == (2688.0, 448.0)
    # 0.3 / 1.0 rounds to the nearest E4M3 value 0.3125 (1.25 x 2^-2); 1 and 3 over 0.5 are exact
    x = torch.tensor([0.3, 1.0, 3.0])
    assert FP8.fake_quantize_input(x, 1.0)[0].item() == 0.3125
    assert FP8.fake_quantize_input(x[1:], 0.5).tolist() == [1.0, 3.0]


def test_layer_entries_and_logical_shapes() -> None:
    assert NVFP4.layer_entry("NVFP4") == {"quant_algo": "NVFP4", "group_size": 16}
    assert FP8.layer_entry("NVFP4") == {"quant_algo": "FP8"}
    assert NVFP4.logical_shape((8, 32)) == (8, 64) and NVFP4_CT.logical_shape((8, 32)) == (8, 64)
    assert FP8.logical_shape((8, 32)) == (8, 32)


def test_precision_choices_and_names() -> None:
    assert precision_kind("bf16") is None and not quantizes("bf16")
    assert precision_kind("nvfp4") is NVFP4 and precision_kind("fp8") is FP8 and quantizes("fp8")
    with pytest.raises(ValueError, match="precision 'fp4' is not one of bf16, nvfp4, fp8"):
        precision_kind("fp4")
    assert kind("fp8-block") is FP8_BLOCK
    with pytest.raises(ValueError, match="unknown storage kind"):
        kind("int4")
    assert OUTPUT_FORMATS["compressed-tensors"] is NVFP4_CT and not NVFP4_CT.heal_writes
    assert [k.name for k in KINDS if k.heal_writes] == ["nvfp4", "fp8"]
    assert len({k.name for k in KINDS}) == len({k.label for k in KINDS}) == len(KINDS)


# ---- no format string re-decided outside the formats package -------------------------------------------------------
# What a Linear's format is called anywhere: the kinds' names and labels, the precision choices, the quant_algo and
# quant_method values that name one, and compressed-tensors' format.
FORMAT_STRINGS = frozenset(
    {k.name for k in KINDS}
    | {k.label for k in KINDS}
    | {"bf16", "BF16", "mxfp8", "MXFP8", "W4A16_NVFP4", "FP8_PB_WO", "FP8_BLOCK_SCALES", "FP8_PER_CHANNEL_PER_TOKEN"}
    | {"compressed-tensors", "nvfp4-pack-quantized", "modelopt_fp4", "nvfp4_w4a16"}
)

# The comparisons left, each at a boundary: a command-line value, a recipe or config field, or a record read back,
# turned into a decision where it is read (file -> the strings it may compare with, and why).
BOUNDARIES: dict[str, tuple[frozenset[str], str]] = {
    "recipes/recipe.py": (frozenset({"nvfp4"}), "the recipe's quantization.scheme field"),
    "tune/run.py": (frozenset({"NVFP4"}), "QUANT's declared quant_algo"),
    "convert/ct_format.py": (frozenset({"NVFP4", "nvfp4"}), "the recipe's quant_algo and --mtp-format"),
    "convert/plan.py": (frozenset({"compressed-tensors"}), "convert's --format value"),
    "convert/run.py": (frozenset({"compressed-tensors"}), "convert's --format value"),
    "engine/vllm.py": (frozenset({"FP8", "fp8"}), "vLLM's rules on the declared quant_algo / quant method"),
    "engine/sglang.py": (frozenset({"fp8", "modelopt_fp4"}), "SGLang's rules on the declared quant method"),
    "publish/card/body.py": (frozenset({"NVFP4", "BF16"}), "the declared quant_algo; heal's record read back"),
}


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in FORMAT_STRINGS else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def comparisons(source: str) -> list[tuple[int, str]]:
    """(line, string) of every comparison with a format string in ``source``: ``==``/``!=``/``in`` against it (alone
    or in a tuple, list or set), ``startswith``/``endswith`` with it, a ``match`` case on it."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, s) for o in (node.left, *node.comparators) for s in _strings(o)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, s) for s in _strings(node.value)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and node.args
        ):
            found += [(node.lineno, s) for s in _strings(node.args[0])]
    return found


def misplaced(package: Path) -> tuple[int, dict[str, list[tuple[int, str]]]]:
    """(modules read, {module: [(line, string)]}) of the format-string comparisons outside ``formats/`` and the
    boundaries."""
    scanned, wrong = 0, {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        scanned += 1
        if rel.startswith("formats/"):
            continue
        allowed = BOUNDARIES.get(rel, (frozenset(), ""))[0]
        bad = [(line, s) for line, s in comparisons(path.read_text()) if s not in allowed]
        if bad:
            wrong[rel] = bad
    return scanned, wrong


def test_no_module_compares_format_strings_outside_the_formats_package() -> None:
    scanned, wrong = misplaced(PACKAGE)
    assert scanned > 100
    assert wrong == {}


def test_every_boundary_is_still_one() -> None:
    """An allowance no longer used is removed (the list says where the strings are, not where they were)."""
    for rel, (allowed, _) in BOUNDARIES.items():
        found = {s for _, s in comparisons((PACKAGE / rel).read_text())}
        assert allowed <= found, (rel, sorted(allowed - found))


def test_a_planted_comparison_fails_the_check(tmp_path: Path) -> None:
    copy = tmp_path / "mtpquant"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    (copy / "validate" / "planted.py").write_text('def f(kind: str) -> bool:\n    return kind == "nvfp4-ct"\n')
    with (copy / "heal" / "__init__.py").open("a") as f:
        f.write('\n\ndef _planted(fmt: str) -> bool:\n    return fmt in ("bf16", "other")\n')
    lines = len((copy / "heal" / "__init__.py").read_text().splitlines())
    with (copy / "formats" / "fp8.py").open("a") as f:
        f.write('\n\ndef _planted(fmt: str) -> bool:\n    return fmt == "fp8"\n')
    _, wrong = misplaced(copy)
    assert wrong == {"validate/planted.py": [(2, "nvfp4-ct")], "heal/__init__.py": [(lines, "bf16")]}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('if fmt == "nvfp4": pass', [(1, "nvfp4")]),
        ('x = p != "bf16"', [(1, "bf16")]),
        ('ok = kind in ("nvfp4", "nvfp4-ct")', [(1, "nvfp4"), (1, "nvfp4-ct")]),
        ('ok = disk == "FP8-block"', [(1, "FP8-block")]),
        ('ok = m.startswith("MXFP8")', [(1, "MXFP8")]),
        ('match fmt:\n    case "fp8":\n        pass', [(2, "fp8")]),
        ('x = {"nvfp4": 1}', []),  # a table keyed by it is data, not a decision
        ("if k is NVFP4: pass", []),
    ],
)
def test_the_check_sees_every_form_of_comparison(source: str, expected: list[tuple[int, str]]) -> None:
    assert comparisons(source) == expected
