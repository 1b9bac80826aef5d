"""Every result as text, for the CLI (and anyone who wants it): one place for the human-readable forms.

``inspect_text`` (InspectReport), ``plan_lines`` / ``convert_text`` (ConvertPlan / ConvertResult),
``graft_text`` (GraftResult), ``heal_text`` (HealResult), ``publish_plan_text`` (a dry-run PublishResult),
``acceptance_text`` and ``validate_text`` (a validation Report), ``search_lines`` (the MTP precision
search). Imports only the result types; sizes through
``units.format_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mtpquant.checkpoint.precision import linears_text
from mtpquant.engine.table import display as engine_display
from mtpquant.records.table import acceptance_table
from mtpquant.records.validation import Report, sides
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from mtpquant.convert.plan import ConvertPlan
    from mtpquant.convert.result import ConvertResult
    from mtpquant.diagnose.report import InspectReport
    from mtpquant.graft.run import GraftResult
    from mtpquant.heal.run import HealResult
    from mtpquant.publish.run import PublishResult
    from mtpquant.search.run import SearchResult
    from mtpquant.tune.run import TuneResult

__all__ = [
    "acceptance_text",
    "convert_text",
    "graft_text",
    "heal_table",
    "heal_text",
    "inspect_text",
    "plan_lines",
    "publish_plan_text",
    "search_lines",
    "tune_text",
    "validate_text",
]


def inspect_text(r: InspectReport) -> str:
    """The report as a compact text table."""
    q = r.quantization
    main = r.main_model
    expected_present = r.mtp_expected_tensors - len(r.mtp_missing)
    scales = r.mtp_present_tensors - expected_present - len(r.mtp_unexpected)
    if r.mtp_inventory == "exact":
        counted = f"{expected_present}/{r.mtp_expected_tensors} expected tensors" + (
            f" (+{scales} quantization scales)" if scales > 0 else ""
        )
    else:  # the glue of each layer is known (or nothing is): the tensors as they are
        layers = f"{r.mtp_layers_present} layer{'' if r.mtp_layers_present == 1 else 's'}"
        counted = f"{r.mtp_present_tensors} tensors in {layers}" + (
            f" (glue {expected_present}/{r.mtp_expected_tensors})" if r.mtp_inventory == "glue" else ""
        )
    rows = [
        ("checkpoint", r.checkpoint),
        ("family", f"{r.family} ({r.architecture})"),
        *(
            [("drafter", ", ".join(f"{engine_display(e)} {c or '(none)'}" for e, c in r.drafters.items()))]
            if r.drafters
            else []
        ),
        ("MTP declared", r.mtp_declaration),
        (
            "MTP present",
            f"none: removed on purpose (convert --mtp {r.mtp_removed})"
            if r.mtp_removed
            else counted
            + (f" (+{len(r.mtp_unexpected)} unexpected)" if r.mtp_unexpected else "")
            + f", {format_bytes(r.mtp_bytes)}"
            + (f" in {', '.join(r.mtp_shards)}" if r.mtp_shards else ""),
        ),
        ("MTP precision", r.mtp_precision),
        (
            "quantization",
            "none"
            if q.method is None
            else " ".join(filter(None, (q.method, q.algorithm))) + f" (vLLM: {q.vllm_method})"
            + (f", group size {q.group_size}" if q.group_size is not None else "")
            + f", KV cache {q.kv_cache or 'unquantized'}",
        ),
        *(
            [("contents", "the MTP layer alone (an MTP sidecar): no main model, no vision tower")]
            if r.kind == "mtp-only"
            else [
                ("main Linears", linears_text(main.precisions)),
                (
                    "vision tower",
                    f"present, {r.vision.tensors} tensors; {linears_text(r.vision.precisions)}"
                    if r.vision.present
                    else ("MISSING" if r.vision.expected else "none (text-only)"),
                ),
            ]
        ),
        (
            "index",
            f"{r.index.shards} shard{'' if r.index.shards == 1 else 's'}, {r.index.tensors} tensors, "
            + ("intact" if r.index.intact else "CORRUPT"),
        ),
        (
            "read",
            f"{format_bytes(r.bytes_fetched)} of {format_bytes(r.checkpoint_bytes)}"
            + (f" in {r.requests} requests" if r.requests else "")
            + f" in {r.seconds:.2f} s",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if r.mtp_modules:
        lines.append("")
        lines.append(f"{'MTP module (as vLLM builds it)'.ljust(44)} {'on disk'.ljust(10)} {'vLLM builds'.ljust(12)} ok")
        for m in r.mtp_modules:
            built = "refused" if m.vllm_quantized is None else ("quantized" if m.vllm_quantized else "unquantized")
            ok = "yes" if m.consistent else "NO: " + m.reason
            lines.append(f"{m.module.ljust(44)} {m.disk.ljust(10)} {built.ljust(12)} {ok}")
    if r.mtp_missing and not r.mtp_removed:
        lines.append(
            f"missing MTP tensors: {', '.join(r.mtp_missing[:5])}" + (" ..." if len(r.mtp_missing) > 5 else "")
        )
    if r.mtp_unexpected:
        lines.append(
            f"unexpected MTP tensors: {', '.join(r.mtp_unexpected[:5])}" + (" ..." if len(r.mtp_unexpected) > 5 else "")
        )
    lines.append("")
    lines += r.verdicts.values()
    for f in r.failures:
        lines.append(f"FAIL  {f.message}")
    for f in r.warnings:
        lines.append(f"WARN  {f.message}")
    lines += [f"fix   {command}" for command in r.fixes]
    if r.serve_commands:
        lines.append("")
        lines += [f"serve ({engine_display(engine)}): {cmd}" for engine, cmd in r.serve_commands.items()]
    lines.append("")
    lines.append("verdict: healthy" if r.healthy else f"verdict: {len(r.failures)} problem(s)")
    return "\n".join(lines)


def _examples(mods: Sequence[str]) -> str:
    leaves = sorted({m.rsplit(".", 1)[-1] if "layers." in m else m for m in mods})
    return f" ({', '.join(leaves[:6])}{', ...' if len(leaves) > 6 else ''})" if leaves else ""


def plan_lines(plan: ConvertPlan) -> list[str]:
    """The human-readable plan (``--dry-run`` output)."""
    r = plan.recipe
    q = r.quantization
    scheme = "NVFP4 W4A4" if q.activations else "NVFP4 W4A16 (weights only)"
    out = [
        f"source     {plan.src}: {plan.family_display} ({plan.architecture}), {plan.source_tensors} tensors, "
        f"{format_bytes(plan.source_bytes)} in {plan.source_shards} shard(s)",
        f"recipe     {r.name} ({r.source}): {scheme}, {q.targets} Linears, {q.algorithm} calibration",
        f"main       {len(plan.quantized_modules)} Linears -> NVFP4; {len(plan.unquantized_modules)} Linears stay "
        f"in source precision{_examples(plan.unquantized_modules)}",
    ]
    if plan.vision_tensors:
        out.append(
            f"vision     {plan.vision_tensors} tensors ({format_bytes(plan.vision_bytes)}) copied unchanged, "
            "not quantized"
        )
    out.append(
        f"MTP        {plan.mtp_declaration}; {len(plan.mtp_tensors)} tensors ({format_bytes(plan.mtp_bytes)}) in source"
    )
    out.append("mode       " + plan.mode_line())
    if plan.search is not None and plan.search_space is not None:
        s, space = plan.search, plan.search_space
        out.append(
            f"search     groups {', '.join(space['groups'])}; {space['configurations']} configurations load in "
            f"{s.engine} ({', '.join(s.precisions)}), {format_bytes(space['smallest_bytes'])} to "
            f"{format_bytes(space['bf16_bytes'])}; budget {s.budget:g} AL at k = 1..{s.k}, selected on "
            f"{s.num_prompts} held-out prompts, confirmed on {s.confirm_prompts} others"
        )
    c = r.calibration
    out.append(
        f"calib      {c.samples} x {c.seq_len} tokens from {c.data}, batch {c.batch_size}"
        f"{', chat template' if c.chat_template else ''}; device {plan.device}"
    )
    out.append(f"output     {plan.out} (shards <= {format_bytes(plan.max_shard_bytes)})")
    if plan.mtp_out is not None:
        out.append(f"MTP output {plan.mtp_out}")
    out.append(f"carry      {', '.join(plan.carried_files) or '(no other files)'}")
    out += plan.memory.lines()
    if plan.search_memory is not None:  # --mtp auto: the quantized target the search measures on, under the same caps
        out += [line.replace("main model", "search target (quantized, dequantized)", 1)
                for line in plan.search_memory.lines("the search measures on it in one pass")[:2]]
    if plan.memory.layerwise:
        out.append(
            f"resume     state committed every {plan.resume_every} layer(s), "
            f"~{format_bytes(plan.resume_activation_bytes)} of saved layer inputs a commit (--resume-every)"
        )
    out += [f"note       {n}" for n in plan.notes]
    return out


def convert_text(result: ConvertResult) -> str:
    """What convert did (or, for a dry run, the plan)."""
    if result.dry_run:
        return "\n".join(["dry run: nothing written", *plan_lines(result.plan)])
    p = result.plan
    counts = ", ".join(f"{k} {v}" for k, v in sorted(result.tensor_counts.items()))
    t = result.timings
    lines = [
        f"wrote {p.out} ({format_bytes(result.output_bytes)} from {format_bytes(p.source_bytes)}; "  # as given
        f"recipe {p.recipe.name}, "
        f"MTP {p.mode})",
        f"tensors    {counts}; {result.quantized_linears} Linears NVFP4, {result.unquantized_linears} unquantized",
    ]
    if result.mtp_output is not None:
        lines.append(f"MTP        extracted to {p.mtp_out} ({format_bytes(result.mtp_output_bytes)})")
    elif result.mtp_tensors:
        lines.append(f"MTP        {result.mtp_tensors} tensors, {result.mtp_precision}")
    else:
        lines.append("MTP        none in the output")
    calib = f"calib      {result.calibration_rows} rows, {result.calibration_tokens} tokens"
    if result.layerwise:
        calib += ", layer by layer"
        if result.resumed_from_layer is not None:
            calib += f" (resumed at layer {result.resumed_from_layer + 1})"
    lines.append(calib)
    if result.placement:
        lines.append("placement  " + ", ".join(f"{n} modules on {d}" for d, n in sorted(result.placement.items())))
    if result.bytes_written:
        ratio = result.bytes_written / max(result.output_bytes, 1)
        parts = [f"{ratio:.2f}x the output"]
        if result.resume_bytes:
            parts.append(f"resume state {format_bytes(result.resume_bytes)}")
        if result.offload_bytes:
            parts.append(f"offload copies {format_bytes(result.offload_bytes)}")
        lines.append(
            f"written    {format_bytes(result.bytes_written)} ({', '.join(parts)}); exported shards "
            f"moved {result.shards_moved}, rewritten {result.shards_rewritten}"
        )
    lines.append("time       " + ", ".join(f"{k} {v:.1f}s" for k, v in t.items()))
    mem = f"peak RSS {format_bytes(result.peak_rss_bytes)}"
    if result.peak_gpu_bytes:
        mem += f", peak GPU {format_bytes(result.peak_gpu_bytes)}"
    lines.append(f"memory     {mem}")
    if result.search is not None:
        lines += search_lines(result.search)
    lines += [f"verdict    {v}" for v in _merged_verdicts(result.verdicts)]
    lines += [f"note       {n}" for n in result.notes]
    return "\n".join(lines)


def search_lines(result: SearchResult) -> list[str]:
    """The precision search in a few lines: the choice, its bytes against the BF16 MTP's, the AL change per k (greedy),
    why, what was left out for want of evidence, the report's place."""
    chosen = result.choice
    s = result.settings
    greedy = chosen.by_sampling[0]
    changes = " / ".join(c.change.text(signed=True) if c.change else f"{c.al.estimate:.3f}" for c in greedy.by_k)
    lines = [
        f"search     chose {chosen.assignment.label}: {format_bytes(chosen.nbytes)}, "
        f"{chosen.nbytes / result.bf16_bytes:.2f}x the BF16 MTP's {format_bytes(result.bf16_bytes)} "
        f"(declared {chosen.declaration}; budget {s.budget:g} AL, engines {s.engine})",
        f"measured   {len(result.evaluated)} measurements of {result.configurations} configurations: selected on "
        f"{len(result.selection_prompts)} held-out prompts, confirmed on {result.prompts} others, k = 1..{s.k}, "
        f"{', '.join(x.label for x in result.sampling)}; AL change (greedy, confirmation): {changes}",
        f"why        {result.reason}",
    ]
    if result.fixed:
        lines.append(f"recipe     keeps {', '.join(result.fixed)} BF16 (quantization.exclude)")
    if result.not_taken:
        lines.append(f"not taken  {result.not_taken}")
    for f in result.healed:  # --heal: each finalist's predicted AL (greedy) before and after heal
        before, after = result.evaluated[f.before], result.evaluated[f.after]
        als = [" / ".join(f"{c.al.estimate:.3f}" for c in j.by_sampling[0].by_k) for j in (before, after)]
        lines.append(f"healed     {f.assignment.label} ({format_bytes(after.nbytes)}): AL (greedy) {als[0]} -> "
                     f"{als[1]}, {after.verdict}")
    lines.append("report     mtp_search/report.md (every configuration), mtp_search/pareto.png")
    return lines


