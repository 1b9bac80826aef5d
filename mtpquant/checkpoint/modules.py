"""The module vocabulary of a tensor table: which tensors belong to one module, and which modules are Linears.

One home for what inspect, graft's metadata planner, convert's plan and the repairs all ask of a header table
(``tensors`` maps names to header entries: ``shape``, ``dtype``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FUSED_EXPERT_PARAMS", "PRECISION_SUFFIXES", "QUANT_PARAMS", "linear_modules", "module_of"]

# Tensor name suffixes that belong to one Linear module's weight and its quantization scales.
PRECISION_SUFFIXES = (
    ".weight_scale_inv",
    ".weight_global_scale",
    ".input_global_scale",
    ".weight_scale_2",
    ".weight_scale",
    ".weight_packed",
    ".input_scale",
    ".weight",
)
# The names of a quantized Linear's quantization parameters (its scales, its packed weight).
QUANT_PARAMS = PRECISION_SUFFIXES[:-1]
FUSED_EXPERT_PARAMS = (".experts.gate_up_proj", ".experts.down_proj")  # Qwen3.5-MoE: [E, out, in] tensors


def module_of(name: str) -> str:
    """Module name of a tensor (``a.b.q_proj.weight_scale`` -> ``a.b.q_proj``)."""
    for suffix in PRECISION_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def linear_modules(tensors: Mapping[str, Any]) -> list[str]:
    """Checkpoint Linear modules: 2-D weights (or packed weights), plus fused 3-D expert params; the one rule of
    what a Linear is. ``tensors`` maps names to what has a ``shape`` (header entries, tensors) or to shapes."""
    mods = set()
    for name, e in tensors.items():
        if name.endswith(".weight"):  # most names of a table: test this first
            if len(getattr(e, "shape", e)) == 2:
                mods.add(name[:-7])
        elif name.endswith(".weight_packed"):
            mods.add(name[:-14])
        elif name.endswith(FUSED_EXPERT_PARAMS) and len(getattr(e, "shape", e)) == 3:
            mods.add(name)
    # embedding tables, not Linears (Nemotron-H names its table ``backbone.embeddings``)
    return sorted(m for m in mods if not m.endswith(("embed_tokens", "pos_embed", ".embeddings")))
