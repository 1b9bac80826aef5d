"""The search's report, written into the output as ``mtp_search/``: ``report.json`` (``SearchResult``), ``report.md``
(every measured configuration: bytes, AL per k with its interval and the change from the BF16 MTP, per sampling
setting; with ``--heal`` each finalist's AL before and after heal; the chosen one and why), ``pareto.png`` (bytes
against the worst AL loss, the front joined, the budget and the choice marked) and ``speculation_profile.json`` (the
chosen MTP's predicted acceptance, in the shape of validate's: ``records.profile``)."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

from mtpquant import __version__
from mtpquant.formats.kinds import precision_kind
from mtpquant.records.acceptance import Acceptance
from mtpquant.records.profile import (
    PROFILE_FILE,
    Conditions,
    DraftCheckpoint,
    ProfileRow,
    ProfileSource,
    SamplingProfile,
    SamplingRule,
    SpeculationProfile,
    TargetModel,
)
from mtpquant.search.run import SearchResult
from mtpquant.units import format_bytes

__all__ = [
    "MARKDOWN_FILE",
    "PLOT_FILE",
    "REPORT_FILE",
    "SEARCH_DIR",
    "healed_lines",
    "render_markdown",
    "search_documents",
]

SEARCH_DIR = "mtp_search"
REPORT_FILE = "report.json"
MARKDOWN_FILE = "report.md"
PLOT_FILE = "pareto.png"
REPORT_SCHEMA = "mtpquant.mtp-search/2"  # 2: selection and confirmation on disjoint prompts


def render_markdown(result: SearchResult) -> str:
    """``report.md``: the settings, the groups, every measured configuration, the choice and why."""
    s = result.settings
    bf16 = result.bf16_bytes
    lines = [
        f"# MTP precision search ({result.family})",
        "",
        f"Target: `{result.target}` (the quantized main model; its hidden states computed once). Budget: the AL may "
        f"drop at most {s.budget:g} below the BF16 MTP's at every k = 1..{s.k} and sampling setting (max_len "
        f"{s.max_len}, activations {s.activations}, seed {s.seed}). Engines: {s.engine}. "
        f"{result.configurations} configurations load there; {len(result.evaluated)} measurements were made.",
        "",
        *_procedure(result),
        "",
        "| group | Linears | " + " | ".join(p for p in s.precisions) + " |",
        "|---|---:|" + "---:|" * len(s.precisions),
    ]
    for g in result.groups:
        lines.append(f"| {g.label} | {g.linears} | " + " | ".join(format_bytes(g.bytes[p]) for p in s.precisions)
                     + " |")
    if result.fixed:
        lines += ["", f"The recipe's quantization.exclude keeps {', '.join(result.fixed)} BF16: "
                  f"{'that group is' if len(result.fixed) == 1 else 'those groups are'} BF16 in every configuration."]
    lines += ["", "## Measured configurations", ""]
    for setting in result.sampling:
        head = "| configuration | bytes | x BF16 | declared | prompts | role | " + " | ".join(
            f"AL k={k} (change)" for k in range(1, s.k + 1)) + " | verdict |"
        lines += [f"### {setting.label}", "", head, "|---|---:|---:|---|---|---|" + "---|" * s.k + "---|"]
        for i, j in enumerate(result.evaluated):
            row = next(x for x in j.by_sampling if x.sampling == setting)
            cells = []
            for c in row.by_k:
                cell = c.al.text()
                if c.change is not None:
                    cell += f" ({c.change.text(signed=True)})"
                cells.append(cell)
            mark = " **chosen**" if i == result.chosen else "" if j.loads else " (does not load alone)"
            front = " (front)" if i in result.front else ""
            verdict = j.verdict + {True: ", confirmed", False: ", not confirmed", None: ""}[j.confirmed]
            lines.append(
                f"| {j.assignment.label}{mark} | {format_bytes(j.nbytes)} | {j.nbytes / bf16:.2f} | {j.declaration} "
                f"| {j.phase} | {j.role}{front} | " + " | ".join(cells) + f" | {verdict} |"
            )
        lines.append("")
    lines += healed_lines(result)
    chosen = result.choice
    lines += [
        "## Chosen",
        "",
        f"**{chosen.assignment.label}**: {format_bytes(chosen.nbytes)} ({chosen.nbytes / bf16:.2f}x the BF16 MTP's "
        f"{format_bytes(bf16)}), declared {chosen.declaration}. {result.reason[0].upper()}{result.reason[1:]}.",
    ]
    if result.not_taken:
        lines += ["", f"Not taken for want of evidence: {result.not_taken}."]
    secs = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
    lines += ["", f"Time: {secs}; mtpquant {__version__}, schema {REPORT_SCHEMA}.", ""]
    return "\n".join(lines)


def _procedure(result: SearchResult) -> list[str]:
    """How the choice was made: the two sets of prompts, the finalists, Holm's procedure and its levels."""
    s = result.settings
    c = result.confirmation
    if s.budget == 0:
        return [f"A budget of 0 is the BF16 MTP, byte for byte: no quantized configuration was measured (the BF16 "
                f"MTP's AL: {len(result.confirmation_prompts)} held-out prompts)."]  # fmt: skip
    lines = [
        f"Selection: {len(result.selection_prompts)} held-out prompts ({100 * s.confidence:.0f} % paired bootstrap "
        f"intervals, a screen only). Confirmation: {len(result.confirmation_prompts)} other held-out prompts "
        "selection never saw (`selection_prompts` and `confirmation_prompts` in report.json), on which the BF16 MTP "
        "and each finalist are measured again; every number published for the chosen MTP is the confirmation's.",
    ]
    if c is None or not c.finalists:
        return [*lines, "", "No configuration was within the budget on the selection prompts: no finalist."]
    lines += [
        "",
        f"The finalists' null hypotheses (\"loses {s.budget:g} AL or more at some k\") tested with {c.method}'s "
        f"step-down procedure, family-wise error {c.alpha:g} over {len(c.finalists)} finalists:",
        "",
        "| finalist | p-value | Holm level | interval level | accepted |",
        "|---|---:|---:|---:|---|",
    ]
    for f in c.finalists:
        lines.append(f"| {f.assignment.label} | {f.p_value:.4f} | {f.level:.4f} | {100 * (1 - f.level):.2f} % | "
                     f"{'yes' if f.accepted else 'no'} |")  # fmt: skip
    return lines


