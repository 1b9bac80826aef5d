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
from datetime import datetime, timezone
from typing import Any

import torch
from tqdm.auto import tqdm

from mtpquant import __version__
from mtpquant.validate.hidden import load_hidden, save_hidden
from mtpquant.validate.load import (
    CheckpointWeights,
    MtpBundle,
    TargetModel,
    compute_dtype,
    load_mtp,
    load_target,
    resolve_device,
    text_model_class,
)
from mtpquant.validate.options import ValidateError, ValidateOptions
from mtpquant.validate.prompts import default_prompts, load_prompts, prompt_length, tokenize_prompts
from mtpquant.validate.replay import (
    AcceptanceResult,
    SequenceRecord,
    TargetRun,
    compare_main,
    compare_mtp,
    evaluate_acceptance,
    replay_greedy,
)
from mtpquant.validate.schema import Comparison, MtpInfo, Report, Settings, Side, ValidationReport
from mtpquant.validate.verdict import verdict

__all__ = [
    "SequenceRecord",
    "TargetRun",
    "ValidateError",
    "ValidateOptions",
    "ValidationReport",
    "evaluate_acceptance",
    "replay_greedy",
    "validate_builtin",
]

log = logging.getLogger(__name__)


def _tokenize(prompts: Sequence[str], weights: CheckpointWeights) -> list[list[int]]:
    """Token ids of each prompt with the checkpoint's own tokenizer (``tokenizer.json``)."""
    return tokenize_prompts(weights.ckpt.source, prompts, int(weights.shape(weights.embed_name())[0]))


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of equal ``lengths`` in chunks of at most ``batch_size``, in first-seen order (no padding: every
    row of a batch has the inputs it would have alone)."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return [g[j : j + batch_size] for g in groups.values() for j in range(0, len(g), batch_size)]


def capture(
    target: TargetModel,
    prompt_ids: Sequence[Sequence[int]],
    max_len: int,
    *,
    label: str,
    reference: TargetRun | None = None,
    progress: bool = True,
    batch_size: int = 16,
) -> TargetRun:
    """Greedy continuations and hidden states for each prompt (and over ``reference``'s sequences).

    Prompts of the same length are generated together, ``batch_size`` at a time (their continuations have the
    same length too, so nothing is padded or masked). The tokens are those of one prompt at a time; the hidden
    states are bit-identical on CPU for the dense family and within float rounding for MoE experts, whose GEMMs
    see more rows when batched (tests/test_validate.py); on GPU batched GEMMs may round differently too.
    """
    lengths = [prompt_length(len(ids), max_len) for ids in prompt_ids]
    records: list[SequenceRecord | None] = [None] * len(prompt_ids)
    with tqdm(total=len(prompt_ids), desc=f"target {label}", unit="prompt", disable=not progress) as bar:
        for batch in _batches(lengths, batch_size):
            p = lengths[batch[0]]
            prompt = torch.tensor([list(prompt_ids[i][:p]) for i in batch], dtype=torch.long)
            tokens = target.greedy(prompt, max_len - p).cpu()
            head, mtp_input = target.hidden_states(tokens)
            for row, i in enumerate(batch):
                extra = None if mtp_input is None else mtp_input[row].cpu().clone()
                records[i] = SequenceRecord(tokens[row].clone(), p, head[row].cpu().clone(), extra)
            bar.update(len(batch))
    seqs = [r for r in records if r is not None]
    on_ref = None
    if reference is not None:
        ref_seqs = reference.sequences
        hidden_on_ref: list[torch.Tensor | None] = [None] * len(ref_seqs)
        with tqdm(total=len(ref_seqs), desc=f"target {label} on reference", disable=not progress) as bar:
            for batch in _batches([len(s.tokens) for s in ref_seqs], batch_size):
                hidden = target.hidden(torch.stack([ref_seqs[i].tokens for i in batch])).cpu()
                for row, i in enumerate(batch):
                    hidden_on_ref[i] = hidden[row].clone()
                bar.update(len(batch))
        on_ref = [h for h in hidden_on_ref if h is not None]
    return TargetRun(label, seqs, on_ref)


