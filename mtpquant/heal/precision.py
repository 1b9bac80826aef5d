"""The precision QUANT keeps its MTP in, the weights healing starts from, and the healed MTP written back in it.

heal writes the healed MTP in exactly the layout QUANT has, so every engine loads it as before:

- unquantized (BF16 / FP16 / FP32): every tensor in its stored dtype (float32 training weights rounded to it);
- ModelOpt NVFP4 / FP8 per tensor (``convert --mtp quantize``'s layout): the quantized Linears through
  ``mtp.quantize.quantize_mtp`` (modelopt's export math: weight, ``weight_scale``, ``weight_scale_2`` shared by fused
  groups), from the healed weights rounded to SRC's dtype first, as convert quantizes the source; each
  ``input_scale`` is QUANT's own, byte for byte (the fake quantization trained with it); ``mtp.fc``, norms, router
  and ``shared_expert_gate`` in their stored dtype;
- each precision group in its own format (``convert --mtp auto``, ``tune-mtp``: some groups NVFP4, some FP8, the rest
  BF16): the same, each quantized Linear in its own format (``quantize_mtp``'s precision per module).

The routed experts go back in QUANT's form: a fused bank (``experts.gate_up_proj`` [E, 2I, H]) stays fused, a
per-expert one per expert (the reference forward trains them fused: ``mtp.quantize.fuse_mtp_experts``; convert's
quantized experts are per expert, ``mtp.quantize.per_expert_weights``).

Training starts from QUANT's own MTP when it is unquantized (a BF16 MTP healed twice keeps the first heal), and from
SRC's BF16 MTP when QUANT's is quantized (the weights it was quantized from). Other layouts (FP8 blocks, AWQ
pre-quant scales, compressed-tensors, a quantized set other than modelopt's) are refused before any work.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtpquant.checkpoint.dtypes import planned, torch_dtype
from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import PlannedTensor
from mtpquant.errors import HealRefusedError
from mtpquant.formats.kinds import UNQUANTIZED, WRITTEN, StorageKind
from mtpquant.heal.support import WRITES_BACK

if TYPE_CHECKING:
    from torch import Tensor

    from mtpquant.families import MtpLayout
    from mtpquant.measure.weights import LinearFormat

# torch and the torch-side MTP code (``mtp.quantize``) are imported where they are used: planning a heal
# (``mtp_storage``) must not load them before QUANT and SRC are open (an unreachable Hub id is refused first).

__all__ = ["MtpStorage", "export_mtp", "master_weights", "mtp_storage"]


@dataclass(frozen=True)
class MtpStorage:
    """How QUANT stores its MTP: each quantized Linear's storage kind (``kinds``; empty: unquantized, whatever the float
    dtype), in ModelOpt's layout, each precision group in one kind (``convert --mtp auto`` and ``tune-mtp`` may store
    groups in different ones); whether they carry input scales (W4A4 / W8A8)."""

    kinds: Mapping[str, StorageKind]  # module name (``mtp.layers.0.self_attn.q_proj``) -> its kind
    activations: bool
    input_scales: Mapping[str, float]  # module -> QUANT's input_scale (modelopt convention)

    @property
    def quantized(self) -> tuple[str, ...]:
        """The quantized Linears' module names, sorted."""
        return tuple(sorted(self.kinds))

    @property
    def fmt(self) -> str:
        """``bf16`` (unquantized), the one kind's name (``nvfp4``, ``fp8``), or ``mixed``."""
        names = {k.name for k in self.kinds.values()}
        return UNQUANTIZED if not names else names.pop() if len(names) == 1 else "mixed"

    def kind_of(self, module: str) -> StorageKind:
        """The kind quantized Linear ``module`` is stored in."""
        return self.kinds[module]

    @property
    def precision(self) -> dict[str, str]:
        """Every quantized Linear -> its precision choice (``quantize_mtp``'s ``precision``)."""
        return {m: self.kinds[m].name for m in self.quantized}

    @property
    def label(self) -> str:
        """``BF16`` / ``NVFP4 (W4A4)`` / ``FP8 (weights only)`` / ``mixed: 4 NVFP4, 3 FP8 (W4A4 / W8A8)``, for the
        plan and the record."""
        kinds = set(self.kinds.values())
        if not kinds:
            return "BF16"
        if len(kinds) > 1:
            counts = Counter(self.kinds.values())
            parts = ", ".join(f"{counts[k]} {k.label}" for k in WRITTEN.values() if counts[k])
            return f"mixed: {parts} ({'W4A4 / W8A8' if self.activations else 'weights only'})"
        (kind,) = kinds
        return f"{kind.label} ({kind.scheme if self.activations else 'weights only'})"