def healed_lines(result: SearchResult, head: str = "##") -> list[str]:
    """``--heal``: how the finalists were healed and each one's predicted AL per k before and after heal (greedy, the
    paired change from the BF16 MTP in brackets) and its verdict after; empty without heal."""
    h = result.heal
    if h is None:
        return []
    lines = [
        f"{head} Healed finalists",
        "",
        f"Each finalist was healed before the choice (heal's quantization-aware training from the BF16 MTP, every "
        f"quantized Linear fake-quantized in its own format: {h.samples} prompts of {h.prompt_len} tokens of "
        f"{h.data} continued by the target for {h.new_tokens} tokens, {h.steps} steps x {h.batch_size} sequences, lr "
        f"{h.lr:g}, chain {h.chain}, seed {h.seed}); the choice is made on the healed MTPs' predicted AL on the "
        "confirmation prompts (before heal: the selection prompts').",
        "",
    ]
    if not result.healed:
        return [*lines, "No configuration was a finalist: the MTP stays BF16.", ""]
    k = result.settings.k
    lines += [
        "| finalist | bytes | " + " | ".join(f"AL k={i} before -> after heal" for i in range(1, k + 1))
        + " | KL first -> last | verdict after |",
        "|---|---:|" + "---|" * k + "---|---|",
    ]
    for f in result.healed:
        before, after = result.evaluated[f.before], result.evaluated[f.after]
        cells = []
        for b, a in zip(before.by_sampling[0].by_k, after.by_sampling[0].by_k, strict=True):
            change = f" ({a.change.text(signed=True)})" if a.change is not None else ""
            cells.append(f"{b.al.estimate:.3f} -> {a.al.estimate:.3f}{change}")
        t = f.training
        lines.append(f"| {f.assignment.label} | {format_bytes(after.nbytes)} | " + " | ".join(cells)
                     + f" | {t.first_loss:.4f} -> {t.last_loss:.4f} | {after.verdict} |")
    return [*lines, ""]


def _initial(precision: str) -> str:
    """A precision's letter in the plot: B (BF16), F (FP8), N (NVFP4)."""
    kind = precision_kind(precision)
    return (kind.label if kind is not None else precision.upper())[0]


