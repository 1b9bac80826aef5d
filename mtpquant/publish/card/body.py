"""The card's text: metadata through huggingface_hub's ``ModelCardData``, then the Markdown sections (MTP,
what was quantized, what stayed BF16, validation, serving, provenance), sealed with the generated-card marker.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant import __version__
from mtpquant.card_marker import card_head, seal
from mtpquant.checkpoint.precision import is_quantized
from mtpquant.engine.table import ENGINES
from mtpquant.engine.verdicts import serve_command
from mtpquant.publish.card.facts import (
    VALIDATION_PROFILE,
    CardFacts,
    base_model,
    base_model_link,
    license_line,
    license_metadata,
    mtp_mode,
    public_command,
    public_text,
    report_outdated_by,
)
from mtpquant.publish.card.metadata import redact
from mtpquant.publish.card.search import search_lines
from mtpquant.publish.card.sidecar import sidecar_body, sidecar_data
from mtpquant.records.table import acceptance_table
from mtpquant.records.validation import activations_label, sides
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

    from mtpquant.diagnose.report import InspectReport
    from mtpquant.records.validation import Settings

__all__ = ["build_card", "card_data"]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _tags(facts: CardFacts) -> list[str]:
    q = facts.report.quantization
    algo = str(q.algorithm or "").upper()
    tags: list[str] = []
    if "NVFP4" in algo or (algo == "MIXED_PRECISION" and "NVFP4" in json.dumps(facts.hf_quant_config or {})):
        tags.append("nvfp4")
    if q.method == "modelopt":
        tags.append("modelopt")
    elif q.method:
        tags.append(q.method)
    if facts.report.mtp_present_tensors:
        tags += ["mtp", "speculative-decoding"]
    if facts.provenance.heal is not None:
        tags.append("mtp-healed")
    tags += [facts.family_key, "mtpquant"]
    return list(dict.fromkeys(tags))


def card_data(facts: CardFacts) -> dict[str, Any]:
    """The card's metadata (``ModelCardData`` fields), only with what is known."""
    from huggingface_hub import ModelCardData

    base, _, _ = base_model(facts)
    quantized = bool(facts.report.quantization.method)
    data = ModelCardData(
        base_model=base,
        base_model_relation="quantized" if base and quantized else None,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if facts.report.vision.present else "text-generation",
        **license_metadata(facts),
        tags=_tags(facts),
    )
    return dict(data.to_dict())


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _quant_line(facts: CardFacts) -> str:
    q = facts.report.quantization
    if not q.method:
        return "This checkpoint carries no quantization metadata: its Linear layers are not quantized."
    producer = (facts.hf_quant_config or {}).get("producer") if facts.hf_quant_config else None
    prod = ""
    if isinstance(producer, Mapping) and producer.get("name"):
        prod = f", exported by {producer.get('name')} {producer.get('version') or ''}".rstrip()
    kv = q.kv_cache or "not quantized"
    return (
        f"Quantization: `{q.method}` `{q.algorithm}` (vLLM loads it as `{q.vllm_method}`), "
        f"group size {q.group_size}, KV cache {kv}{prod}."
    )


def _recipe_lines(facts: CardFacts) -> list[str]:
    if facts.recipe is None:
        return ["The resolved recipe is not recorded in this checkpoint."]
    recipe = facts.recipe.data
    lines = []
    quant = _mapping(recipe.get("quantization"))
    calib = _mapping(recipe.get("calibration"))
    if quant:
        lines.append(
            f"Recipe `{recipe.get('name', facts.recipe.file)}`: scheme `{quant.get('scheme')}`, targets "
            f"`{quant.get('targets')}`, calibration `{quant.get('algorithm')}`"
            + (
                f" on {calib.get('samples')} samples x {calib.get('seq_len')} tokens of `{calib.get('data')}` data"
                if calib
                else ""
            )
            + "."
        )
    lines += ["", f"<details><summary>Resolved recipe (<code>{facts.recipe.file}</code>)</summary>", ""]
    lines += ["```yaml", public_text(facts.recipe.text).rstrip("\n"), "```", "", "</details>"]
    return lines


