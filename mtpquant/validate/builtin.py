"""``mtpquant validate``, the built-in path: what speculative decoding with the MTP will accept, before and after
quantization, replayed with the checkpoints' own weights (no engine).

For each prompt, the target model (main model of a checkpoint) extends the prompt greedily to
``max_len`` tokens; one more causal pass gives its post-final-norm hidden states ``h_t``. On that
sequence the engines' loop is replayed exactly (qwen-mtp.md, metrics.py):

1. the MTP layer runs over the accepted rows ``(h_j, x_{j+1})`` (its own KV cache), drafts ``d_1``
   from the last row, then chains: its own post-norm output and ``d_i`` at position + 1 give
   ``d_{i+1}`` (``mtpquant.mtp.drafting``: ``draft_chain``, batched over rows by ``draft_rows``);
2. greedy verification: the longest prefix of drafts equal to the target's own next tokens is
   accepted, plus one target token; the next step starts after it.

This is done for k = 1..K drafts per step (separate walks, since which positions get visited
depends on k), giving per-position acceptance, acceptance rate and mean acceptance length (AL).

Pair mode (REFERENCE CANDIDATE) also compares on identical inputs: the two MTP layers on the
reference target's hidden states and tokens (top-1 agreement, KL(ref || cand)), and the two target
models on the reference sequences. It splits the AL change into the MTP's part (candidate MTP on
the reference target) and the target's part. Single mode (CANDIDATE alone) reports acceptance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from mtpquant.errors import ValidateError
from mtpquant.measure.drafter import MtpBundle, load_mtp
from mtpquant.measure.hidden import load_hidden, save_hidden
from mtpquant.measure.replay import (
    AcceptanceResult,
    TargetRun,
    compare_main,
    compare_mtp,
    evaluate_acceptance,
)
from mtpquant.measure.target import capture, load_target, text_model_class
from mtpquant.measure.weights import CheckpointWeights
from mtpquant.public import public_checkpoint, public_file
from mtpquant.records.acceptance import Acceptance
from mtpquant.records.sampling import SamplingSettings
from mtpquant.records.validation import Comparison, MtpInfo, Side
from mtpquant.runtime.machine import compute_dtype, resolve_device
from mtpquant.text.prompts import (
    context_edges,
    plan_sequences,
    tokenize_prompts,
)
from mtpquant.validate.assemble import Measured, report_settings
from mtpquant.validate.options import ValidateOptions
from mtpquant.validate.preflight import Opened

__all__ = ["activation_caveats", "validate_builtin"]


def activation_caveats(activations: str, weights: Sequence[CheckpointWeights]) -> list[str]:
    """What the measurement does not model about the checkpoints' activations, for the verdict line: their inputs
    left full precision (``--activations off``) where the engines quantize them, or a format with no emulation
    (dynamic FP8 activations). Empty when the numbers are what the engines run."""
    static = sum(1 for w in weights for f in w.formats.values() if f.input_scale is not None)
    dynamic: dict[str, int] = {}
    for w in weights:
        for f in w.formats.values():
            # a kind the engines quantize dynamically without an input scale: not emulated here yet
            if f.input_scale is None and (what := f.kind.dynamic) is not None:
                dynamic[what] = dynamic.get(what, 0) + 1
    out = []
    if activations == "off" and static:
        out.append(f"activations NOT quantized (--activations off): the engines quantize the inputs of the {static} "
                   "Linears with input scales, so these ALs are optimistic")
    if dynamic:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(dynamic.items()))
        out.append(f"activations of {sum(dynamic.values())} Linears ({kinds}) not emulated: no emulation of this "
                   "format's dynamic activation quantization yet (the engines quantize them), so these ALs may be "
                   "optimistic")
    return out

log = logging.getLogger(__name__)


def _side(
    weights: CheckpointWeights,
    bundle: MtpBundle | None,
    error: str | None,
    run: TargetRun,
    by_sampling: Sequence[AcceptanceResult],
    target_source: str,
    level: float,
) -> Side:
    acceptance = by_sampling[0] if by_sampling else None
    return Side(
        checkpoint=public_checkpoint(weights.label),  # one path style in the report: a directory by its name
        family=weights.spec.family.key,
        precision=weights.precision_summary(),
        target_source=target_source,
        sequences=len(run.sequences),
        tokens=run.num_tokens,
        generated_tokens=run.generated_tokens,
        mtp=MtpInfo(
            present=bundle is not None,
            error=error,
            precision=bundle.precision if bundle else None,
            emulated_activations=tuple(bundle.emulated) if bundle else (),
        ),
        acceptance=acceptance.typed(level) if acceptance else None,
        non_finite_target=run.non_finite,
        non_finite_mtp=acceptance.non_finite if acceptance else 0,
        acceptance_by_sampling=tuple(a.typed(level) for a in by_sampling),
    )


Runs = dict[SamplingSettings, dict[str, TargetRun]]  # per sampling setting: "ref" (and "cand") target runs


def _targets(
    opts: ValidateOptions,
    prompts: tuple[list[str], str] | None,
    ref_w: CheckpointWeights,
    cand_w: CheckpointWeights | None,
    device: Any,
    dtype: Any,
) -> tuple[Runs, str, str, str, list[str], int]:
    """The target runs for every sampling setting (from a hidden-state file or the target models, each loaded once):
    runs, prompts, ref and cand sources, notes, and the ``max_len`` they were made with (a hidden file's own)."""
    notes: list[str] = []
    pair = cand_w is not None
    settings = opts.sampling_settings
    if opts.hidden is not None:
        loaded, meta = load_hidden(opts.hidden)
        runs: Runs = {}
        for s in settings:
            found = {group.split("@")[0]: run for group, run in loaded.items() if run.sampling == s}
            if "ref" not in found:
                have = sorted({run.sampling.label for run in loaded.values()})
                raise ValidateError(f"{opts.hidden}: no reference target run at {s.label} in the file (it has: "
                                    f"{'; '.join(have)})")  # fmt: skip
            runs[s] = found
        first = runs[settings[0]]["ref"]
        H = ref_w.spec.hidden_size
        got = int(first.sequences[0].hidden.shape[-1])
        if got != H:
            raise ValidateError(f"{opts.hidden}: hidden size {got} does not match {ref_w.label} ({H})")
        prompts_desc = str(meta.get("prompts", "from hidden file"))
        ref_src = f"hidden file {opts.hidden} ({first.source})"
        if pair and any("cand" not in by_side for by_side in runs.values()):
            for by_side in runs.values():
                by_side["cand"] = by_side["ref"]
            notes.append(
                "The hidden-state file holds only the reference target: the candidate MTP is evaluated on "
                "the reference target's hidden states (an MTP-only comparison)."
            )
            cand_src = ref_src + " (reference target)"
        else:
            cand_src = f"hidden file {opts.hidden} ({runs[settings[0]]['cand'].source})" if pair else ""
        return runs, prompts_desc, ref_src, cand_src, notes, int(meta.get("max_len", opts.max_len))
    vocab = int(ref_w.shape(ref_w.embed_name())[0])
    assert prompts is not None  # preflight read them (no --hidden file)
    texts, prompts_desc = prompts
    ids = tokenize_prompts(ref_w.ckpt.source, texts, vocab)  # the checkpoint's own tokenizer
    plan = plan_sequences(ids, opts.max_len, opts.context_buckets)
    if not plan:
        raise ValidateError(
            "no prompt is long enough"
            + (f" for the context buckets {', '.join(map(str, opts.context_buckets))}" if opts.context_buckets else "")
        )
    runs = {s: {} for s in settings}
    # the engine drafts k at its last steps as at every other and counts what its verification accepts past
    # max_tokens: the target continues k - 1 tokens past each request's end to verify them (``replay.replay_greedy``)
    lookahead = max(opts.k_values) - 1
    target = load_target(ref_w, device=device, dtype=dtype, activations=opts.activations)
    for s in settings:
        label = "reference" + (f" ({s.label})" if len(settings) > 1 else "")
        runs[s]["ref"] = capture(
            target, plan, label=label, progress=opts.progress, batch_size=opts.batch_size, sampling=s,
            lookahead=lookahead,
        )
    target.release()
    if cand_w is not None:
        target = load_target(cand_w, device=device, dtype=dtype, activations=opts.activations)
        for i, s in enumerate(settings):
            label = "candidate" + (f" ({s.label})" if len(settings) > 1 else "")
            runs[s]["cand"] = capture(
                target,
                plan,
                label=label,
                reference=runs[s]["ref"] if i == 0 else None,  # the main-model comparison: the headline setting
                progress=opts.progress,
                batch_size=opts.batch_size,
                sampling=s,
                lookahead=lookahead,
            )
        target.release()
    if opts.save_hidden is not None:
        save_hidden(
            opts.save_hidden,
            [(side, run) for by_side in runs.values() for side, run in by_side.items()],
            {"prompts": prompts_desc, "max_len": opts.max_len, "dtype": str(dtype), "device": str(device)},
        )
    return runs, prompts_desc, "model", "model" if pair else "", notes, opts.max_len


def validate_builtin(opts: ValidateOptions, opened: Opened) -> Measured:
    """The built-in path of ``validate``: replay on transformers with the checkpoints' own weights (``opened``:
    what ``preflight(opts)`` opened and checked)."""
    t_start = time.perf_counter()
    device = torch.device(resolve_device(opts.device))
    dtype = getattr(torch, compute_dtype(device.type, opts.dtype))
    assert opened.reference is not None  # preflight: the built-in path needs a checkpoint
    K = max(opts.k_values)
    ref_w = CheckpointWeights(opened.reference)
    cand_w = CheckpointWeights(opened.candidate) if opened.candidate is not None else None
    notes: list[str] = []
    caveats = activation_caveats(opts.activations, [w for w in (ref_w, cand_w) if w is not None])
    if opts.activations == "off":
        notes.append(
            "Activations were not quantized (--activations off): W4A4 checkpoints are evaluated with "
            "dequantized weights and full-precision activations, not as the engines run them (the default, "
            "--activations emulate, quantizes them)."
        )
    timing: dict[str, float] = {}

    # 0. the model code (transformers' model modules take seconds to import; timed apart from the work).
    t0 = time.perf_counter()
    if opts.hidden is None:
        text_model_class(ref_w)
    timing["imports_s"] = time.perf_counter() - t0

    # 1. target runs: from a hidden-state file or from the target models.
    t0 = time.perf_counter()
    runs, prompts_desc, ref_src, cand_src, target_notes, max_len = _targets(
        opts, opened.prompts, ref_w, cand_w, device, dtype
    )
    notes += target_notes
    timing["targets_s"] = time.perf_counter() - t0

    # 2. MTP layers and acceptance, per sampling setting (the first is the headline: comparisons and verdict).
    t0 = time.perf_counter()
    settings = opts.sampling_settings

    def evaluate(bundle: MtpBundle, run: TargetRun, head: torch.Tensor, label: str) -> AcceptanceResult:
        s = run.sampling
        return evaluate_acceptance(
            bundle,
            run,
            K,
            progress=opts.progress,
            label=label + (f" ({s.label})" if len(settings) > 1 else ""),
            sampling=s,
            rule=opts.rule,
            target_head=head,
            context_edges=context_edges(max_len, opts.context_buckets),
        )

    def measure_side(
        w: CheckpointWeights, key: str, label: str, src: str, ref_head: torch.Tensor | None
    ) -> tuple[MtpBundle | None, torch.Tensor, list[AcceptanceResult], Side]:
        """One side's MTP loaded and measured at every setting, verified by its own target's head (the reference's
        where its runs are the reference's: a hidden-state file of the reference target only)."""
        head = w.tensor(w.lm_head_name(), dtype)
        mtp, err = load_mtp(w, dtype=dtype, device=device, activations=opts.activations)
        verify = {s: ref_head if ref_head is not None and runs[s][key] is runs[s]["ref"] else head for s in settings}
        accs = [evaluate(mtp, runs[s][key], verify[s], label) for s in settings] if mtp else []
        return mtp, head, accs, _side(w, mtp, err, runs[settings[0]][key], accs, src, opts.confidence)

    ref_mtp, ref_head, ref_accs, reference = measure_side(ref_w, "ref", "reference", ref_src, None)
    candidate: Side | None = None
    comparison: Comparison | None = None
    extra: list[tuple[str, Acceptance, Acceptance, Acceptance | None]] = []
    mtp_kl = main_kl = None
    if cand_w is not None:
        headline = runs[settings[0]]
        cand_run = headline["cand"]
        cand_mtp, cand_head, cand_accs, candidate = measure_side(cand_w, "cand", "candidate", cand_src, ref_head)
        parts: dict[str, Any] = {}
        if ref_mtp is not None and cand_mtp is not None and ref_accs and cand_accs:
            mtp_cmp = compare_mtp(ref_mtp, cand_mtp, headline["ref"])
            mtp_kl = mtp_cmp.kl
            crosses = [
                evaluate(cand_mtp, runs[s]["ref"], ref_head, "candidate on reference target") for s in settings
            ]
            ref_acc, cand_acc, cross = ref_accs[0], cand_accs[0], crosses[0]
            ref_al = [s.mean_acceptance_length for s in ref_acc.by_k]
            cand_al = [s.mean_acceptance_length for s in cand_acc.by_k]
            cross_al = [s.mean_acceptance_length for s in cross.by_k]
            parts.update(
                mtp=mtp_cmp.typed(),
                candidate_mtp_on_reference_target=cross.typed(opts.confidence),
                al_delta_by_k=tuple(c - r for r, c in zip(ref_al, cand_al)),
                al_delta_from_mtp_by_k=tuple(x - r for r, x in zip(ref_al, cross_al)),
                al_delta_from_target_by_k=tuple(c - x for x, c in zip(cross_al, cand_al)),
                acceptance_delta_per_position=tuple(
                    c - r
                    for r, c in zip(
                        ref_acc.by_k[K - 1].acceptance_per_position, cand_acc.by_k[K - 1].acceptance_per_position
                    )
                ),
            )
            level = opts.confidence
            extra = [
                (s.label, r.typed(level), c.typed(level), x.typed(level))
                for s, r, c, x in list(zip(settings, ref_accs, cand_accs, crosses))[1:]
            ]
        if cand_run.hidden_on_ref is not None:
            main_cmp = compare_main(headline["ref"], ref_head, cand_run.hidden_on_ref, cand_head)
            main_kl = main_cmp.kl
            parts["main"] = main_cmp.typed()
        elif cand_run is headline["ref"]:
            parts["main_compared"] = False
            notes.append("Main-model comparison skipped: both pairs use the reference target from the hidden file.")
        comparison = Comparison(**parts)
    timing["mtp_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    distinct = {id(r): r for by_side in runs.values() for r in by_side.values()}
    evaluated = sum(r.num_tokens for r in distinct.values())
    timing["sequence_tokens"] = float(evaluated)
    work_s = timing["total_s"] - timing["imports_s"]
    timing["tokens_per_second"] = evaluated / work_s if work_s > 0 else 0.0
    hidden_file = public_file(str(opts.hidden)) if opts.hidden else None
    how = report_settings(
        opts,
        k=K,
        num_prompts=len(runs[settings[0]]["ref"].sequences),
        max_len=max_len,
        prompts=prompts_desc,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        activations=opts.activations,
        hidden_file=hidden_file,
    )
    return Measured(
        settings=how,
        reference=reference,
        candidate=candidate,
        comparison=comparison,
        notes=tuple(notes),
        timing=timing,
        extra=extra,
        mtp_kl=mtp_kl,
        main_kl=main_kl,
        caveats=tuple(caveats),
    )