def _release(target: TargetModel) -> None:
    """Free a target model's memory before the next one loads."""
    import gc

    target.model = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _side(
    weights: CheckpointWeights,
    bundle: MtpBundle | None,
    error: str | None,
    run: TargetRun,
    acceptance: AcceptanceResult | None,
    target_source: str,
) -> Side:
    return Side(
        checkpoint=weights.label,
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
        acceptance=acceptance.typed() if acceptance else None,
    )


def _targets(
    opts: ValidateOptions, ref_w: CheckpointWeights, cand_w: CheckpointWeights | None, device: Any, dtype: Any
) -> tuple[dict[str, TargetRun], str, str, str, list[str]]:
    """The target runs (from a hidden-state file or the target models): runs, prompts, ref and cand sources, notes."""
    notes: list[str] = []
    pair = cand_w is not None
    if opts.hidden is not None:
        runs, meta = load_hidden(opts.hidden)
        if "ref" not in runs:
            raise ValidateError(f"{opts.hidden}: no reference target run in the file")
        H = ref_w.spec.hidden_size
        got = int(runs["ref"].sequences[0].hidden.shape[-1])
        if got != H:
            raise ValidateError(f"{opts.hidden}: hidden size {got} does not match {ref_w.label} ({H})")
        prompts_desc = str(meta.get("prompts", "from hidden file"))
        ref_src = f"hidden file {opts.hidden} ({runs['ref'].source})"
        if pair and "cand" not in runs:
            runs["cand"] = runs["ref"]
            notes.append(
                "The hidden-state file holds only the reference target: the candidate MTP is evaluated on "
                "the reference target's hidden states (an MTP-only comparison)."
            )
            cand_src = ref_src + " (reference target)"
        else:
            cand_src = f"hidden file {opts.hidden} ({runs['cand'].source})" if pair else ""
        return runs, prompts_desc, ref_src, cand_src, notes
    if opts.prompts_file is not None:
        prompts = load_prompts(opts.prompts_file, opts.num_prompts)
        prompts_desc = str(opts.prompts_file)
    else:
        prompts = default_prompts(opts.num_prompts)
        prompts_desc = "default: held-out pydoc topics and stdlib source (mtpquant.validate.prompts)"
    ids = _tokenize(prompts, ref_w)
    if not ids:
        raise ValidateError("no prompt has at least 2 tokens")
    runs = {}
    target = load_target(ref_w, device=device, dtype=dtype, activations=opts.activations)
    runs["ref"] = capture(
        target, ids, opts.max_len, label="reference", progress=opts.progress, batch_size=opts.batch_size
    )
    _release(target)
    if cand_w is not None:
        target = load_target(cand_w, device=device, dtype=dtype, activations=opts.activations)
        runs["cand"] = capture(
            target,
            ids,
            opts.max_len,
            label="candidate",
            reference=runs["ref"],
            progress=opts.progress,
            batch_size=opts.batch_size,
        )
        _release(target)
    if opts.save_hidden is not None:
        save_hidden(
            opts.save_hidden,
            runs,
            {"prompts": prompts_desc, "max_len": opts.max_len, "dtype": str(dtype), "device": str(device)},
        )
    return runs, prompts_desc, "model", "model" if pair else "", notes