def _bf16_lines(facts: CardFacts) -> list[str]:
    r = facts.report
    main = r.main_model
    lines = []
    precs = ", ".join(f"{n} {p}" for p, n in main.precisions.items())
    lines.append(
        f"- Main model: {main.quantized} of {main.linear_modules} Linear modules quantized "
        f"({precs or 'none'})."
    )
    if r.vision.present:
        vp = ", ".join(f"{n} {p}" for p, n in r.vision.precisions.items())
        lines.append(f"- Vision tower (`model.visual.*`): {r.vision.tensors} tensors, kept as is ({vp}).")
    elif r.vision.expected:
        lines.append("- Vision tower: **missing** (image input will not work).")
    if r.mtp_present_tensors:
        lines.append(f"- MTP layer: {r.mtp_precision}.")
    excl = [str(x) for x in r.quantization.exclude]
    if excl:
        # patterns (mtp*, model.visual*, re:...) say the most; exact module names follow
        first = sorted(excl, key=lambda x: "*" not in x and not x.startswith("re:"))
        shown = ", ".join(f"`{_md_escape(x)}`" for x in first[:8])
        more = f" and {len(excl) - 8} more" if len(excl) > 8 else ""
        lines.append(f"- Excluded from quantization ({len(excl)} patterns): {shown}{more}.")
        if len(excl) > 8:
            lines += ["", "<details><summary>All exclusions</summary>", "", "```text", *excl, "```", "", "</details>"]
    return lines


def _present_text(r: InspectReport) -> str:
    size = format_bytes(r.mtp_bytes)
    n, expected = r.mtp_present_tensors, r.mtp_expected_tensors
    if n == 0:
        return f"none of {expected} expected tensors"
    if r.mtp_missing:
        return f"{n} tensors ({size}); {len(r.mtp_missing)} of {expected} expected tensors missing"
    if n == expected:
        return f"all {expected} expected tensors ({size})"
    return f"all {expected} expected weights, {n} tensors with their scales ({size})"


def _mtp_table(facts: CardFacts) -> list[str]:
    r = facts.report
    shards = ", ".join(f"`{s}`" for s in r.mtp_shards) or "none"
    rows = [
        ("Mode", f"`{mtp_mode(facts)}`"),
        ("Declared", _md_escape(r.mtp_declaration)),
        (
            "Present",
            _present_text(r),
        ),
        ("Precision", r.mtp_precision),
        ("Shard(s)", shards),
        *((e.display, _md_escape(r.verdicts.get(e.key, "unknown"))) for e in ENGINES),
    ]
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if r.mtp_modules:
        lines += ["", "| MTP module (as vLLM builds it) | on disk | vLLM builds it | consistent |", "|---|---|---|---|"]
        for m in r.mtp_modules:
            built = "refused" if m.vllm_quantized is None else ("quantized" if m.vllm_quantized else "unquantized")
            lines.append(f"| `{m.module}` | {m.disk} | {built} | {'yes' if m.consistent else 'NO'} |")
    return lines


# the card is about this checkpoint: the report's candidate (or its one checkpoint) is called so
_CARD_NAMES = {"candidate": "this checkpoint", "checkpoint": "this checkpoint"}


