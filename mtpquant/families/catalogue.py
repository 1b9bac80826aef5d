"""The registry as a table: each family's model types, drafters, where its MTP lives and what mtpquant does with it.

``mtpquant families`` prints it (``--json``: the rows), ``docs/families-table.md`` is its Markdown, and the README's
block between ``<!-- families:begin -->`` and ``<!-- families:end -->`` is its summary (the families grouped by what
works on them): all from the registry, so none of them can drift from it (a test renders both and compares).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mtpquant.families.schema import SEPARATE, SUPPORTED, Family
from mtpquant.families.spec import FAMILIES
from mtpquant.families.storage import APPENDED

__all__ = ["CAPABILITIES", "FamilyRow", "catalogue", "family_row", "render_markdown", "render_summary"]

# What a family can be put through, in the order the table lists them.
CAPABILITIES = ("inspect", "graft", "extract", "fix_metadata", "convert", "validate", "heal", "search")


@dataclass(frozen=True)
class FamilyRow:
    """One family as ``mtpquant families`` reports it."""

    key: str
    display: str
    model_types: list[str]
    architectures: list[str]
    vllm_drafters: list[str]  # vLLM 0.32's drafter classes for this family's MTP
    sglang_drafter: str  # "" where SGLang has none (or none is recorded)
    storage: str  # "appended" | "namespace" | "subspace" | "separate"
    mtp_location: str  # where the MTP tensors are, e.g. "model.layers.{N+i}.*"
    depth_keys: list[str]
    copies: list[str]  # head / embedding copies a layer may carry
    vllm_remap: str
    exclusions: str  # the exclusion patterns that cover the whole MTP
    status: str
    works: dict[str, bool]
    sources: list[str]

    def to_json(self) -> dict[str, Any]:
        """The row as plain JSON."""
        return asdict(self)


def _location(family: Family) -> tuple[str, str, str]:
    """(storage class, where the tensors are, the exclusion patterns that cover them)."""
    storage = family.mtp.storage
    if family.status == SEPARATE:
        return "separate", "a separate drafter model, not in the target", "-"
    if storage.kind == APPENDED:  # under each prefix the family's checkpoints use (a wrapper's, a text-only export's)
        prefixes = tuple(dict.fromkeys((family.wrapper_prefix, *family.text_only_prefixes)))
        where = ", ".join(f"{p}layers.{{N+i}}.*" for p in prefixes)
        return APPENDED, where, ", ".join(f"{p}layers.{{N+i}}*" for p in prefixes)
    infixes = storage.layers or (storage.layer,)
    where = ", ".join(f"{storage.root}{infix}{{i}}.*" for infix in infixes)
    stem = storage.root.rstrip(".")
    return storage.kind, where, f"{stem}*"


def family_row(family: Family) -> FamilyRow:
    """The catalogue row of one family."""
    storage, where, exclusions = _location(family)
    supported = family.status == SUPPORTED
    vllm = family.vllm_drafters or tuple(d for d in (family.engine.drafters.get("vllm", ""),) if d)
    works = {
        "inspect": True,  # every family: inspect says what it found, or why there is nothing to find
        "graft": supported,
        "extract": supported,
        "fix_metadata": supported,
        "convert": supported and family.convert,
        "validate": supported and family.mtp_forward,
        "heal": supported and family.mtp_forward and family.mtp_heal,
        "search": supported and family.convert and family.mtp_forward and bool(family.mtp.groups),
    }
    return FamilyRow(
        key=family.key,
        display=family.display,
        model_types=sorted(family.model_types),
        architectures=sorted(family.architectures),
        vllm_drafters=list(vllm),
        sglang_drafter=family.engine.drafters.get("sglang", ""),
        storage=storage,
        mtp_location=where,
        depth_keys=list(family.mtp.depth_keys),
        copies=list(family.mtp.copies),
        vllm_remap=family.vllm_remap,
        exclusions=exclusions,
        status=family.status,
        works=works,
        sources=list(family.sources),
    )


def catalogue() -> list[FamilyRow]:
    """Every registry family, in registry order."""
    return [family_row(f) for f in FAMILIES]


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "-"


def render_markdown(rows: list[FamilyRow] | None = None) -> str:
    """The family table in Markdown (the README block and docs/families-table.md), one line per family."""
    rows = catalogue() if rows is None else rows
    head = ("family", "model types", "vLLM drafter", "SGLang drafter", "MTP lives in", "depth key", *CAPABILITIES)
    lines = ["| " + " | ".join(h.replace("_", " ") for h in head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (
            r.display,
            ", ".join(f"`{t}`" for t in r.model_types),
            ", ".join(f"`{d}`" for d in r.vllm_drafters),
            f"`{r.sglang_drafter}`" if r.sglang_drafter else "",
            f"`{r.mtp_location}`" if r.storage != "separate" else r.mtp_location,
            ", ".join(f"`{k}`" for k in r.depth_keys),
            *("yes" if r.works[c] else "no" for c in CAPABILITIES),
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render_summary(rows: list[FamilyRow] | None = None) -> str:
    """The README's compact family table: one line per set of capabilities, naming every family that has it (the
    families in registry order, the groups from the most capable down)."""
    rows = catalogue() if rows is None else rows
    groups: dict[tuple[str, ...], list[FamilyRow]] = {}
    for r in rows:
        groups.setdefault(tuple(c for c in CAPABILITIES if r.works[c]), []).append(r)
    lines = ["| what works | families (`model_type`) |", "|---|---|"]
    for works, members in sorted(groups.items(), key=lambda g: -len(g[0])):
        what = ", ".join(c.replace("_", " ") for c in works)
        what = what if len(works) > 1 else "inspect only (no MTP in the target to repair)"
        names = ", ".join(f"{r.display} ({', '.join(f'`{t}`' for t in r.model_types)})" for r in members)
        lines.append(f"| {_cell(what)} | {_cell(names)} |")
    return "\n".join(lines) + "\n"