def _merged_verdicts(verdicts: Mapping[str, str]) -> list[str]:
    """One line per distinct verdict: ``vLLM, SGLang: no MTP declared ...`` instead of the same words twice."""
    by_text: dict[str, list[str]] = {}
    for engine, verdict in verdicts.items():
        name = engine_display(engine)
        body = verdict[len(name) + 2 :] if verdict.startswith(name + ": ") else None
        by_text.setdefault(body if body is not None else verdict, []).append(name if body is not None else "")
    return [f"{', '.join(names)}: {text}" if all(names) else text for text, names in by_text.items()]


def tune_text(result: TuneResult) -> str:
    """What tune-mtp did (or, for a dry run, would do)."""
    p = result.plan
    lines = [result.message]
    if result.action == "planned":
        s = p.settings
        lines += [
            f"target     {p.quant}'s main model ({p.main_algo}); SRC {p.source}",
            f"search     groups {', '.join(p.groups)}; {p.configurations} configurations load in {s.engine} "
            f"({', '.join(s.precisions)}), {format_bytes(p.smallest_bytes)} to {format_bytes(p.bf16_bytes)} (QUANT's "
            f"MTP now {format_bytes(p.mtp_bytes)}); budget {s.budget:g} AL at k = 1..{s.k}, selected on "
            f"{s.num_prompts} held-out prompts, confirmed on {s.confirm_prompts} others",
            f"calib      {p.calibration.samples} x {p.calibration.seq_len} tokens from {p.calibration.data} "
            f"({p.calibration_from})",
            f"recipe     {p.calibration_from}: " + (f"keeps {', '.join(p.fixed)} BF16 (quantization.exclude)"
                                                     if p.fixed else "excludes no MTP group"),
            f"output     {p.destination}",
        ]
        lines += [line.replace("main model", "QUANT's main model (the search's target)", 1)
                  for line in p.memory.lines("the search measures on it in one pass")]
        lines += [f"note       {n}" for n in p.notes]
        return "\n".join(lines)
    if result.search is not None:
        lines += search_lines(result.search)
    lines.append(f"MTP        {format_bytes(result.mtp_bytes_before)} -> {format_bytes(result.mtp_bytes_after)}")
    lines += [f"metadata   {c}" for c in result.metadata_changes]
    lines.append(
        f"written    {format_bytes(result.bytes_written)}; new shards: {', '.join(result.new_shards) or 'none'}; "
        f"hard-linked {len(result.linked)}, copied {len(result.copied)}"
    )
    lines.append(f"verified   {', '.join(result.verified_with)}; put in place by {result.commit}")
    lines.append("time       " + ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items()))
    lines += [f"warning    {w}" for w in result.warnings]
    return "\n".join(lines)