def _validation_lines(facts: CardFacts) -> list[str]:
    v = facts.validation
    if v is None:
        return [
            "No validation report was found in this checkpoint, so draft acceptance was not measured here "
            "(`mtpquant validate SRC OUT --report-dir OUT/validation` before publishing adds it)."
        ]
    link = f"[`{v.markdown or v.file}`]({v.markdown or v.file})"
    rep = v.report
    if rep is None:
        return [f"A validation report is included ({link}), but its figures are in a format this card does not read."]
    changed = report_outdated_by(facts.provenance, rep.created)
    if changed is not None:
        return [
            f"A validation report is included ({link}), but it was made ({rep.created}) before `mtpquant "
            f"{changed.tool}` changed this checkpoint ({changed.created}): its figures describe the checkpoint as it "
            "was then, not this one, so this card does not show them (`mtpquant validate SRC OUT --report-dir "
            "OUT/validation` measures this one)."
        ]
    pair = rep.pair and rep.candidate is not None
    sub, ref = rep.subject, (rep.reference if pair else None)
    s = rep.settings
    head = [f"{s.num_prompts} prompts" if s.num_prompts else None, f"k = 1..{s.k}" if s.k else None]
    if s.activations:
        head.append(f"activations {activations_label(s.activations)}")
    made = (
        f" (mtpquant {rep.mtpquant_version}" + (f", {rep.created}" if rep.created else "") + ")"
        if rep.mtpquant_version
        else ""
    )
    engine = f" through {rep.engine[0].name} {rep.engine[0].version}" if rep.engine else ""
    what = "this checkpoint against its reference" if pair else "this checkpoint"
    lines = [
        f"`mtpquant validate`{made} measured {what}{engine} with {_verification(s)}"
        + (" (" + ", ".join(h for h in head if h) + ")" if any(head) else "")
        + ".",
        "",
    ]
    reasons = "; ".join(public_text(r) for r in rep.verdict.reasons)
    lines += [f"Verdict: **{rep.verdict.status}**" + (f": {_md_escape(reasons)}" if reasons else "") + ".", ""]
    for label, side in (("reference", ref), ("this checkpoint", sub)):
        if side is not None and side.mtp.error:
            lines += [f"MTP of {label} not evaluated: {_md_escape(public_text(side.mtp.error))}.", ""]
    if any(side.acceptance for _, side in sides(rep)):
        lines += [acceptance_table(rep, sides(rep), markdown=True, names=_CARD_NAMES), ""]
    sub_tf = sub.acceptance.teacher_forced_agreement if sub.acceptance else None
    ref_tf = ref.acceptance.teacher_forced_agreement if ref is not None and ref.acceptance else None
    extra = []
    cmp_mtp = rep.comparison.mtp if rep.comparison is not None else None
    if cmp_mtp is not None:
        extra.append(
            f"on identical inputs the MTP's top-1 agrees with the reference MTP's {_pct(cmp_mtp.top1_agreement)} of "
            "the time"
        )
        if cmp_mtp.kl is not None:
            extra.append(f"mean KL(reference || this) {cmp_mtp.kl.mean:.4g}")
    if sub_tf is not None:
        extra.append(
            f"teacher-forced agreement {_pct(sub_tf)}" + (f" (reference {_pct(ref_tf)})" if ref_tf is not None else "")
        )
    if extra:
        joined = "; ".join(extra)
        lines += [joined[0].upper() + joined[1:] + ".", ""]
    lines += [f"- Note: {_md_escape(public_text(n))}" for n in rep.notes]
    if rep.notes:
        lines.append("")
    if v.profile is not None:
        p = v.profile
        conditional = " / ".join(_pct(c) for c in p.conditional_accept_rates)
        lines += [
            f"Speculation profile ([`{VALIDATION_PROFILE}`]({VALIDATION_PROFILE}), the shape NVIDIA Model-Optimizer "
            f"proposes for serving simulators): k = {p.k}, mean acceptance length {p.mean_accept_length:.2f}, "
            f"conditional acceptance per draft position {conditional} ({_md_escape(public_text(p.conditions))}).",
            "",
        ]
    lines.append(f"Full report: {link}.")
    return lines


def _verification(settings: Settings) -> str:
    """How the acceptance was verified: greedy, or the sampling settings and rule."""
    if all(x.greedy for x in settings.sampling):
        return "greedy verification as the engines do it"
    return f"{settings.rule} verification at " + "; ".join(x.label for x in settings.sampling)