def mtp_storage(quant: Checkpoint, formats: Mapping[str, LinearFormat]) -> MtpStorage:
    """QUANT's MTP storage from its header table and the quantized-Linear formats validate's reader found
    (``CheckpointWeights.formats``); refuses what heal cannot write back."""
    label = quant.label
    mtp_formats = {m: f for m, f in formats.items() if quant.is_mtp(m)}
    if not mtp_formats:
        bad = sorted(e.name for e in quant.mtp_tensors() if e.dtype not in FLOAT_DTYPES)
        if bad:
            dtype = quant.tensors[bad[0]].dtype
            raise HealRefusedError(f"{label}: MTP tensor {bad[0]} is {dtype}; heal cannot read that layout")
        return MtpStorage({}, False, {})
    stored: dict[str, StorageKind] = {m: f.kind for m, f in mtp_formats.items()}
    if not all(k.heal_writes for k in stored.values()):
        shown = ", ".join(sorted({k.name for k in stored.values()}))
        raise HealRefusedError(f"{label}: its MTP is stored as {shown}; {WRITES_BACK}")
    pre = sorted(m for m, f in mtp_formats.items() if f.has_pre_quant_scale)
    if pre:
        raise HealRefusedError(f"{label}: {pre[0]} has an AWQ pre_quant_scale; heal cannot write that layout back")
    # the Linears by their .weight names alone (a packed or fused-expert name is not one modelopt's layout writes)
    weights = {e.name: e.shape for e in quant.mtp_tensors() if e.name.endswith(".weight")}
    odd = _odd_module(linear_modules(weights), stored, quant.spec.family.mtp)
    if odd is not None:
        raise HealRefusedError(
            f"{label}: its MTP quantizes another set of Linears than modelopt's MTP layout or whole precision groups "
            f"({odd}); heal cannot write it back in the same layout"
        )
    scales = {m: f.input_scale for m, f in mtp_formats.items()}
    have = {m for m, s in scales.items() if s is not None}
    if have and have != set(scales):
        raise HealRefusedError(f"{label}: only some MTP Linears have an input_scale ({sorted(have)[0]})")
    return MtpStorage(stored, bool(have), {m: float(s) for m, s in scales.items() if s})


def _odd_module(modules: list[str], formats: Mapping[str, StorageKind], layout: MtpLayout) -> str | None:
    """A quantized Linear heal could not write back as it is stored (None: all fine): QUANT quantizes exactly
    modelopt's MTP set in one format (``convert --mtp quantize``), or whole precision groups of the family, each in
    one format (``convert --mtp auto``, ``tune-mtp``: ``quantize_mtp``'s precision per group)."""
    from mtpquant.mtp.quantize import mtp_quantized_modules

    expected = set(mtp_quantized_modules(modules, layout))
    if set(formats) == expected and len(set(formats.values())) == 1:
        return None
    for group in layout.groups:
        members = [m for m in modules if layout.group_of(m) is group]
        stored = {formats.get(m) for m in members}
        if len(stored) > 1:  # part of a group quantized, or a group in two formats
            return next(m for m in members if formats.get(m) != formats.get(members[0]))
    return next((m for m in sorted(formats) if layout.group_of(m) is None), None)


def master_weights(quant: Checkpoint, src: Checkpoint, storage: MtpStorage) -> tuple[dict[str, Tensor], str]:
    """The float32 MTP weights healing starts from, and which checkpoint they come from."""
    import torch

    origin = src if storage.kinds else quant
    names = sorted(e.name for e in origin.mtp_tensors())
    bad = [n for n in names if origin.tensors[n].dtype not in FLOAT_DTYPES]
    if bad:
        raise HealRefusedError(
            f"{origin.label}: MTP tensor {bad[0]} is {origin.tensors[bad[0]].dtype}; healing a quantized MTP starts "
            "from SRC's unquantized one"
        )
    origin.prefetch(names)
    return {n: origin.read_tensor(n).to(torch.float32) for n in names}, origin.label


def _as_stored(tensors: Mapping[str, Tensor], stored: Mapping[str, object]) -> dict[str, Tensor]:
    """``tensors`` with fused expert banks split per expert where QUANT stores them so (names not in ``stored``)."""
    from mtpquant.mtp.quantize import per_expert_weights

    if all(name in stored for name in tensors):
        return dict(tensors)
    return per_expert_weights(tensors)


def export_mtp(
    quant: Checkpoint, src: Checkpoint, storage: MtpStorage, healed: Mapping[str, Tensor]
) -> list[PlannedTensor]:
    """Every ``mtp.*`` tensor of QUANT with the healed values, in QUANT's names, dtypes and shapes."""
    import torch

    from mtpquant.mtp.quantize import quantize_mtp

    entries = {e.name: e for e in quant.mtp_tensors()}
    out: dict[str, Tensor] = {}
    if storage.kinds:
        # quantize as convert does: from the source's dtype (the healed float32 rounded to it), modelopt's math
        src_dtype = {n: torch_dtype(src.tensors[n].dtype) for n in healed if n in src.tensors}
        weights = _as_stored({n: t.to(src_dtype.get(n, torch.bfloat16)) for n, t in healed.items()}, entries)
        result = quantize_mtp(weights, None, activations=False, layout=quant.spec.family.mtp,
                              precision=storage.precision)
        quantized = {m + ".weight" for m in storage.quantized}
        for name, tensor in result.tensors.items():
            out[name] = tensor
        for m in storage.quantized:
            if storage.activations:
                out[m + ".input_scale"] = quant.read_tensor(m + ".input_scale")  # QUANT's own bytes
        for name, tensor in _as_stored(healed, entries).items():
            if name not in quantized:
                out[name] = tensor.to(torch_dtype(entries[name].dtype))
    else:
        for name, tensor in _as_stored(healed, entries).items():
            out[name] = tensor.to(torch_dtype(entries[name].dtype))
    if set(out) != set(entries):
        diff = sorted(set(out) ^ set(entries))[0]
        raise HealRefusedError(f"{quant.label}: the healed MTP would not have QUANT's tensor set ({diff})")
    tensors: list[PlannedTensor] = []
    for name in sorted(out):
        t = out[name].detach().cpu().contiguous()
        e = entries[name]
        if torch_dtype(e.dtype) != t.dtype or tuple(e.shape) != tuple(t.shape):
            raise HealRefusedError(
                f"{quant.label}: the healed {name} would be {t.dtype} {tuple(t.shape)}, QUANT has {e.dtype} "
                f"{tuple(e.shape)}"
            )
        tensors.append(planned(name, t))
    return tensors
