"""The chosen configuration's MTP tensors, ready for a shard writer (``surgery.shards.write_planned_mtp``): convert
``--mtp auto`` writes them into OUT's ``mtp-*`` shards, ``tune-mtp`` in place of QUANT's MTP (the graft way).

Quantized groups come from ``mtp.quantize.quantize_mtp`` with the search's calibrated input amax; every other
``mtp.*`` tensor is SRC's own bytes (norms, router, gates, the groups left in BF16; fused 3-D experts stay fused
when they are). The BF16 configuration is SRC's MTP byte for byte, as ``--mtp keep`` writes it. With ``--heal`` the
chosen finalist's healed weights take the place of SRC's (rounded to SRC's dtypes, then quantized the same way). The
tensor set is checked against the space's header plan before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from mtpquant.checkpoint.dtypes import planned
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import PlannedTensor
from mtpquant.mtp.quantize import quantize_mtp
from mtpquant.search.space import Assignment, MtpSpace, layer_entry
from mtpquant.surgery.shards import mtp_planned_tensors

__all__ = ["ChosenMtp", "chosen_mtp"]


@dataclass(frozen=True)
class ChosenMtp:
    """The tensors to write, and (declared MIXED_PRECISION) the ``quantized_layers`` entries of the MTP."""

    tensors: list[PlannedTensor]
    quantized_layers: dict[str, dict[str, Any]]
    declaration: str  # plain | mixed


def chosen_mtp(
    src: Checkpoint,
    space: MtpSpace,
    assignment: Assignment,
    amax: Mapping[str, Tensor],
    weights: Mapping[str, Tensor] | None = None,
) -> ChosenMtp:
    """``assignment``'s MTP from ``src``'s ``mtp.*`` tensors (or ``weights``: ``--heal``'s healed MTP in their
    form, ``search.measure.source_form``) and the calibrated ``amax``."""
    declaration = space.declaration(assignment)
    if declaration.kind is None:
        raise ValueError(f"{assignment.label}: the chosen engines do not load it ({declaration.refusal})")
    if assignment.all_bf16 and weights is None:
        return ChosenMtp(mtp_planned_tensors(src), {}, declaration.kind)
    names = sorted(e.name for e in src.mtp_tensors())
    healed = weights is not None
    if weights is None:
        weights = {n: src.read_tensor(n) for n in names}
    result = quantize_mtp(
        weights, amax, activations=space.activations, layout=space.family.mtp,
        precision=space.module_precision(assignment),
    )  # fmt: skip
    quantized = set(result.precision)
    kept = []
    for name in names:
        pieces = space.split.get(name)
        if pieces is not None:  # fused experts: SRC's tensor while none of its experts is quantized
            if not any(p.removesuffix(".weight") in quantized for p in pieces):
                kept.append(name)
        elif name.removesuffix(".weight") not in quantized:
            kept.append(name)
    rest = [planned(n, weights[n]) for n in kept] if healed else mtp_planned_tensors(src, kept)
    tensors = [planned(n, t) for n, t in result.tensors.items()] + rest
    plan = space.planned_table(assignment)
    got = {t.name: (t.dtype, tuple(t.shape)) for t in tensors}
    if got != {n: (p.dtype, p.shape) for n, p in plan.items()}:
        odd = sorted(set(got) ^ set(plan)) or sorted(n for n in got if got[n] != (plan[n].dtype, plan[n].shape))
        raise AssertionError(f"internal: the MTP written for {assignment.label} is not its plan ({odd[0]})")
    layers = (
        {m: layer_entry(p, space.main_algo) for m, p in sorted(result.precision.items())}
        if declaration.kind == "mixed"
        else {}
    )
    return ChosenMtp(sorted(tensors, key=lambda t: t.name), layers, declaration.kind)