def _heal_lines(facts: CardFacts) -> list[str]:
    """What ``mtpquant heal`` did to the MTP now in OUT (nothing when it was not healed)."""
    record = facts.provenance.heal
    if record is None:
        return []
    greedy = record.sequences - record.sampled
    lines = [
        "## MTP healed to this quantized model",
        "",
        f"After quantization the MTP layer ({record.precision}) was re-aligned to this checkpoint's own quantized "
        "model with `mtpquant heal`: only the `mtp.*` weights were trained (model, embeddings and LM head frozen), "
        "so that the MTP's distribution for the token after next matches the quantized model's own (self-"
        f"distillation, KL), on {record.sequences} sequences ({record.tokens} tokens) the quantized model produced "
        f"from calibration prompts ({_md_escape(public_text(record.data))}; {greedy} greedy, {record.sampled} at "
        f"temperature {record.temperature:g}): {record.steps} steps of {record.batch_size} sequences, learning rate "
        f"{record.lr:g}, {record.chain} chained draft step(s) trained, seed {record.seed}."
        + (" The MTP was trained with modelopt's fake quantization in the loop and written back in its format."
           if record.precision != "BF16" else ""),
        "",
        f"Draft acceptance on {record.check_sequences} held-out prompts (not trained on; greedy speculative decoding "
        "replayed with the checkpoint's own weights), before and after, with the paired 95 % bootstrap interval of "
        "the change:",
        "",
        "| k | AL before | AL after | change | 95 % interval |",
        "|---|---|---|---|---|",
    ]
    for row in record.by_k:
        interval = f"[{row.low:+.3f}, {row.high:+.3f}]" if row.low == row.low and row.high == row.high else "n/a"
        lines.append(f"| {row.k} | {row.before:.3f} | {row.after:.3f} | {row.after - row.before:+.3f} | {interval} |")
    lines.append("")
    if record.forced:
        lines += [
            "> [!WARNING]",
            "> Written with `--force`: the held-out check did not show the healed MTP better beyond noise "
            + ("at every k." if record.served_k is None or record.strict else f"at the served k = {record.served_k} "
               "(or showed it worse at some k)."),
            "",
        ]
    return lines


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _with_revision(cmd: str, revision: str | None) -> str:
    return f"{cmd} --revision {shlex.quote(revision)}" if revision and revision != "main" else cmd


def _measured_k(facts: CardFacts) -> int | None:
    """The largest k the validation report measured on this checkpoint (None: no current report measured one)."""
    v = facts.validation
    rep = v.report if v is not None else None
    if rep is None or rep.subject.acceptance is None or report_outdated_by(facts.provenance, rep.created):
        return None
    return max((row.k for row in rep.subject.acceptance.by_k), default=None)


def _serving_lines(facts: CardFacts) -> list[str]:
    r = facts.report
    repo = facts.repo_id
    k = _measured_k(facts)
    cmds = {  # inspect's commands (the engines that load this MTP), for the Hub repo, at the k validation measured
        engine: _with_revision(serve_command(engine, repo, *([k] if k is not None else [])), facts.revision)
        for engine in r.serve_commands
    }
    lines: list[str] = []
    if k is not None and cmds:
        drafts = "1 token" if k == 1 else f"{k} tokens"
        lines += [f"Drafting {drafts} per step (k = {k}), the largest k the validation report measured.", ""]
    quantized_mtp = any(is_quantized(m.disk) for m in r.mtp_modules)
    for e in ENGINES:
        verdict = r.verdicts.get(e.key, "unknown")
        if e.key in cmds:
            lines += [e.card_heading, "", "```bash", cmds[e.key], "```", ""]
        elif quantized_mtp and hasattr(e.adapter, "card_without_mtp"):  # the engine serves it without its MTP
            plain = _with_revision(e.adapter.plain_serve_command(repo), facts.revision)
            lines += e.adapter.card_without_mtp(r.mtp_precision, _md_escape(r.verdicts.get(e.key, "")), plain)
        else:
            lines += [f"{e.display}: no MTP serve command: {_md_escape(verdict)}.", ""]
    return lines


def _reproduce_lines(facts: CardFacts) -> list[str]:
    steps = facts.provenance.steps
    lines: list[str] = []
    if not steps:
        lines += ["This checkpoint does not record the mtpquant command that produced it (no provenance file).", ""]
    for step in steps:
        version = f"mtpquant {step.mtpquant_version}" if step.mtpquant_version else "mtpquant (version not recorded)"
        libs = ", ".join(f"{k} {v}" for k, v in step.versions.items() if k in ("nvidia-modelopt", "transformers"))
        if step.command:
            lines += [
                f"{'Produced' if step is facts.provenance.origin else 'Then changed'} by {version} `{step.tool}`"
                + (f" ({libs})" if libs else "")
                + " with:",
                "",
                "```bash",
                public_command(step),
                "```",
                "",
            ]
        else:
            lines += [f"{step.tool} by {version} (the exact command line is not recorded).", ""]
    origin = facts.provenance.origin
    src = origin.source if origin is not None else None
    if src is not None and (src.repo_id or src.path):
        at = src.commit or src.revision
        rev = f" at revision `{at}`" if at else ""
        where = f"`{src.repo_id}`" if src.repo_id else f"a local directory named `{Path(src.path or '').name}`"
        lines += [f"Source checkpoint: {where}{rev}.", ""]
    lines.append(f"Card generated and published by mtpquant {__version__} (`mtpquant publish`).")
    return lines


