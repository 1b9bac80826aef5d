"""Lineage: may SRC's MTP be grafted into QUANT? Same family, same dimensions, matching MTP shapes.

Everything here reads headers and configs only (one small tensor at most, for a soft weight check),
so a refusal costs nothing and happens before any byte is written.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.modules import QUANT_PARAMS
from mtpquant.checkpoint.precision import is_quantized, module_precision
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import GraftError, LineageError
from mtpquant.families import dimension_differences

__all__ = [
    "GraftError",
    "LineageError",
    "LineageReport",
    "check_lineage",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LineageReport:
    """What the lineage check established."""

    family: str
    mtp_layers: int  # MTP depth taken from SRC's tensors
    expected: dict[str, tuple[int, ...]] = field(repr=False)  # MTP names/shapes QUANT's config implies
    mtp_bytes: int = 0
    warnings: tuple[str, ...] = ()
    # SRC's MTP name -> its name in QUANT, where they differ (a standalone NextN export's layer 0 -> layer N)
    renamed: dict[str, str] = field(default_factory=dict, repr=False)
    # MTP copies SRC lacks and QUANT's own tensors give (the head / embedding copies a NextN export dropped):
    # name in the result -> QUANT's tensor
    from_quant: dict[str, str] = field(default_factory=dict, repr=False)


def _final_norm_warning(quant: Checkpoint, src: Checkpoint) -> str | None:
    """Soft check that both hold the same weights: the (never quantized) final norm, byte for byte."""
    qname, sname = quant.main_prefix + "norm.weight", src.main_prefix + "norm.weight"
    q, s = quant.tensors.get(qname), src.tensors.get(sname)
    if q is None or s is None or q.dtype != s.dtype or q.shape != s.shape:
        return None
    if hashlib.sha256(quant.read_raw(q)).digest() != hashlib.sha256(src.read_raw(s)).digest():
        return (
            f"{qname} differs between QUANT and SRC: QUANT may come from another fine-tune of this "
            "architecture; its MTP from SRC may draft poorly"
        )
    return None


def check_lineage(quant: Checkpoint, src: Checkpoint, *, weight_check: bool = True) -> LineageReport:
    """Refuse (one line naming every differing field) unless SRC's MTP fits QUANT.

    Checks the family, the dimensions (hidden size, vocab, heads, head dims, experts, layer count),
    the MTP depth, and that SRC holds exactly the unquantized MTP tensors QUANT's config implies.
    """
    qs, ss = quant.spec, src.spec
    if qs.family.key != ss.family.key:
        raise LineageError(
            f"lineage mismatch: QUANT is {qs.family.display} ({qs.architecture}), SRC is "
            f"{ss.family.display} ({ss.architecture})"
        )
    # a standalone NextN export keeps one layer, its MTP: the trunk's depth is QUANT's to say
    src_text = {**ss.text, "num_hidden_layers": qs.text.get("num_hidden_layers")} if ss.nextn_standalone else ss.text
    diffs = dimension_differences(qs.text, src_text, qs.family)
    rename = ss.mtp_rename_to(qs)
    src_mtp = {rename(e.name): e for e in src.mtp_tensors()}
    if not src_mtp:
        from mtpquant.errors import MtpModeError

        raise MtpModeError(
            f"{src.label}: SRC has no MTP tensors (its config: {ss.mtp.describe()}); graft needs the original "
            "checkpoint that still has its MTP"
        )
    layers = ss.mtp_depth(e.name for e in src_mtp.values())  # SRC's own numbering
    if qs.mtp.declared and layers and qs.mtp.layers != layers:
        diffs.append(f"MTP layers {qs.mtp.layers} ({qs.mtp.describe()}) vs {layers} in SRC's tensors")
    # Shapes of tensors both hold unquantized (embeddings, norms, vision, ...): a cheap second opinion. (A quantized
    # Linear's tensors are not among them: its weight is packed, its scales exist in QUANT alone.)
    for name in sorted(set(quant.tensors) & set(src.tensors)):
        q, s = quant.tensors[name], src.tensors[name]
        if qs.is_mtp(name) or ss.is_mtp(name) or q.dtype not in FLOAT_DTYPES or s.dtype not in FLOAT_DTYPES:
            continue
        if q.shape != s.shape:
            diffs.append(f"{name} shape {list(q.shape)} vs {list(s.shape)}")
            if len(diffs) > 8:
                break
    if diffs:
        raise LineageError("lineage mismatch between QUANT and SRC: " + "; ".join(diffs))

    from mtpquant.surgery.metadata import spec_with_mtp_layers

    target = spec_with_mtp_layers(qs, layers)
    expected = target.expected_mtp_shapes(src_mtp)
    from_quant = _copies_from_quant(quant, set(expected) - set(src_mtp)) if ss.nextn_standalone else {}
    missing = sorted(set(expected) - set(src_mtp) - set(from_quant))
    extra = target.mtp_unexpected(src_mtp, expected)
    if extra:
        quantized = [n for n in extra if n.endswith(QUANT_PARAMS)]
        if quantized:
            raise GraftError(
                f"{src.label}: SRC's MTP is quantized ({quantized[0]}); graft copies an unquantized MTP: "
                "point --from at the BF16 original"
            )
        raise LineageError(
            f"lineage mismatch: SRC has MTP tensors QUANT's config does not imply ({len(extra)}, first {extra[0]})"
        )
    if missing:
        raise GraftError(
            f"{src.label}: SRC's MTP is incomplete: {len(missing)} of {len(expected)} tensors missing "
            f"(first {missing[0]})"
        )
    shape_diffs = [
        f"{n} {list(src_mtp[n].shape)} in SRC vs {list(shape)} implied by QUANT"
        for n, shape in sorted(expected.items())
        if n in src_mtp and src_mtp[n].shape != shape
    ]
    if shape_diffs:
        raise LineageError("lineage mismatch in MTP shapes: " + "; ".join(shape_diffs[:4]))
    if qs.family.mtp.inventory != "exact":  # the glue checked; the layers' blocks are SRC's as they are
        expected = {n: e.shape for n, e in src_mtp.items()}
    odd = sorted(n for n, e in src_mtp.items() if e.dtype not in FLOAT_DTYPES)
    if odd:
        raise GraftError(
            f"{src.label}: SRC's MTP tensor {odd[0]} is {src_mtp[odd[0]].dtype}; graft copies an unquantized "
            "MTP: point --from at the BF16 original"
        )

    warnings: list[str] = []
    if weight_check:
        warning = _final_norm_warning(quant, src)
        if warning:
            log.warning("%s", warning)
            warnings.append(warning)
    return LineageReport(
        family=qs.family.key,
        mtp_layers=layers,
        expected=expected,
        mtp_bytes=sum(e.nbytes for e in src_mtp.values()) + sum(quant.tensors[n].nbytes for n in from_quant.values()),
        warnings=tuple(warnings),
        renamed={e.name: n for n, e in src_mtp.items() if e.name != n},
        from_quant=from_quant,
    )


def _copies_from_quant(quant: Checkpoint, wanted: set[str]) -> dict[str, str]:
    """The head / embedding copies a standalone NextN export dropped (SGLang's export skips them: its loader takes
    the target's), as QUANT's own unquantized ``lm_head`` and embedding: result name -> QUANT's tensor. A copy QUANT
    cannot give unquantized is left missing (graft then refuses, naming it)."""
    out: dict[str, str] = {}
    for name in sorted(wanted):
        if name.endswith(".shared_head.head.weight"):
            source = "lm_head.weight"
        elif name.endswith(".embed_tokens.weight"):
            source = quant.main_prefix + "embed_tokens.weight"
        else:
            continue
        entry = quant.tensors.get(source)
        stem = source.removesuffix(".weight")
        if entry is not None and not is_quantized(module_precision(quant.tensors, stem)):
            out[name] = source
    return out
