"""Write a validation report: ``report.json``, ``report.md`` and PNG plots (matplotlib, Agg backend).

Files in the report directory (each written atomically):

- ``report.json``: the schema documented in ``docs/validate.md`` (``schema: mtpquant.validate/2``);
- ``speculation_profile.json``: the subject's measured acceptance in NVIDIA Model-Optimizer's proposed
  speculation-profile shape (``validate.profile``);
- ``report.md``: verdict, the acceptance table (``validate.table``: k, AL, rate, per-position acceptance) of
  every side, the comparison on identical inputs, notes; it embeds the plots;
- ``acceptance.png``: per-position acceptance at k = K and AL per k, reference vs candidate;
- ``kl.png`` (pair mode, when both MTPs exist): distribution of per-position KL(ref || cand) for
  the MTP and the main model.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.filesystem import atomic_write_bytes, atomic_write_json
from mtpquant.engine.sampling import SamplingSettings
from mtpquant.engine.server import ENGINE_NAMES
from mtpquant.inspect.precision import linears_text
from mtpquant.public import public_json, public_text
from mtpquant.validate.evidence import Interval
from mtpquant.validate.profile import PROFILE_FILE, speculation_profile
from mtpquant.validate.schema import REPORT_SCHEMA, Report, Side, ValidationReport, sides
from mtpquant.validate.table import acceptance_table

__all__ = ["render_markdown", "write_report"]

log = logging.getLogger(__name__)

# KL values are floored here on the log-scale histogram; exact zeros are counted separately.
_KL_FLOOR = 1e-12


def _al(side: Side) -> list[float]:
    return side.acceptance.al if side.acceptance else []


def _per_position(side: Side) -> list[float]:
    return list(side.acceptance.by_k[-1].acceptance_per_position) if side.acceptance else []


def _signed(interval: Interval | None) -> str:
    return interval.text(signed=True) if interval is not None else "n/a"


def _ks(report: Report) -> str:
    """``1..3`` when every k up to K was measured, else the k values (an engine measures its own k)."""
    ks = sorted({row.k for _, side in sides(report) if side.acceptance for row in side.acceptance.by_k})
    if not ks or ks == list(range(1, ks[-1] + 1)):
        return f"1..{ks[-1] if ks else report.settings.k}"
    return ", ".join(map(str, ks))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _mtp_precision(side: Side, report: Report) -> str:
    """``precision: 8 Linears, all unquantized (BF16 8)``; what an engine serves is not read from disk."""
    if side.mtp.precision:
        return "precision: " + linears_text({kind.upper(): n for kind, n in side.mtp.precision.items()})
    if report.engine:
        return "precision as the engine serves it"
    return "precision not read (no usable MTP)"


def _requests(sampling: Mapping[str, Any]) -> str:
    """An engine entry's request settings as prose: ``T=0 (seed 0), rule vllm, ignore_eos on, 1 at a time``."""
    settings = [SamplingSettings.from_json(x) for x in sampling.get("settings") or () if isinstance(x, Mapping)]
    parts = ["; ".join(f"{x.label} (seed {x.seed})" for x in settings)] if settings else []
    if "rule" in sampling:
        parts.append(f"rule {sampling['rule']}")
    if "ignore_eos" in sampling:
        parts.append(f"ignore_eos {'on' if sampling['ignore_eos'] else 'off'}")
    if "concurrency" in sampling:
        parts.append(f"{sampling['concurrency']} at a time")
    return ", ".join(parts) or "the engine's defaults"