def graft_text(result: GraftResult) -> str:
    """What graft did (or would do)."""
    lines: list[str] = []
    lines.append(result.message)
    if result.action in ("grafted", "replaced", "metadata", "planned"):
        if result.mtp_tensors:
            lines.append(f"  MTP: {result.mtp_tensors} tensors, {format_bytes(result.mtp_bytes)}")
        if result.source:
            fetched = f"  fetched from SRC: {format_bytes(result.src_bytes_fetched)}"
            if result.src_requests:
                fetched += f" in {result.src_requests} requests"
            if result.src_shards_downloaded:
                fetched += f" (downloaded whole: {', '.join(result.src_shards_downloaded)})"
            lines.append(fetched)
        if result.action != "planned":
            lines.append(
                f"  written: {format_bytes(result.bytes_written)}; new shards: {', '.join(result.new_shards) or '-'}"
            )
            lines.append(f"  hard-linked: {len(result.linked)} file(s); copied: {len(result.copied)}")
            for name in result.copied:
                lines.append(f"    copied (hard link failed): {name}")
            for name in result.rewritten:
                lines.append(f"    rewritten without the old MTP: {name}")
            for name in result.dropped:
                lines.append(f"    dropped (old MTP only): {name}")
        for change in result.metadata_changes:
            lines.append(f"  metadata: {change}")
        if result.verified_with:
            lines.append(f"  verified: {', '.join(result.verified_with)}")
        if result.commit:
            lines.append(f"  put in place by: {result.commit}")
    for name in result.cleaned:
        lines.append(f"  cleaned up after an interrupted run: {name}")
    for warning in result.warnings:
        lines.append(f"  warning: {warning}")
    return "\n".join(lines)


