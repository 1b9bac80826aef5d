"""The acceptance table of a validation report, rendered once for every reader: ``validate``'s terminal output
(``render.validate_text``), ``report.md`` (``validate.report``) and the model card (``hub.card.body``).

One row per side, sampling setting and k: mean acceptance length (AL) with its bootstrap interval over prompts, the
acceptance rate, and the acceptance at each draft position (vLLM's unconditional per-position counters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mtpquant.records.validation import Report, Side

__all__ = ["acceptance_table"]


def acceptance_table(
    report: Report, shown: Sequence[tuple[str, Side]], *, markdown: bool = False, names: Mapping[str, str] | None = None
) -> str:
    """The table of ``report``'s sides ``shown`` (``records.validation.sides``) as aligned text, or as a Markdown
    table (``markdown``). ``names``: how to call a side (``reference``, ``candidate``, ``checkpoint``) where the
    reader knows it by another name (the card's ``this checkpoint``)."""
    level = f"{100 * report.settings.confidence:.0f} % CI"
    several = len(report.settings.sampling) > 1
    if markdown:
        lines = [f"| | k | AL | {level} | acceptance rate | per-position acceptance |", "|---|---|---|---|---|---|"]
    else:
        lines = [f"{'':<11} {'k':>2} {'AL':>6} {level:>17} {'rate':>7}  per-position acceptance"]
    for key, side in shown:
        name = label = (names or {}).get(key, key)
        if not side.acceptance:
            error = side.mtp.error or "not evaluated"
            if markdown:
                lines.append(f"| {label} | - | MTP unavailable: {error.replace('|', chr(92) + '|')} | | | |")
            else:
                lines.append(f"{label:<11}  -  MTP unavailable: {error}")
            continue
        for acc in side.acceptance_by_sampling or (side.acceptance,):
            if several and markdown:
                label = f"{name} ({acc.sampling.label}, rule {acc.rule})"
            elif several:
                lines.append(f"{label:<11} {acc.sampling.label} (rule {acc.rule})")
                label = ""
            for row in acc.by_k:
                ci = row.al_interval
                interval = f"[{ci.low:.3f}, {ci.high:.3f}]" if ci is not None and ci.defined else "n/a"
                al, rate = row.mean_acceptance_length, 100 * row.acceptance_rate
                if markdown:
                    pos = " / ".join(f"{100 * a:.1f} %" for a in row.acceptance_per_position)
                    lines.append(f"| {label} | {row.k} | {al:.3f} | {interval} | {rate:.1f} % | {pos} |")
                else:
                    pos = " ".join(f"{100 * a:5.1f}%" for a in row.acceptance_per_position)
                    lines.append(f"{label:<11} {row.k:>2} {al:6.3f} {interval:>17} {rate:6.1f}%  {pos}")
                label = ""
    return "\n".join(lines)
