"""The card's section on the MTP precision search (``convert --mtp auto``, ``tune-mtp``): the chosen precision per
group, its bytes against the BF16 MTP's, the predicted acceptance against the BF16 MTP's with the paired intervals,
why it was chosen, with ``--heal`` each finalist's AL before and after heal, and where the full report is
(``mtp_search/``). Only while the MTP in OUT is the searched one (the
provenance's last MTP mode is ``search``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mtpquant.net import safejson

if TYPE_CHECKING:
    from mtpquant.search.run import SearchResult

__all__ = ["read_search", "search_lines"]

log = logging.getLogger(__name__)

_LIMIT = 64 * 1024 * 1024  # a search report is tens of KB


def read_search(out: Path) -> SearchResult | None:
    """``mtp_search/report.json`` in OUT, typed; None when there is none (or in a shape this card does not read)."""
    from mtpquant.search.report import REPORT_FILE, SEARCH_DIR, read_result

    path = out / SEARCH_DIR / REPORT_FILE
    if not path.is_file():
        return None
    try:
        return read_result(safejson.loads(path.read_bytes(), limit=_LIMIT))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.warning("%s: not a search report this card reads (%s); the card omits it", path, exc)
        return None


def search_lines(result: SearchResult | None) -> list[str]:
    """The section (empty without a search)."""
    if result is None:
        return []
    from mtpquant.search.report import MARKDOWN_FILE, PLOT_FILE, SEARCH_DIR, healed_lines
    from mtpquant.units import format_bytes

    s = result.settings
    chosen = result.choice
    bf16 = result.bf16_bytes
    lines = [
        "## MTP precision chosen by search",
        "",
        "The MTP's precision was chosen per module group by mtpquant's precision search: the smallest MTP whose "
        f"predicted acceptance length (AL) stays within {s.budget:g} of the BF16 MTP's at every k = 1..{s.k}"
        f"{'' if len(result.sampling) == 1 else ' and sampling setting'}, drafted on this checkpoint's own quantized "
        f"model (engines: {s.engine}): configurations selected on {len(result.selection_prompts)} held-out prompts, "
        f"the finalists confirmed on {result.prompts} other held-out prompts with paired bootstrap intervals and "
        f"{'Holm' if result.confirmation is None else result.confirmation.method}'s procedure (family-wise error "
        f"{1 - s.confidence:g}); the numbers below are the confirmation's. {result.configurations} configurations "
        "load there.",
        "",
        "| group | Linears | precision | bytes | BF16 bytes |",
        "|---|---:|---|---:|---:|",
    ]
    for g in result.groups:
        p = chosen.assignment[g.key]
        sizes = f"{format_bytes(g.bytes[p])} | {format_bytes(g.bytes['bf16'])}"
        lines.append(f"| {g.label} | {g.linears} | {p} | {sizes} |")
    lines += [
        "",
        f"The MTP: {format_bytes(chosen.nbytes)}, {chosen.nbytes / bf16:.2f}x the BF16 MTP's {format_bytes(bf16)} "
        f"(declared {chosen.declaration}). {result.reason[0].upper()}{result.reason[1:]}.",
        "",
    ]
    base = result.baseline
    for setting, row in zip(result.sampling, chosen.by_sampling, strict=True):
        ref = next(x for x in base.by_sampling if x.sampling == setting)
        head = f"| k | AL, BF16 MTP ({setting.label}) | AL, this MTP | change (its confirmation interval) |"
        lines += [head, "|---|---|---|---|"]
        for c, b in zip(row.by_k, ref.by_k, strict=True):
            change = c.change.text(signed=True) if c.change is not None else "0 (the BF16 MTP)"
            lines.append(f"| {c.k} | {b.al.text()} | {c.al.text()} | {change} |")
        lines.append("")
    if result.not_taken:
        lines += [f"Not taken for want of evidence: {result.not_taken}.", ""]
    if result.choice.role == "healed":
        lines += ["This MTP was healed (quantization-aware training against this checkpoint's quantized model) before "
                  "the choice; the AL above is the healed MTP's.", ""]
    lines += healed_lines(result, head="###")
    lines += [
        f"Every measured configuration: [`{SEARCH_DIR}/{MARKDOWN_FILE}`]({SEARCH_DIR}/{MARKDOWN_FILE}); bytes against "
        f"AL loss: [`{SEARCH_DIR}/{PLOT_FILE}`]({SEARCH_DIR}/{PLOT_FILE}).",
        "",
    ]
    return lines