def render_markdown(report: Report, plots: dict[str, str]) -> str:
    """report.md: verdict, tables, comparison, plots and notes."""
    v = report.verdict
    s = report.settings
    out = [f"# MTP validation: {v.status.upper()}" + (" (the candidate is broken)" if v.broken else ""), ""]
    out += [f"- {r}" for r in v.reasons]
    if v.thresholds:
        th = v.thresholds
        out += [
            "",
            f"Thresholds: allowed AL drop {th.get('warn_al_drop', s.warn_al_drop):g} per k, decided on "
            f"{100 * th.get('confidence', s.confidence):.0f} % bootstrap intervals over prompts; an MTP with AL below "
            f"{th.get('broken_al', s.broken_al):g} drafts for nothing; a candidate whose main model agrees with the "
            f"reference on fewer than {100 * th.get('min_main_agreement', s.min_main_agreement):.0f} % of top-1 tokens "
            "is broken.",
        ]
    if v.evidence:
        out += [
            "",
            "| k | AL change [interval] | from the MTP | from the target | decision |",
            "|---|---|---|---|---|",
        ]
        for ev in v.evidence:
            at = f"{ev.k}" + (f" ({ev.label})" if ev.label else "")
            out.append(
                f"| {at} | {ev.change.text(signed=True)} | {_signed(ev.mtp)} | {_signed(ev.target)} | {ev.decision} |"
            )
    out += [
        "",
        f"Mode: {report.mode}; k = {_ks(report)}; {_count(s.num_prompts, 'sequence')} of {s.max_len} tokens; "
        f"prompts: {s.prompts}; device {s.device} ({s.dtype}); activations {s.activations}.",
        "",
    ]
    for label, side in sides(report):
        out += [f"## {label.capitalize()}: `{side.checkpoint}`", ""]
        out.append(f"Family {side.family}; target from {side.target_source}; MTP {_mtp_precision(side, report)}.")
        out.append("")
        if not side.acceptance:
            out += [f"**MTP unavailable:** {side.mtp.error or 'not evaluated'}", ""]
            continue
        several = len(side.acceptance_by_sampling) > 1
        agreement = [
            f"{100 * acc.teacher_forced_agreement:.1f} %" + (f" ({acc.sampling.label})" if several else "")
            for acc in side.acceptance_by_sampling or (side.acceptance,)
            if acc.teacher_forced_agreement is not None
        ]
        if agreement:
            out += [f"Teacher-forced MTP agreement with the target: {', '.join(agreement)}.", ""]
    out += ["## Acceptance", "", acceptance_table(report, markdown=True), ""]
    cmp = report.comparison
    if cmp is not None and (cmp.mtp is not None or cmp.main is not None):
        out += [
            "## Comparison on identical inputs",
            "",
            "| | positions | top-1 agreement | KL mean | KL median | KL p99 | KL max |",
        ]
        out.append("|---|---|---|---|---|---|---|")
        for m, title in (
            (cmp.mtp, "MTP (reference target's hidden states)"),
            (cmp.main, "main model (reference sequences)"),
        ):
            if m is not None and m.kl is not None:
                kl = m.kl
                out.append(
                    f"| {title} | {m.positions} | {100 * m.top1_agreement:.2f} % | {kl.mean:.3g} | "
                    f"{kl.median:.3g} | {kl.p99:.3g} | {kl.max:.3g} |"
                )
        out.append("")
    if report.engine:
        out += [
            "## Engine",
            "",
            "| side | engine | server | model | k | other requests meanwhile |",
            "|---|---|---|---|---|---|",
        ]
        for e in report.engine:
            name = ENGINE_NAMES.get(e.name, e.name)
            out.append(
                f"| {e.side} | {name} {e.version} | {e.url} | `{e.model}` | {e.k} ({e.k_source}) | {e.other_requests} |"
            )
        args = next((e.server_args for e in report.engine if e.server_args), ())
        if args:
            out += ["", "Server arguments: `" + " ".join(args) + "`."]
        out += ["", f"Requests: {_requests(report.engine[0].sampling)}.", ""]
    if report.predicted:
        out += [
            "## Engine vs built-in prediction",
            "",
            f"{report.predicted.method}.",
            "",
            "| side | sampling | k | engine AL | predicted AL | difference | per position, engine | predicted |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, rows in report.predicted.sides():
            for row in rows:
                engine_pos = " / ".join(f"{100 * a:.1f} %" for a in row.engine_per_position)
                predicted_pos = " / ".join(f"{100 * a:.1f} %" for a in row.predicted_per_position)
                out.append(
                    f"| {label} | {row.sampling.label} | {row.k} | {row.engine_al:.3f} | "
                    f"{row.predicted_al:.3f} | {row.difference:+.3f} | {engine_pos} | {predicted_pos} |"
                )
        out.append("")
    for name, title in (("acceptance", "Acceptance"), ("context", "Acceptance by context"), ("kl", "KL distribution")):
        if name in plots:
            out += [f"![{title}]({plots[name]})", ""]
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    timing = report.timing
    if timing:
        spent = f"Time {timing.get('total_s', 0):.1f} s"
        if "imports_s" in timing:  # the built-in path: model code imported, sequences run here
            spent += (
                f", {timing['imports_s']:.1f} s of it importing model code "
                f"({timing.get('tokens_per_second', 0):.1f} sequence tokens/s without it)"
            )
        out.append(f"{spent}; mtpquant {report.mtpquant_version}, schema {REPORT_SCHEMA}.")
    return "\n".join(out) + "\n"


def _png(fig: Any) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)


