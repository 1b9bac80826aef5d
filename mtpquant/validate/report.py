"""Write a validation report: ``report.json``, ``report.md`` and PNG plots (matplotlib, Agg backend).

Files in the report directory (built beside it and put in place whole, replacing an earlier report):

- ``report.json``: the schema documented in ``docs/validate.md`` (``schema: mtpquant.validate/2``);
- ``speculation_profile.json``: the subject's measured acceptance in NVIDIA Model-Optimizer's proposed
  speculation-profile shape (``validate.profile``);
- ``report.md``: verdict, the acceptance table (``validate.table``: k, AL, rate, per-position acceptance) of
  every side, the comparison on identical inputs, notes; it embeds the plots;
- ``acceptance.png``: per-position acceptance at k = K and AL per k with its interval, one series per side and
  sampling setting;
- ``kl.png`` (pair mode, when both MTPs exist): distribution of per-position KL(ref || cand) for
  the MTP and the main model;
- ``logs/`` (``--engine``): the server log of each engine validate started (kept local by ``publish``).
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.filesystem import json_bytes
from mtpquant.checkpoint.precision import linears_text
from mtpquant.engine.table import NAMES as ENGINE_KEYS
from mtpquant.engine.table import display as engine_display
from mtpquant.errors import OutputExistsError
from mtpquant.public import public_json, public_text
from mtpquant.records.evidence import Interval
from mtpquant.records.profile import PROFILE_FILE, speculation_profile
from mtpquant.records.sampling import SamplingSettings
from mtpquant.records.table import acceptance_table
from mtpquant.records.validation import (
    LOGS_DIR,
    MARKDOWN_FILE,
    REPORT_FILE,
    REPORT_SCHEMA,
    Report,
    Side,
    ValidationReport,
    activations_label,
    sides,
)

__all__ = ["PLOTS", "check_replaceable_report", "render_markdown", "write_report"]

log = logging.getLogger(__name__)

# KL values are floored here on the log-scale histogram; exact zeros are counted separately.
_KL_FLOOR = 1e-12

PLOTS = ("acceptance", "context", "kl")  # each written as NAME.png when there is something to plot
_WRITTEN = frozenset({REPORT_FILE, MARKDOWN_FILE, PROFILE_FILE, *(f"{p}.png" for p in PLOTS)})
# what earlier runs left that validate wrote: server logs beside the report (mtpquant before logs/ was used), and the
# temporary file of an atomic write a kill interrupted (filesystem.replace_atomically)
_ENGINE_LOG = re.compile(rf"({'|'.join(ENGINE_KEYS)})-(reference|candidate)-k\d+\.log")
_INTERRUPTED = re.compile(r"\..+\.tmp-[0-9a-f]{8}")


def _signed(interval: Interval | None) -> str:
    return interval.text(signed=True) if interval is not None else "n/a"


def _ks(report: Report, shown: Sequence[tuple[str, Side]]) -> str:
    """``1..3`` when every k up to K was measured, else the k values (an engine measures its own k)."""
    ks = sorted({row.k for _, side in shown if side.acceptance for row in side.acceptance.by_k})
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
    given = [x for x in sampling.get("settings") or () if isinstance(x, Mapping)]
    settings = [SamplingSettings.from_json(x, "sampling") for x in given]
    parts = ["; ".join(f"{x.label} (seed {x.seed})" for x in settings)] if settings else []
    if "rule" in sampling:
        parts.append(f"rule {sampling['rule']}")
    if "ignore_eos" in sampling:
        parts.append(f"ignore_eos {'on' if sampling['ignore_eos'] else 'off'}")
    if "concurrency" in sampling:
        parts.append(f"{sampling['concurrency']} at a time")
    return ", ".join(parts) or "the engine's defaults"


def render_markdown(report: Report, plots: dict[str, str], shown: Sequence[tuple[str, Side]]) -> str:
    """report.md: verdict, tables, comparison, plots and notes (``shown``: the report's ``sides``)."""
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
        f"Mode: {report.mode}; k = {_ks(report, shown)}; {_count(s.num_prompts, 'sequence')} of {s.max_len} tokens; "
        f"prompts: {s.prompts}; device {s.device} ({s.dtype}); activations {activations_label(s.activations)}.",
        "",
    ]
    for label, side in shown:
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
    out += ["## Acceptance", "", acceptance_table(report, shown, markdown=True), ""]
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
            name = engine_display(e.name)
            out.append(
                f"| {e.side} | {name} {e.version} | {e.url} | `{e.model}` | {e.k} ({e.k_source}) | {e.other_requests} |"
            )
        for title, lines in (
            ("Server arguments", [f"`{' '.join(e.server_args)}`" if e.server_args else "" for e in report.engine]),
            ("Memory", [e.memory for e in report.engine]),
        ):
            if any(lines):  # every server's, named by side and k
                out += ["", f"{title}:", ""]
                out += [f"- {e.side}, k = {e.k}: {line}" for e, line in zip(report.engine, lines) if line]
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