def _pareto_png(result: SearchResult) -> bytes:
    """Bytes (x) against the worst AL loss over every k and setting (y), the front joined, budget and choice marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        xs = [j.nbytes / 1e6 for j in result.evaluated]
        ys = [j.worst for j in result.evaluated]
        colors = {"baseline": "tab:blue", "within": "tab:green", "inconclusive": "tab:orange", "beyond": "tab:red"}
        for j, x, y in zip(result.evaluated, xs, ys):  # hollow: measured alone, not loadable alone
            color = colors[j.verdict]
            ax.scatter([x], [y], s=30, zorder=3, facecolors=color if j.loads else "none", edgecolors=color)
        for v, c in colors.items():
            ax.scatter([], [], color=c, label=v)
        front = sorted(result.front, key=lambda i: xs[i])
        ax.plot([xs[i] for i in front], [ys[i] for i in front], color="grey", lw=1, zorder=2, label="Pareto front")
        chosen = result.chosen
        ax.scatter([xs[chosen]], [ys[chosen]], s=160, facecolors="none", edgecolors="black", zorder=4, label="chosen")
        ax.axhline(result.settings.budget, color="black", ls="--", lw=1, label=f"budget {result.settings.budget:g}")
        for j, x, y in zip(result.evaluated, xs, ys):
            short = "/".join(_initial(p) for p in j.assignment.precisions)
            ax.annotate(short, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        groups = "/".join(result.evaluated[0].assignment.groups)
        ax.set(xlabel="MTP bytes on disk (MB)", ylabel="worst AL loss vs BF16 (estimate)",
               title=f"MTP precision search ({groups}: B=bf16, F=fp8, N=nvfp4)")
        ax.legend(fontsize=7)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)


def chosen_profile(result: SearchResult, acceptance: Sequence[Acceptance], *, checkpoint: str) -> SpeculationProfile:
    """The chosen MTP's predicted acceptance as a speculation profile (the headline: the largest k, greedy)."""
    head = acceptance[0]
    top = head.by_k[-1]
    s = result.settings
    rule = SamplingRule.of(head)
    counts = "observed"

    def rows(acc: Acceptance) -> tuple[ProfileRow, ...]:
        return tuple(ProfileRow.of(r, "observed" if acc.sampling.greedy else "expected") for r in acc.by_k)

    conditions = Conditions(
        rule.temperature, rule.top_p, rule.top_k, rule.seed, rule.rule,
        dataset="held-out offline prompts (mtpquant precision search)", num_samples=result.prompts,
        osl=0.0, validation="built-in prediction (mtpquant precision search: the chosen MTP on the quantized target's "
        "hidden states)", engine="built-in", activations=s.activations, versions={"mtpquant": __version__},
    )  # fmt: skip
    return SpeculationProfile(
        num_speculative_tokens=top.k,
        headline=ProfileRow.of(top, counts),
        draft_checkpoint=DraftCheckpoint(checkpoint, None),
        target_model=TargetModel(checkpoint, result.family, {
            "mtp_precision": result.choice.assignment.to_json(),
            **({"mtp_healed": True} if result.choice.role == "healed" else {}),
        }),
        measurement_conditions=conditions,
        by_k=rows(head),
        by_sampling=tuple(SamplingProfile(SamplingRule.of(a), rows(a)) for a in acceptance),
        by_context=(),
        mtpquant=ProfileSource(REPORT_FILE, REPORT_SCHEMA, result.choice.verdict),
    )


def search_documents(result: SearchResult, acceptance: Sequence[Acceptance], *, checkpoint: str) -> dict[str, bytes]:
    """Every file of ``mtp_search/`` (relative to the output) and its bytes."""
    report = {"schema": REPORT_SCHEMA, "mtpquant_version": __version__, **result.to_json()}
    profile = chosen_profile(result, acceptance, checkpoint=checkpoint).to_json()
    return {
        f"{SEARCH_DIR}/{REPORT_FILE}": (json.dumps(report, indent=2) + "\n").encode(),
        f"{SEARCH_DIR}/{MARKDOWN_FILE}": render_markdown(result).encode(),
        f"{SEARCH_DIR}/{PLOT_FILE}": _pareto_png(result),
        f"{SEARCH_DIR}/{PROFILE_FILE}": (json.dumps(profile, indent=2) + "\n").encode(),
    }


def read_result(data: Any) -> SearchResult:
    """``report.json`` read back (``ValueError`` naming the first problem)."""
    return SearchResult.from_json(data, f"{SEARCH_DIR}/{REPORT_FILE}")