def heal_table(rows: Sequence[tuple[int, float, float, float, float]], verdicts: Sequence[str] = ()) -> list[str]:
    """The held-out AL per k before and after heal: ``(k, before, after, low, high)`` rows, with each k's verdict
    (better / no change / worse beyond noise) when given."""
    lines = ["  k  before   after  change  95% interval" + ("      verdict" if verdicts else "")]
    for i, (k, before, after, low, high) in enumerate(rows):
        verdict = f"  {verdicts[i]:>11}" if i < len(verdicts) else ""
        lines.append(f"{k:>3}  {before:6.3f}  {after:6.3f}  {after - before:+.3f}  [{low:+.3f}, {high:+.3f}]{verdict}")
    return lines


def heal_text(result: HealResult) -> str:
    """What heal did (or, for a dry run, the plan)."""
    if result.action == "planned":
        return "\n".join([result.message, *result.plan.lines()])
    lines = [result.message]
    check = result.check
    if check is not None and check.greedy_only:
        lines.append(f"check      {check.sequences} held-out prompts, {check.tokens} tokens (greedy, the quantized "
                     "target's own continuations)")
        lines += ["           " + line for line in heal_table([(c.k, c.before, c.after, c.low, c.high)
                                                               for c in check.by_k], [c.verdict for c in check.by_k])]
    elif check is not None:
        lines.append(f"check      {check.sequences} held-out prompts (the quantized target's own continuations) at "
                     f"{len(check.settings)} settings, sampled ones verified by --rule {check.rule}")
        for s in check.settings:
            verdict = {"better": "better beyond noise", "worse": "WORSE beyond noise"}.get(s.verdict,
                                                                                     "no change beyond noise")
            lines.append(f"           {s.sampling.label}: {verdict}")
            lines += ["             " + line for line in heal_table([(c.k, c.before, c.after, c.low, c.high)
                                                                     for c in s.by_k], [c.verdict for c in s.by_k])]
    record = result.record
    if record is not None:
        greedy = record.sequences - record.sampled
        lines.append(f"data       {record.sequences} sequences, {record.tokens} tokens ({greedy} greedy, "
                     f"{record.sampled} at temperature {record.temperature:g}) from {record.data}")
        lines.append(f"schedule   {record.steps} steps x {record.batch_size}, lr {record.lr:g}, chain {record.chain}, "
                     f"seed {record.seed}; MTP {record.precision}")
    if result.training is not None:
        lines.append(f"training   KL {result.training.first_loss:.4f} -> {result.training.last_loss:.4f}")
    lines.append(f"written    {format_bytes(result.bytes_written)}; new shards: {', '.join(result.new_shards) or '-'}; "
                 f"hard-linked {len(result.linked)}, copied {len(result.copied)}")
    for name in result.rewritten:
        lines.append(f"           rewritten without the old MTP: {name}")
    if result.verified_with:
        lines.append(f"verified   {', '.join(result.verified_with)}; put in place by {result.commit}")
    t = result.timings
    lines.append("time       " + ", ".join(f"{k} {v:.1f}s" for k, v in t.items())
                 + f"; CPU {result.cpu_seconds:.0f}s")
    lines.append(f"memory     peak RSS {format_bytes(result.peak_rss_bytes)}; hidden states on disk "
                 f"{format_bytes(result.data_bytes)} (removed)")
    for name in result.cleaned:
        lines.append(f"note       cleaned up after an interrupted run: {name}")
    lines += [f"warning    {w}" for w in result.warnings]
    return "\n".join(lines)


