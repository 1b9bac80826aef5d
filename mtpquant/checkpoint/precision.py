"""On-disk precision of each Linear module, read from tensor names and dtypes in the header table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.modules import FUSED_EXPERT_PARAMS, linear_modules
from mtpquant.formats.kinds import FP8, kind_of

__all__ = [
    "is_quantized",
    "linear_precisions",
    "linears_text",
    "module_precision",
    "table_precision",
]

def module_precision(tensors: Mapping[str, Any], module: str) -> str:
    """BF16/F16/F32, a storage kind's label (``formats.kinds``: NVFP4, NVFP4-CT, FP8, FP8-block, FP8-PB), missing,
    other."""
    if module.endswith(FUSED_EXPERT_PARAMS):
        e = tensors.get(module)
        return "missing" if e is None else (e.dtype if e.dtype in FLOAT_DTYPES else f"other ({e.dtype})")
    kind = kind_of(tensors, module)
    if kind is not None:
        return kind.label
    if module + ".weight_packed" in tensors:
        return "other (weight_packed)"
    w = tensors.get(module + ".weight")
    if w is None:
        return "missing"
    scale = tensors.get(module + ".weight_scale")
    if w.dtype in FLOAT_DTYPES and scale is None and module + ".weight_scale_inv" not in tensors:
        return str(w.dtype)
    return f"other ({w.dtype})"


def linear_precisions(tensors: Mapping[str, Any]) -> dict[str, str]:
    """Every Linear module of ``tensors`` (``modules.linear_modules``) -> its precision on disk
    (``module_precision``)."""
    return {m: module_precision(tensors, m) for m in linear_modules(tensors)}


def table_precision(tensors: Mapping[str, Any], table: str, shards: Sequence[str]) -> str:
    """Precision of an embedding table stored in shards (``TABLE.shard_i.weight``) with one table-wide FP8 scale
    (``TABLE.weight_scale``): BF16/F16/F32, FP8, or other."""
    dtypes = {tensors[s + ".weight"].dtype for s in shards if s + ".weight" in tensors}
    if len(dtypes) != 1:
        return "missing" if not dtypes else "mixed"
    (dtype,) = dtypes
    if dtype in FLOAT_DTYPES:
        return str(dtype)
    if FP8.stores(dtype) and table + ".weight_scale" in tensors:
        return FP8.label
    return f"other ({dtype})"


def is_quantized(precision: str) -> bool:
    """True for quantized on-disk formats (not an unquantized float dtype, not missing): the one rule."""
    return precision not in FLOAT_DTYPES and precision != "missing"


def linears_text(precisions: Mapping[str, int]) -> str:
    """``{"BF16": 7, "NVFP4": 25}`` -> ``32 Linears: 25 quantized (NVFP4 25), 7 unquantized (BF16 7)``."""
    quantized = {p: n for p, n in precisions.items() if is_quantized(p)}
    plain = {p: n for p, n in precisions.items() if p not in quantized}

    def part(what: str, group: Mapping[str, int]) -> str:
        return f"{what} (" + ", ".join(f"{p} {n}" for p, n in group.items()) + ")"

    total = f"{sum(precisions.values())} Linears"
    if not quantized or not plain:
        return f"{total}, all " + part("quantized" if quantized else "unquantized", quantized or plain)
    n_q, n_p = sum(quantized.values()), sum(plain.values())
    return f"{total}: {n_q} " + part("quantized", quantized) + f", {n_p} " + part("unquantized", plain)