def validate_builtin(opts: ValidateOptions) -> ValidationReport:
    """The built-in path of ``validate``: replay on transformers with the checkpoints' own weights; writes the
    report directory when one is given."""
    opts.check()
    t_start = time.perf_counter()
    device = resolve_device(opts.device)
    dtype = compute_dtype(device, opts.dtype)
    assert opts.reference is not None  # opts.check(): the built-in path needs a checkpoint
    K = max(opts.k_values)
    ref_w = CheckpointWeights.open(opts.reference)
    cand_w = CheckpointWeights.open(opts.candidate) if opts.candidate is not None else None
    notes: list[str] = []
    if opts.activations == "off":
        notes.append(
            "Activations were not quantized (--activations off): W4A4 checkpoints are evaluated with "
            "dequantized weights and full-precision activations; use --activations emulate for W4A4."
        )
    timing: dict[str, float] = {}

    # 0. the model code (transformers' model modules take seconds to import; timed apart from the work).
    t0 = time.perf_counter()
    if opts.hidden is None:
        text_model_class(ref_w)
    timing["imports_s"] = time.perf_counter() - t0

    # 1. target runs: from a hidden-state file or from the target models.
    t0 = time.perf_counter()
    runs, prompts_desc, ref_src, cand_src, target_notes = _targets(opts, ref_w, cand_w, device, dtype)
    notes += target_notes
    timing["targets_s"] = time.perf_counter() - t0

    # 2. MTP layers and acceptance.
    t0 = time.perf_counter()
    ref_mtp, ref_err = load_mtp(ref_w, dtype=dtype, device=device, activations=opts.activations)
    ref_acc = (
        evaluate_acceptance(ref_mtp, runs["ref"], K, progress=opts.progress, label="reference") if ref_mtp else None
    )
    reference = _side(ref_w, ref_mtp, ref_err, runs["ref"], ref_acc, ref_src)
    candidate: Side | None = None
    comparison: Comparison | None = None
    mtp_kl = main_kl = None
    if cand_w is not None:
        cand_run = runs["cand"]
        cand_mtp, cand_err = load_mtp(cand_w, dtype=dtype, device=device, activations=opts.activations)
        cand_acc = (
            evaluate_acceptance(cand_mtp, cand_run, K, progress=opts.progress, label="candidate") if cand_mtp else None
        )
        candidate = _side(cand_w, cand_mtp, cand_err, cand_run, cand_acc, cand_src)
        parts: dict[str, Any] = {}
        if ref_mtp is not None and cand_mtp is not None and ref_acc is not None and cand_acc is not None:
            mtp_cmp = compare_mtp(ref_mtp, cand_mtp, runs["ref"])
            mtp_kl = mtp_cmp.kl
            cross = evaluate_acceptance(
                cand_mtp, runs["ref"], K, progress=opts.progress, label="candidate on reference target"
            )
            ref_al = [s.mean_acceptance_length for s in ref_acc.by_k]
            cand_al = [s.mean_acceptance_length for s in cand_acc.by_k]
            cross_al = [s.mean_acceptance_length for s in cross.by_k]
            parts.update(
                mtp=mtp_cmp.typed(),
                candidate_mtp_on_reference_target=cross.typed(),
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
        if cand_run.hidden_on_ref is not None:
            ref_head = ref_w.tensor(ref_w.lm_head_name(), dtype)
            cand_head = cand_w.tensor(cand_w.lm_head_name(), dtype)
            main_cmp = compare_main(runs["ref"], ref_head, cand_run.hidden_on_ref, cand_head)
            main_kl = main_cmp.kl
            parts["main"] = main_cmp.typed()
        elif cand_run is runs["ref"]:
            parts["main_compared"] = False
            notes.append("Main-model comparison skipped: both pairs use the reference target from the hidden file.")
        comparison = Comparison(**parts)
    timing["mtp_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    evaluated = sum(r.num_tokens for r in {id(r): r for r in runs.values()}.values())
    timing["sequence_tokens"] = float(evaluated)
    work_s = timing["total_s"] - timing["imports_s"]
    timing["tokens_per_second"] = evaluated / work_s if work_s > 0 else 0.0
    report = Report(
        mtpquant_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        mode="pair" if candidate is not None else "single",
        settings=Settings(
            k=K,
            num_prompts=len(runs["ref"].sequences),
            max_len=opts.max_len,
            prompts=prompts_desc,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            activations=opts.activations,
            hidden_file=str(opts.hidden) if opts.hidden else None,
            warn_al_drop=opts.warn_al_drop,
            broken_al=opts.broken_al,
        ),
        reference=reference,
        verdict=verdict(opts, reference, candidate),
        candidate=candidate,
        comparison=comparison,
        timing={k: round(v, 3) for k, v in timing.items()},
        notes=tuple(notes),
    )
    result = ValidationReport(report, mtp_kl, main_kl)
    if opts.report_dir is not None:
        from mtpquant.validate.report import write_report

        write_report(result, opts.report_dir)
    log.info("validate: %s (%s)", report.verdict.status, "; ".join(report.verdict.reasons))
    return result