def _acceptance_plot(report: Report) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(label, side) for label, side in sides(report) if side.acceptance]
    if not shown:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.8 / len(shown)
    for i, (label, side) in enumerate(shown):
        pos = _per_position(side)
        xs = [p + 1 + (i - (len(shown) - 1) / 2) * width for p in range(len(pos))]
        ax1.bar(xs, [100 * a for a in pos], width=width, label=label)
        al = _al(side)
        ax2.plot(range(1, len(al) + 1), al, marker="o", label=label)
    K = report.settings.k
    ax1.set(xlabel="draft position", ylabel="acceptance (%)", title=f"per-position acceptance (k={K})", ylim=(0, 100))
    ax1.set_xticks(range(1, K + 1))
    # AL is at least 1 (the target's own token): the axis starts there, so a small drop reads as small
    ax2.set(xlabel="k (drafts per step)", ylabel="mean acceptance length", title="AL per k")
    ax2.set_ylim(bottom=1.0, top=max(2.0, max(a for _, side in shown for a in _al(side)) * 1.05))
    ax2.set_xticks(range(1, K + 1))
    ax1.legend()
    ax2.legend()
    return fig


def _context_plot(report: Report) -> Any:
    """Per-position acceptance at k = K by context-length bucket, one line per side and position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(label, side) for label, side in sides(report) if side.acceptance and side.acceptance.by_k[-1].by_context]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for (label, side), style in zip(shown, ("-", "--")):
        assert side.acceptance is not None
        row = side.acceptance.by_k[-1]
        xs = [f"{b.low}-{b.high}" for b in row.by_context]
        for i in range(row.k):
            ys = [100 * b.acceptance_per_position[i] if b.steps else float("nan") for b in row.by_context]
            ax.plot(xs, ys, style, marker="o", label=f"{label}, position {i + 1}")
    sampling = shown[0][1].acceptance.sampling.label if shown[0][1].acceptance else ""
    title = f"per-position acceptance by context (k={report.settings.k}, {sampling})"
    ax.set(xlabel="context length (tokens)", ylabel="acceptance (%)", title=title, ylim=(0, 100))
    ax.legend(fontsize=7)
    return fig


def _kl_plot(report: ValidationReport) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series: list[tuple[str, Any]] = [
        (label, kl[kl.isfinite()])  # a NaN KL (non-finite logits) is counted in the report, not plotted
        for label, kl in (("MTP", report.mtp_kl), ("main model", report.main_kl))
        if kl is not None and bool(kl.isfinite().any())
    ]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    values = [np.clip(kl.double().numpy(), _KL_FLOOR, None) for _, kl in series]
    top = max(float(v.max()) for v in values)
    bins: Any = np.logspace(np.log10(_KL_FLOOR), np.log10(max(top, _KL_FLOOR * 10)), 50)
    for (label, kl), v in zip(series, values):
        zeros = int((kl == 0).sum())
        ax.hist(v, bins=bins, alpha=0.6, label=f"{label} ({zeros} of {kl.numel()} exactly 0)")
    ax.set_xscale("log")
    ax.set(xlabel="KL(ref || cand) per position (nats; 0 shown at 1e-12)", ylabel="positions", title="KL distribution")
    ax.legend()
    return fig


def write_report(report: ValidationReport, directory: Path | str) -> Path:
    """Write report.json, report.md and the plots into ``directory`` (created if needed). The report may be
    published with a checkpoint (``publish`` uploads OUT/validation): local directories by their base name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    makers: tuple[tuple[str, Callable[[], Any]], ...] = (  # each a matplotlib Figure, or None: nothing to plot
        ("acceptance", lambda: _acceptance_plot(report.report)),
        ("context", lambda: _context_plot(report.report)),
        ("kl", lambda: _kl_plot(report)),
    )
    for name, make in makers:
        fig = make()
        if fig is not None:
            atomic_write_bytes(directory / f"{name}.png", _png(fig))
            plots[name] = f"{name}.png"
    atomic_write_json(directory / "report.json", public_json(report.to_json()))
    profile = speculation_profile(report.report)
    if profile is not None:
        atomic_write_json(directory / PROFILE_FILE, public_json(profile))
    markdown = public_text(render_markdown(report.report, plots))
    atomic_write_bytes(directory / "report.md", markdown.encode("utf-8"))
    log.info("wrote report to %s", directory)
    return directory