def publish_plan_text(result: PublishResult) -> str:
    """The dry-run text: target, gate, file list with sizes, then the full card."""
    where = result.repo_id + (f" (revision {result.revision})" if result.revision else "")
    gate = "passed" if result.healthy else "FAILED, publishing anyway (--force): " + "; ".join(result.gate_failures)
    width = max([len(f.path) for f in result.files] + [4])
    lines = [
        f"dry run: nothing uploaded, nothing written; would publish to {where}",
        f"checks: {gate}",
        *(f"  {v}" for v in result.verdicts.values()),
        f"files: {len(result.files)}, {format_bytes(result.total_bytes)}",
    ]
    for f in result.files:
        lines.append(f"  {f.path.ljust(width)}  {format_bytes(f.size).rjust(10)}" + (f"  ({f.note})" if f.note else ""))
    lines += [
        "",
        f"----- README.md ({result.card_action}) -----",
        result.card.rstrip("\n"),
        "----- end of README.md -----",
    ]
    return "\n".join(lines)


def acceptance_text(report: Report) -> str:
    """The acceptance table (``validate.table``), then the comparison on identical inputs, the AL change per k, the
    engines and the engine-vs-prediction rows."""
    lines = [acceptance_table(report, sides(report))]
    cmp = report.comparison
    for title, m in (("MTP", cmp.mtp if cmp else None), ("Main model", cmp.main if cmp else None)):
        if m is not None and m.kl is not None:
            lines.append(
                f"{title} on identical inputs: top-1 agreement {100 * m.top1_agreement:.2f} %, "
                f"KL(ref||cand) mean {m.kl.mean:.3g} (p99 {m.kl.p99:.3g})"
                + (f"; {m.non_finite} positions with non-finite logits" if m.non_finite else "")
            )
    evidence = report.verdict.evidence
    for label in dict.fromkeys(e.label for e in evidence):
        lines.append(
            f"AL change per k{f' ({label})' if label else ''}: "
            + ", ".join(
                f"k={e.k}: {e.change.text(signed=True)}"
                + (
                    f" (MTP {e.mtp.estimate:+.3f}, target {e.target.estimate:+.3f})"
                    if e.mtp is not None and e.target is not None
                    else ""
                )
                for e in evidence
                if e.label == label
            )
        )
    for e in report.engine:
        which = f"{e.side}: " if e.side and report.candidate is not None else ""
        lines.append(
            f"engine: {which}{engine_display(e.name)} {e.version} at {e.url}, model {e.model}, "
            f"k={e.k} ({e.k_source})"
        )
    if report.predicted:
        for label, rows in report.predicted.sides():
            for p_row in rows:
                positions = ""
                if p_row.engine_per_position:
                    pairs = zip(p_row.engine_per_position, p_row.predicted_per_position)
                    positions = "; per position engine/predicted " + " ".join(
                        f"{100 * e:.1f}/{100 * p:.1f}%" for e, p in pairs
                    )
                lines.append(
                    f"{label} {p_row.sampling.label} k={p_row.k}: engine AL {p_row.engine_al:.3f}, built-in prediction "
                    f"{p_row.predicted_al:.3f}, difference {p_row.difference:+.3f}{positions}"
                )
    return "\n".join(lines)


