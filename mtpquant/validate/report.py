"""Write a validation report: ``report.json``, ``report.md`` and PNG plots (matplotlib, Agg backend).

Files in the report directory (each written atomically):

- ``report.json``: the schema documented in ``docs/validate.md`` (``schema: mtpquant.validate/1``);
- ``report.md``: verdict, acceptance table (k, AL, rate, per-position acceptance) for each pair,
  the comparison on identical inputs, notes; it embeds the plots;
- ``acceptance.png``: per-position acceptance at k = K and AL per k, reference vs candidate;
- ``kl.png`` (pair mode, when both MTPs exist): distribution of per-position KL(ref || cand) for
  the MTP and the main model.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.writer import atomic_write_bytes, atomic_write_json
from mtpquant.engine.server import ENGINE_NAMES
from mtpquant.public import public_json, public_text
from mtpquant.validate.schema import REPORT_SCHEMA, Report, Side, ValidationReport, sides

__all__ = ["render_markdown", "write_report"]

log = logging.getLogger(__name__)

# KL values are floored here on the log-scale histogram; exact zeros are counted separately.
_KL_FLOOR = 1e-12


def _al(side: Side) -> list[float]:
    return side.acceptance.al if side.acceptance else []


def _per_position(side: Side) -> list[float]:
    return list(side.acceptance.by_k[-1].acceptance_per_position) if side.acceptance else []


def _ks(report: Report) -> str:
    """``1..3`` when every k up to K was measured, else the k values (an engine measures its own k)."""
    ks = sorted({row.k for _, side in sides(report) if side.acceptance for row in side.acceptance.by_k})
    if not ks or ks == list(range(1, ks[-1] + 1)):
        return f"1..{ks[-1] if ks else report.settings.k}"
    return ", ".join(map(str, ks))


def render_markdown(report: Report, plots: dict[str, str]) -> str:
    """report.md: verdict, tables, comparison, plots and notes."""
    v = report.verdict
    s = report.settings
    out = [f"# MTP validation: {v.status.upper()}", ""]
    out += [f"- {r}" for r in v.reasons]
    out += [
        "",
        f"Mode: {report.mode}; k = {_ks(report)}; {s.num_prompts} sequences of {s.max_len} tokens; "
        f"prompts: {s.prompts}; device {s.device} ({s.dtype}); activations {s.activations}.",
        "",
    ]
    for label, side in sides(report):
        out += [f"## {label.capitalize()}: `{side.checkpoint}`", ""]
        precision = dict(side.mtp.precision) if side.mtp.precision is not None else None
        out.append(f"Family {side.family}; target from {side.target_source}; MTP precision {precision}.")
        out.append("")
        acc = side.acceptance
        if not acc:
            out += [f"**MTP unavailable:** {side.mtp.error}", ""]
            continue
        K = max(row.k for row in acc.by_k)  # the engine path may measure some k only (--k 1,3; a server's k)
        out.append("| k | AL | acceptance rate | " + " | ".join(f"pos {i}" for i in range(1, K + 1)) + " |")
        out.append("|---|---|---|" + "---|" * K)
        for row in acc.by_k:
            pos = [f"{100 * a:.1f} %" for a in row.acceptance_per_position] + [""] * (K - row.k)
            out.append(
                f"| {row.k} | {row.mean_acceptance_length:.3f} | {100 * row.acceptance_rate:.1f} % | "
                + " | ".join(pos)
                + " |"
            )
        if acc.teacher_forced_agreement is not None:
            out += ["", f"Teacher-forced MTP agreement with the target: {100 * acc.teacher_forced_agreement:.1f} %."]
        out.append("")
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
        if cmp.al_delta_by_k:
            out += ["", "| k | AL change | from the MTP | from the target |", "|---|---|---|---|"]
            for k, (d, m2, t) in enumerate(
                zip(cmp.al_delta_by_k, cmp.al_delta_from_mtp_by_k, cmp.al_delta_from_target_by_k), 1
            ):
                out.append(f"| {k} | {d:+.4f} | {m2:+.4f} | {t:+.4f} |")
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
        out += ["", f"Sampling: {dict(report.engine[0].sampling)} (greedy only).", ""]
    if report.predicted:
        out += [
            "## Engine vs built-in prediction",
            "",
            f"{report.predicted.get('method', '')}.",
            "",
            "| side | k | engine AL | predicted AL | difference | engine rate | predicted rate |",
            "|---|---|---|---|---|---|---|",
        ]
        for label in ("reference", "candidate"):
            for row in report.predicted.get(label) or []:
                out.append(
                    f"| {label} | {row['k']} | {row['engine_al']:.3f} | {row['predicted_al']:.3f} | "
                    f"{row['difference']:+.3f} | {100 * row['engine_acceptance_rate']:.1f} % | "
                    f"{100 * row['predicted_acceptance_rate']:.1f} % |"
                )
        out.append("")
    for name, title in (("acceptance", "Acceptance"), ("kl", "KL distribution")):
        if name in plots:
            out += [f"![{title}]({plots[name]})", ""]
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    timing = report.timing
    if timing:
        out.append(
            f"Time {timing.get('total_s', 0):.1f} s, {timing.get('imports_s', 0):.1f} s of it importing model code "
            f"({timing.get('tokens_per_second', 0):.1f} sequence tokens/s without it); "
            f"mtpquant {report.mtpquant_version}, schema {REPORT_SCHEMA}."
        )
    return "\n".join(out) + "\n"


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _acceptance_plot(report: Report) -> bytes | None:
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
    ax2.set(xlabel="k (drafts per step)", ylabel="mean acceptance length", title="AL per k")
    ax2.set_xticks(range(1, K + 1))
    ax1.legend()
    ax2.legend()
    try:
        return _png(fig)
    finally:
        plt.close(fig)


def _kl_plot(report: ValidationReport) -> bytes | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series: list[tuple[str, Any]] = [
        (label, kl)
        for label, kl in (("MTP", report.mtp_kl), ("main model", report.main_kl))
        if kl is not None and kl.numel()
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
    try:
        return _png(fig)
    finally:
        plt.close(fig)


def write_report(report: ValidationReport, directory: Path | str) -> Path:
    """Write report.json, report.md and the plots into ``directory`` (created if needed). The report may be
    published with a checkpoint (``publish`` uploads OUT/validation): local directories by their base name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    for name, make in (("acceptance", lambda: _acceptance_plot(report.report)), ("kl", lambda: _kl_plot(report))):
        png = make()
        if png is not None:
            atomic_write_bytes(directory / f"{name}.png", png)
            plots[name] = f"{name}.png"
    atomic_write_json(directory / "report.json", public_json(report.to_json()))
    markdown = public_text(render_markdown(report.report, plots))
    atomic_write_bytes(directory / "report.md", markdown.encode("utf-8"))
    log.info("wrote report to %s", directory)
    return directory