def _acceptance_plot(report: Report, shown: Sequence[tuple[str, Side]]) -> Any:
    """Per-position acceptance at each series' largest k (bars) and AL per k with its bootstrap interval (error
    bars), one series per side and sampling setting, each named by both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        (f"{label} ({acc.sampling.label})", acc)
        for label, side in shown
        if side.acceptance
        for acc in side.acceptance_by_sampling or (side.acceptance,)
    ]
    if not series:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(series)
    for i, (name, acc) in enumerate(series):
        pos = acc.by_k[-1].acceptance_per_position
        xs = [p + 1 + (i - (len(series) - 1) / 2) * width for p in range(len(pos))]
        ax1.bar(xs, [100 * a for a in pos], width=width, label=name)
        ks = [row.k for row in acc.by_k]
        al = [row.mean_acceptance_length for row in acc.by_k]
        below, above = [], []  # the interval's distance from AL (none drawn where it is not defined)
        for row, a in zip(acc.by_k, al):
            ci = row.al_interval
            below.append(a - ci.low if ci is not None and ci.defined else 0.0)
            above.append(ci.high - a if ci is not None and ci.defined else 0.0)
        ax2.errorbar(ks, al, yerr=[below, above], marker="o", capsize=3, label=name)
    K = max(acc.by_k[-1].k for _, acc in series)
    ax1.set(xlabel="draft position", ylabel="acceptance (%)", title=f"per-position acceptance (k={K})", ylim=(0, 100))
    ax1.set_xticks(range(1, K + 1))
    # AL is at least 1 (the target's own token): the axis starts there, so a small drop reads as small
    level = f"{100 * report.settings.confidence:.0f} %"
    ax2.set(xlabel="k (drafts per step)", ylabel="mean acceptance length", title=f"AL per k ({level} intervals)")
    highest = [
        max(row.mean_acceptance_length, row.al_interval.high if row.al_interval and row.al_interval.defined else 0)
        for _, acc in series
        for row in acc.by_k
    ]
    ax2.set_ylim(bottom=1.0, top=max(2.0, max(highest) * 1.05))
    ax2.set_xticks(range(1, K + 1))
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    return fig


def _context_plot(report: Report, shown: Sequence[tuple[str, Side]]) -> Any:
    """Per-position acceptance at k = K by context-length bucket, one line per side and position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bucketed = [(label, side) for label, side in shown if side.acceptance and side.acceptance.by_k[-1].by_context]
    if not bucketed:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    for (label, side), style in zip(bucketed, ("-", "--")):
        assert side.acceptance is not None
        row = side.acceptance.by_k[-1]
        xs = [f"{b.low}-{b.high}" for b in row.by_context]
        for i in range(row.k):
            ys = [100 * b.acceptance_per_position[i] if b.steps else float("nan") for b in row.by_context]
            ax.plot(xs, ys, style, marker="o", label=f"{label}, position {i + 1}")
    sampling = bucketed[0][1].acceptance.sampling.label if bucketed[0][1].acceptance else ""
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


def _foreign(path: Path) -> str | None:
    """The first entry of the report directory ``path`` that validate did not write (None: none)."""
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        name = entry.name
        if entry.is_dir(follow_symlinks=False) and name == LOGS_DIR:
            inner = _foreign_log(Path(entry.path))
            if inner is not None:
                return f"{LOGS_DIR}/{inner}"
        elif not entry.is_file(follow_symlinks=False) or not (
            name in _WRITTEN or _ENGINE_LOG.fullmatch(name) or _INTERRUPTED.fullmatch(name)
        ):
            return name
    return None


def _foreign_log(logs: Path) -> str | None:
    for entry in sorted(os.scandir(logs), key=lambda e: e.name):
        if not entry.is_file(follow_symlinks=False) or not entry.name.endswith(".log"):
            return entry.name
    return None


def check_replaceable_report(path: Path) -> None:
    """``--report-dir`` is replaced whole by the new report (one run's files, never mixed with an earlier run's), so
    it may be absent, or a directory holding only files validate writes (an earlier report, its plots and server
    logs; nothing: an empty one); anything else is refused (exit 5) before any work, naming what is in the way, so
    validate never removes a file it did not write."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        raise OutputExistsError(
            f"{path}: exists and is not a report directory; not replacing it (choose another --report-dir)"
        )
    other = _foreign(path)
    if other is not None:
        raise OutputExistsError(
            f"{path}: holds {other}, which validate did not write; the report replaces its directory whole, so not "
            "replacing it (choose another --report-dir, or move that out)"
        )


def write_report(report: ValidationReport, directory: Path | str, *, logs: Path | None = None) -> Path:
    """Write report.json, report.md, the plots and the engine's server logs (the files of ``logs``, into ``logs/``)
    as ``directory``: built beside it and put in place in one step, replacing an earlier report directory whole
    (``preflight.check_replaceable_report`` says which may be replaced), so no file of another run is left in it.
    The report may be published with a checkpoint (``publish`` uploads OUT/validation, less its ``logs/``): local
    directories by their base name."""
    from mtpquant.checkpoint.writer import OutputDir

    directory = Path(directory)
    data = report.report
    shown = sides(data)
    # each a matplotlib Figure, or None: nothing to plot
    figures = {"acceptance": _acceptance_plot(data, shown), "context": _context_plot(data, shown),
               "kl": _kl_plot(report)}
    plots = {name: f"{name}.png" for name in PLOTS if figures[name] is not None}
    files = {f"{name}.png": _png(figures[name]) for name in plots}
    markdown = render_markdown(data, plots, shown)
    profile = speculation_profile(data)
    documents = {REPORT_FILE: report.to_json(), **({PROFILE_FILE: profile} if profile is not None else {})}
    public = {name: public_json(document) for name, document in documents.items()}
    files |= {name: json_bytes(document) for name, document in public.items()}
    files[MARKDOWN_FILE] = public_text(markdown).encode("utf-8")
    with OutputDir(directory, overwrite=True, replace_check=check_replaceable_report) as od:
        od.doing = "writing the validation report"
        for name, content in files.items():
            od.write_bytes(name, content)
        for server_log in sorted(logs.iterdir()) if logs is not None else ():
            od.link_file(server_log, f"{LOGS_DIR}/{server_log.name}")
        od.finalize(checkpoint=False)
    log.info("wrote report to %s", directory)
    return directory