def _forced_lines(facts: CardFacts) -> list[str]:
    if not facts.forced:
        return []
    r = facts.report
    lines = [
        "> [!WARNING]",
        "> **Published with `--force`**: this checkpoint failed mtpquant's pre-publication checks "
        "(`mtpquant inspect`). It was uploaded anyway, as it is:",
    ]
    lines += [f"> - {_md_escape(m)}" for m in r.failure_messages]
    lines.append("")
    return lines


def build_card(facts: CardFacts) -> ModelCard:
    """The card for OUT: metadata plus a Markdown body, sealed with the generated-card marker."""

    if facts.report.kind == "mtp-only":
        return _card(sidecar_data(facts), sidecar_body(facts))
    r = facts.report
    meta = card_data(facts)
    base, base_revision, base_origin = base_model(facts)
    name = facts.repo_id.split("/")[-1]
    scheme = r.quantization.algorithm or "unquantized"
    mtp_phrase = {
        "keep": f"its Multi-Token-Prediction (MTP) layer kept in {r.mtp_precision}",
        "quantize": f"its Multi-Token-Prediction (MTP) layer quantized ({r.mtp_precision})",
        "search": f"its Multi-Token-Prediction (MTP) layer's precision chosen per module group by search "
        f"({r.mtp_precision})",
        "drop": "no Multi-Token-Prediction (MTP) layer (dropped on purpose; no MTP speculative decoding)",
        "missing": "its Multi-Token-Prediction (MTP) layer **declared but missing**",
    }.get(mtp_mode(facts), f"MTP: {r.mtp_precision}")
    of = base_model_link(base)
    lines = [
        *card_head(name),
        f"{scheme} checkpoint of {of} ({r.family}, `{r.architecture}`) with {mtp_phrase}. "
        "Made with mtpquant and checked by `mtpquant inspect` before upload.",
        "",
        *_forced_lines(facts),
        "## MTP layer (speculative decoding)",
        "",
        *_mtp_table(facts),
        "",
        *search_lines(facts.search),
        "## What was quantized, and how",
        "",
        _quant_line(facts),
        "",
        *_recipe_lines(facts),
        "",
        "### What stayed in BF16 (or as in the source)",
        "",
        *_bf16_lines(facts),
        "",
        *_heal_lines(facts),
        "## Validation",
        "",
        *_validation_lines(facts),
        "",
        "## Serving",
        "",
        *_serving_lines(facts),
        "## Provenance",
        "",
        *_reproduce_lines(facts),
        "",
    ]
    if base:
        at = f" at revision `{base_revision}`" if base_revision else ""
        lines += [f"Base model `{base}`{at} from {base_origin}."]
    else:
        lines += [
            "Base model: unknown (no provenance file names it and config.json has no Hub id), so the card's "
            "metadata names none (`mtpquant publish OUT --repo ID --base-model ORG/NAME` names it)."
        ]
    if facts.license is None and facts.license_file:
        unknown = f"Licence: see [`{facts.license_file}`]({facts.license_file}), carried over from the source."
    else:
        unknown = "Licence: not recorded in the source metadata; the licence of the base model applies."
    lines += ["", license_line(facts, unknown)]
    return _card(meta, lines)


def _card(meta: dict[str, Any], lines: list[str]) -> ModelCard:
    """Metadata block and body, with any token masked, sealed with the generated-card marker."""
    from huggingface_hub import ModelCard, ModelCardData

    body = "\n".join(lines).rstrip("\n") + "\n"
    data = ModelCardData(**meta)
    card = ModelCard("---\n" + data.to_yaml() + "\n---\n\n" + body)
    return ModelCard(seal(redact(str(card))))