def decision_text(quant: Path, steps: Sequence[tuple[str, Report]], inspection: InspectReport) -> str:
    """The demo's last word: each validation of ``quant`` in the order they ran (its AL per k, the change from the
    source's, the verdict), then whether it is ready to publish (the last validation passed and inspect finds it
    healthy) and what to do next."""
    width = max(len(label) for label, _ in steps)
    lines = ["== decision"]
    for label, report in steps:
        by_k = report.subject.acceptance.by_k if report.subject.acceptance is not None else ()
        al = " / ".join(f"{row.mean_acceptance_length:.3f}" for row in by_k)
        change = " / ".join(f"{d:+.3f}" for d in (report.comparison.al_delta_by_k if report.comparison else ()))
        lines.append(f"{label:<{width}}  AL {al} (k = 1..{len(by_k)}), change from the source {change}: "
                     f"{report.verdict.status.upper()}")
    final = steps[-1][1].verdict
    if final.status == "pass" and inspection.healthy:
        lines.append(f"ready to publish: {quant} drafts within the allowed AL drop of its source and inspects healthy "
                     f"(next: mtpquant publish {quant} --repo ORG/NAME)")
    elif not inspection.healthy:
        lines.append(f"not ready: inspect finds {quant} unhealthy (above)")
    else:
        lines.append(f"not ready: the last validation is {final.status.upper()}: {'; '.join(final.reasons)}")
    return "\n".join(lines)


def validate_text(report: Report, report_dir: Path | None = None) -> str:
    """The acceptance table, the report's notes, the verdict, and where the report files are."""
    lines = [acceptance_text(report)]
    lines += [f"note: {n}" for n in report.notes]
    lines.append(f"verdict: {report.verdict.status.upper()}: " + "; ".join(report.verdict.reasons))
    if report_dir is not None:
        lines.append(f"report: {report_dir / 'report.md'}")
    return "\n".join(lines)
