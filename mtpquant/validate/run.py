"""``mtpquant validate``: what speculative decoding with the MTP will accept, before and after quantization.

For each prompt, the target model (main model of a checkpoint) extends the prompt greedily to
``max_len`` tokens; one more causal pass gives its post-final-norm hidden states ``h_t``. On that
sequence the engines' loop is replayed exactly (qwen-mtp.md, metrics.py):

1. the MTP layer runs over the accepted rows ``(h_j, x_{j+1})`` (its own KV cache), drafts ``d_1``
   from the last row, then chains: its own post-norm output and ``d_i`` at position + 1 give
   ``d_{i+1}`` (``mtpquant.mtp.module.draft_chain``);
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

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mtpquant import __version__
from mtpquant.errors import ConfigError, UsageError
from mtpquant.mtp.module import KVCache, draft_chain, mtp_logits
from mtpquant.validate.load import (
    ACTIVATION_MODES,
    CheckpointWeights,
    MtpBundle,
    TargetModel,
    compute_dtype,
    load_mtp,
    load_target,
    resolve_device,
)
from mtpquant.validate.metrics import AcceptanceStats, StepRecord, acceptance_stats, summarize
from mtpquant.validate.prompts import default_prompts, load_prompts

__all__ = [
    "HIDDEN_FORMAT",
    "REPORT_SCHEMA",
    "AcceptanceResult",
    "SequenceRecord",
    "TargetRun",
    "ValidateOptions",
    "ValidationReport",
    "evaluate_acceptance",
    "load_hidden",
    "replay_greedy",
    "save_hidden",
    "validate",
]

log = logging.getLogger(__name__)

REPORT_SCHEMA = "mtpquant.validate/1"
HIDDEN_FORMAT = "mtpquant.hidden/1"
# Rows of [rows, vocab] logits computed at once (bounded memory for 248k-token vocabularies).
_LOGIT_CHUNK = 256


class ValidateError(UsageError):
    """Validation cannot run (bad options, mismatched hidden-state file, ...)."""


@dataclass(frozen=True)
class ValidateOptions:
    """Everything ``mtpquant validate`` does, as one frozen object (the CLI fills it)."""

    reference: Path | str  # single mode: the checkpoint to evaluate
    candidate: Path | str | None = None
    prompts_file: Path | None = None
    num_prompts: int = 32
    max_len: int = 128  # tokens per sequence: prompt (at most half) + greedy continuation
    k: int = 3
    report_dir: Path | None = None
    device: str = "auto"
    dtype: str | None = None  # float32 on CPU, bfloat16 on CUDA unless given
    activations: str = "off"  # off | emulate (W4A4: quantize Linear inputs with input_scale)
    save_hidden: Path | None = None
    hidden: Path | None = None
    warn_al_drop: float = 0.1
    broken_al: float = 1.02  # AL below this at k=1 means the MTP is broken (~0 % acceptance)
    progress: bool = True

    def check(self) -> None:
        """Reject impossible settings with one-line errors."""
        if self.k < 1:
            raise ValidateError(f"--k must be >= 1, got {self.k}")
        if self.max_len < 4:
            raise ValidateError(f"--max-len must be >= 4, got {self.max_len}")
        if self.num_prompts < 1:
            raise ValidateError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.activations not in ACTIVATION_MODES:
            raise ValidateError(f"--activations must be one of {', '.join(ACTIVATION_MODES)}")
        if self.hidden is not None and self.save_hidden is not None:
            raise ValidateError("--hidden and --save-hidden exclude each other")
        if self.warn_al_drop < 0:
            raise ValidateError("--warn-al-drop must be >= 0")


# ---- sequences and hidden states --------------------------------------------------------------------
@dataclass
class SequenceRecord:
    """One evaluated sequence: prompt + the target's greedy continuation, and its hidden states."""

    tokens: Tensor  # int64 [T]
    prompt_len: int
    hidden: Tensor  # [T, H], post-final-norm


@dataclass
class TargetRun:
    """A target model's sequences (and, for a candidate, its hidden states over the reference's)."""

    source: str
    sequences: list[SequenceRecord]
    hidden_on_ref: list[Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return sum(int(s.tokens.numel()) for s in self.sequences)

    @property
    def generated_tokens(self) -> int:
        """Tokens the target generated (continuations)."""
        return sum(int(s.tokens.numel()) - s.prompt_len for s in self.sequences)


def _tokenize(path: Path | str, prompts: Sequence[str], weights: CheckpointWeights) -> list[list[int]]:
    """Token ids of each prompt with the checkpoint's own tokenizer (``tokenizer.json``)."""
    source = weights.ckpt.source
    if "tokenizer.json" not in source.list_files():
        raise ConfigError(f"{weights.label}: tokenizer.json is missing (validate needs the model's tokenizer)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(source.read_range("tokenizer.json", 0, source.file_size("tokenizer.json")).decode())
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    vocab = int(weights.shape(weights.embed_name())[0])
    for row in ids:
        if row and max(row) >= vocab:
            raise ConfigError(f"{path}: tokenizer produces id {max(row)} >= vocab size {vocab}")
    return [row for row in ids if len(row) >= 2]


def capture(
    target: TargetModel,
    prompt_ids: Sequence[Sequence[int]],
    max_len: int,
    *,
    label: str,
    reference: TargetRun | None = None,
    progress: bool = True,
) -> TargetRun:
    """Greedy continuations and hidden states for each prompt (and over ``reference``'s sequences)."""
    seqs: list[SequenceRecord] = []
    for ids in tqdm(prompt_ids, desc=f"target {label}", unit="prompt", disable=not progress):
        p = max(1, min(len(ids), max_len // 2))
        prompt = torch.tensor([list(ids[:p])], dtype=torch.long)
        tokens = target.greedy(prompt, max_len - p)
        hidden = target.hidden(tokens)[0].cpu()
        seqs.append(SequenceRecord(tokens[0].cpu(), p, hidden))
    on_ref = None
    if reference is not None:
        on_ref = [
            target.hidden(s.tokens[None])[0].cpu()
            for s in tqdm(reference.sequences, desc=f"target {label} on reference", disable=not progress)
        ]
    return TargetRun(label, seqs, on_ref)


def save_hidden(path: Path, runs: dict[str, TargetRun], meta: dict[str, Any]) -> None:
    """Write target runs (``ref``, optionally ``cand``) to a safetensors file, atomically."""
    import os
    import uuid

    from mtpquant.checkpoint.dtypes import planned
    from mtpquant.checkpoint.writer import write_safetensors

    tensors = []
    info: dict[str, Any] = {}
    for group, run in runs.items():
        info[group] = {"source": run.source, "prompt_lens": [s.prompt_len for s in run.sequences]}
        for i, s in enumerate(run.sequences):
            tensors.append(planned(f"{group}.tokens.{i:05d}", s.tokens.contiguous()))
            tensors.append(planned(f"{group}.hidden.{i:05d}", s.hidden.contiguous()))
        for i, h in enumerate(run.hidden_on_ref or []):
            tensors.append(planned(f"{group}.hidden_on_ref.{i:05d}", h.contiguous()))
    metadata = {"format": HIDDEN_FORMAT, "groups": json.dumps(info), "meta": json.dumps(meta)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("saved hidden states of %s to %s", ", ".join(runs), path)


def load_hidden(path: Path) -> tuple[dict[str, TargetRun], dict[str, Any]]:
    """Read a file written by :func:`save_hidden`: runs by group and the capture metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        md = fh.metadata() or {}
        if md.get("format") != HIDDEN_FORMAT:
            raise ValidateError(f"{path}: not an mtpquant hidden-state file (format {md.get('format')!r})")
        info = json.loads(md["groups"])
        runs: dict[str, TargetRun] = {}
        keys = set(fh.keys())
        for group, g in info.items():
            seqs = [
                SequenceRecord(
                    fh.get_tensor(f"{group}.tokens.{i:05d}"), int(p), fh.get_tensor(f"{group}.hidden.{i:05d}")
                )
                for i, p in enumerate(g["prompt_lens"])
            ]
            on_ref = None
            if f"{group}.hidden_on_ref.00000" in keys:
                on_ref = [fh.get_tensor(f"{group}.hidden_on_ref.{i:05d}") for i in range(len(seqs))]
            runs[group] = TargetRun(str(g["source"]), seqs, on_ref)
    return runs, json.loads(md.get("meta", "{}"))


# ---- MTP evaluation -----------------------------------------------------------------------------
@dataclass
class AcceptanceResult:
    """Acceptance of one (target, MTP) pair for k = 1..K, plus teacher-forced agreement."""

    by_k: list[AcceptanceStats]
    teacher_forced_agreement: float  # MTP argmax at row t == target's token t+2, over continuations
    steps_by_k: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form (see docs/validate.md)."""
        return {
            "teacher_forced_agreement": self.teacher_forced_agreement,
            "by_k": [{"k": k, **_stats_json(s)} for k, s in enumerate(self.by_k, 1)],
        }


def _stats_json(s: AcceptanceStats) -> dict[str, Any]:
    d = asdict(s)
    d["drafted_per_position"] = list(s.drafted_per_position)
    d["accepted_per_position"] = list(s.accepted_per_position)
    d["acceptance_per_position"] = list(s.acceptance_per_position)
    return d


def _tf_pass(bundle: MtpBundle, seq: SequenceRecord, hidden: Tensor | None = None) -> tuple[Tensor, KVCache]:
    """Teacher-forced MTP rows 0..T-2: post-norm outputs ``[1, T-1, H]`` and the layer's cache."""
    device = bundle.embed_weight.device
    h = (seq.hidden if hidden is None else hidden)[None, :-1].to(device)
    x = seq.tokens[None, 1:].to(device)
    with torch.no_grad():
        return bundle.layer(h, bundle.embed(x))


def _chunked_logits(out: Tensor, head: Tensor) -> list[Tensor]:
    rows = out.reshape(-1, out.shape[-1])
    return [mtp_logits(rows[i : i + _LOGIT_CHUNK], head).float() for i in range(0, rows.shape[0], _LOGIT_CHUNK)]


def replay_greedy(
    tokens: Sequence[int], prompt_len: int, k: int, drafts: Callable[[int, int], Sequence[int]]
) -> list[StepRecord]:
    """Speculative decoding with greedy verification over a target's greedy sequence ``tokens``.

    ``tokens[:prompt_len]`` is the prompt, the rest the target's own greedy continuation (so the
    target's choice at every position is known). ``drafts(t, n)`` returns the MTP's first n drafts
    made from row t, i.e. from ``(h_t, tokens[t+1])``; draft i (1-based) proposes ``tokens[t+1+i]``.
    The first step drafts from the last prompt row (the target has just produced
    ``tokens[prompt_len]``); after accepting a drafts the target adds one token, so the next step
    drafts from row ``t + a + 1``. The last steps draft fewer tokens when fewer remain to verify.
    """
    if k < 1 or prompt_len < 1:
        raise ValueError(f"k and prompt_len must be >= 1, got {k} and {prompt_len}")
    records: list[StepRecord] = []
    T = len(tokens)
    t = prompt_len - 1
    while True:
        remaining = T - t - 2  # tokens after tokens[t+1] that the target can verify
        if remaining < 1:
            break
        n = min(k, remaining)
        d = drafts(t, n)
        accepted = 0
        while accepted < n and d[accepted] == tokens[t + 2 + accepted]:
            accepted += 1
        records.append(StepRecord(n, accepted))
        t += accepted + 1
    return records


def evaluate_acceptance(
    bundle: MtpBundle, run: TargetRun, k_max: int, *, progress: bool = True, label: str = ""
) -> AcceptanceResult:
    """Replay speculative decoding with greedy verification on every sequence, for k = 1..k_max."""
    records: list[list[StepRecord]] = [[] for _ in range(k_max)]
    tf_hits = tf_total = 0
    device = bundle.embed_weight.device
    for seq in tqdm(run.sequences, desc=f"MTP {label}".rstrip(), unit="seq", disable=not progress):
        tokens = seq.tokens.tolist()
        T, P = len(tokens), seq.prompt_len
        if T - P < 2:
            continue
        out, cache = _tf_pass(bundle, seq)
        # Teacher-forced agreement over the continuation: row t predicts token t+2.
        rows = slice(P - 1, T - 2)
        tf_pred = mtp_logits(out[0, rows], bundle.lm_head_weight).argmax(-1).cpu()
        tf_hits += int((tf_pred == seq.tokens[P + 1 : T]).sum())
        tf_total += int(tf_pred.numel())

        chains: dict[int, list[int]] = {}

        def drafts(
            t: int, n: int, seq: SequenceRecord = seq, cache: KVCache = cache, chains: dict[int, list[int]] = chains
        ) -> list[int]:
            if t not in chains:
                past = KVCache(cache.key[:, :, :t], cache.value[:, :, :t]) if t > 0 else None
                res = draft_chain(
                    bundle.layer,
                    seq.hidden[None, t : t + 1].to(device),
                    seq.tokens[None, t + 1 : t + 2].to(device),
                    bundle.embed,
                    bundle.lm_head_weight,
                    k_max,
                    past_kv=past,
                )
                chains[t] = res.tokens[0].tolist()
            return chains[t][:n]

        for k in range(1, k_max + 1):
            records[k - 1].extend(replay_greedy(tokens, P, k, drafts))
    if not records[0]:
        raise ValidateError("no sequence long enough to draft on (raise --max-len)")
    return AcceptanceResult(
        by_k=[acceptance_stats(r) for r in records],
        teacher_forced_agreement=tf_hits / max(1, tf_total),
        steps_by_k=[len(r) for r in records],
    )


@dataclass
class Comparison:
    """Candidate vs reference logits at identical positions."""

    positions: int
    top1_agreement: float
    kl: Tensor  # per position, float64

    def to_json(self) -> dict[str, Any]:
        """JSON form: positions, top-1 agreement, KL summary (mean/median/p99/max)."""
        s = summarize(self.kl) if self.kl.numel() else None
        return {
            "positions": self.positions,
            "top1_agreement": self.top1_agreement,
            "kl": None
            if s is None
            else {"mean": s.mean, "median": s.median, "p99": s.p99, "max": float(self.kl.max())},
        }


def _compare_rows(ref_chunks: list[Tensor], cand_chunks: list[Tensor]) -> tuple[int, int, list[Tensor]]:
    same = total = 0
    kls: list[Tensor] = []
    for r, c in zip(ref_chunks, cand_chunks):
        logp = torch.log_softmax(r.double(), -1)
        logq = torch.log_softmax(c.double(), -1)
        p = logp.exp()
        kls.append(torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1).cpu())
        same += int((r.argmax(-1) == c.argmax(-1)).sum())
        total += int(r.shape[0])
    return same, total, kls


def compare_mtp(ref: MtpBundle, cand: MtpBundle, run: TargetRun) -> Comparison:
    """Both MTP layers, teacher-forced on the same (reference) hidden states and tokens."""
    same = total = 0
    kls: list[Tensor] = []
    for seq in run.sequences:
        out_r, _ = _tf_pass(ref, seq)
        out_c, _ = _tf_pass(cand, seq)
        s, t, k = _compare_rows(_chunked_logits(out_r, ref.lm_head_weight), _chunked_logits(out_c, cand.lm_head_weight))
        same, total, kls = same + s, total + t, kls + k
    return Comparison(total, same / max(1, total), torch.cat(kls) if kls else torch.zeros(0, dtype=torch.float64))


def compare_main(ref_run: TargetRun, ref_head: Tensor, cand_hidden: Sequence[Tensor], cand_head: Tensor) -> Comparison:
    """Both targets' next-token logits over the reference sequences."""
    same = total = 0
    kls: list[Tensor] = []
    for seq, hc in zip(ref_run.sequences, cand_hidden):
        s, t, k = _compare_rows(_chunked_logits(seq.hidden, ref_head), _chunked_logits(hc, cand_head))
        same, total, kls = same + s, total + t, kls + k
    return Comparison(total, same / max(1, total), torch.cat(kls) if kls else torch.zeros(0, dtype=torch.float64))


# ---- the report -----------------------------------------------------------------------------------
@dataclass
class ValidationReport:
    """The outcome: a JSON-able dict (schema in docs/validate.md) plus per-position KL for plots."""

    data: dict[str, Any]
    mtp_kl: Tensor | None = None
    main_kl: Tensor | None = None

    @property
    def status(self) -> str:
        """``pass``, ``warn`` or ``fail``."""
        return str(self.data["verdict"]["status"])

    def to_json(self) -> dict[str, Any]:
        """The report as written to report.json."""
        return self.data


def _verdict(opts: ValidateOptions, data: dict[str, Any]) -> dict[str, Any]:
    reasons: list[str] = []
    status = "pass"
    pair = data["mode"] == "pair"
    subject = data["candidate"] if pair else data["reference"]
    name = "candidate" if pair else "checkpoint"
    if pair and data["reference"]["mtp"]["error"]:
        return {"status": "fail", "reasons": [f"reference: {data['reference']['mtp']['error']}"]}
    if subject["mtp"]["error"]:
        return {"status": "fail", "reasons": [f"{name}: {subject['mtp']['error']}"]}
    al = [row["mean_acceptance_length"] for row in subject["acceptance"]["by_k"]]
    if al[0] < opts.broken_al:
        status = "fail"
        reasons.append(
            f"{name} MTP is broken: AL {al[0]:.3f} at k=1 (acceptance {100 * (al[0] - 1):.1f} %); engines will "
            "draft for nothing and decode slower"
        )
    if pair:
        ref_al = [row["mean_acceptance_length"] for row in data["reference"]["acceptance"]["by_k"]]
        drops = [(k, r - c) for k, (r, c) in enumerate(zip(ref_al, al), 1)]
        worst = max(drops, key=lambda kd: kd[1])
        if worst[1] > opts.warn_al_drop:
            status = "fail" if status == "fail" else "warn"
            reasons.append(
                f"AL drops by {worst[1]:.3f} at k={worst[0]} ({ref_al[worst[0] - 1]:.3f} -> "
                f"{al[worst[0] - 1]:.3f}), more than {opts.warn_al_drop}"
            )
    if not reasons:
        reasons.append(
            f"AL {' / '.join(f'{a:.2f}' for a in al)} for k = 1..{len(al)}"
            + ("; within the allowed drop" if pair else "")
        )
    return {"status": status, "reasons": reasons}


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
) -> dict[str, Any]:
    return {
        "checkpoint": weights.label,
        "family": weights.spec.family.key,
        "precision": weights.precision_summary(),
        "target_source": target_source,
        "sequences": len(run.sequences),
        "tokens": run.num_tokens,
        "generated_tokens": run.generated_tokens,
        "mtp": {
            "present": bundle is not None,
            "error": error,
            "precision": bundle.precision if bundle else None,
            "emulated_activations": bundle.emulated if bundle else [],
        },
        "acceptance": acceptance.to_json() if acceptance else None,
    }


def validate(opts: ValidateOptions) -> ValidationReport:
    """Run the evaluation described by ``opts``; writes the report directory when one is given."""
    opts.check()
    t_start = time.perf_counter()
    device = resolve_device(opts.device)
    dtype = compute_dtype(device, opts.dtype)
    pair = opts.candidate is not None
    ref_w = CheckpointWeights.open(opts.reference)
    cand_w = CheckpointWeights.open(opts.candidate) if opts.candidate is not None else None
    notes: list[str] = []
    if opts.activations == "off":
        notes.append(
            "Activations were not quantized (--activations off): W4A4 checkpoints are evaluated with "
            "dequantized weights and full-precision activations; use --activations emulate for W4A4."
        )
    timing: dict[str, float] = {}

    # 1. target runs: from a hidden-state file or from the target models.
    t0 = time.perf_counter()
    runs: dict[str, TargetRun]
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
    else:
        if opts.prompts_file is not None:
            prompts = load_prompts(opts.prompts_file, opts.num_prompts)
            prompts_desc = str(opts.prompts_file)
        else:
            prompts = default_prompts(opts.num_prompts)
            prompts_desc = "default: held-out pydoc topics and stdlib source (mtpquant.validate.prompts)"
        ids = _tokenize(opts.reference, prompts, ref_w)
        if not ids:
            raise ValidateError("no prompt has at least 2 tokens")
        runs = {}
        target = load_target(ref_w, device=device, dtype=dtype, activations=opts.activations)
        runs["ref"] = capture(target, ids, opts.max_len, label="reference", progress=opts.progress)
        _release(target)
        ref_src = "model"
        cand_src = "model" if pair else ""
        if cand_w is not None:
            target = load_target(cand_w, device=device, dtype=dtype, activations=opts.activations)
            runs["cand"] = capture(
                target, ids, opts.max_len, label="candidate", reference=runs["ref"], progress=opts.progress
            )
            _release(target)
        if opts.save_hidden is not None:
            save_hidden(
                opts.save_hidden,
                runs,
                {"prompts": prompts_desc, "max_len": opts.max_len, "dtype": str(dtype), "device": str(device)},
            )
    timing["targets_s"] = time.perf_counter() - t0

    # 2. MTP layers and acceptance.
    t0 = time.perf_counter()
    ref_mtp, ref_err = load_mtp(ref_w, dtype=dtype, device=device, activations=opts.activations)
    ref_acc = (
        evaluate_acceptance(ref_mtp, runs["ref"], opts.k, progress=opts.progress, label="reference")
        if ref_mtp
        else None
    )
    data: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "mtpquant_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "pair" if pair else "single",
        "settings": {
            "k": opts.k,
            "num_prompts": len(runs["ref"].sequences),
            "max_len": opts.max_len,
            "prompts": prompts_desc,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "activations": opts.activations,
            "hidden_file": str(opts.hidden) if opts.hidden else None,
            "warn_al_drop": opts.warn_al_drop,
            "broken_al": opts.broken_al,
        },
        "reference": _side(ref_w, ref_mtp, ref_err, runs["ref"], ref_acc, ref_src),
    }
    report = ValidationReport(data)
    if cand_w is not None:
        cand_run = runs["cand"]
        cand_mtp, cand_err = load_mtp(cand_w, dtype=dtype, device=device, activations=opts.activations)
        cand_acc = (
            evaluate_acceptance(cand_mtp, cand_run, opts.k, progress=opts.progress, label="candidate")
            if cand_mtp
            else None
        )
        data["candidate"] = _side(cand_w, cand_mtp, cand_err, cand_run, cand_acc, cand_src)
        comparison: dict[str, Any] = {}
        if ref_mtp is not None and cand_mtp is not None and ref_acc is not None and cand_acc is not None:
            mtp_cmp = compare_mtp(ref_mtp, cand_mtp, runs["ref"])
            report.mtp_kl = mtp_cmp.kl
            cross = evaluate_acceptance(
                cand_mtp, runs["ref"], opts.k, progress=opts.progress, label="candidate on reference target"
            )
            ref_al = [s.mean_acceptance_length for s in ref_acc.by_k]
            cand_al = [s.mean_acceptance_length for s in cand_acc.by_k]
            cross_al = [s.mean_acceptance_length for s in cross.by_k]
            comparison["mtp"] = mtp_cmp.to_json()
            comparison["candidate_mtp_on_reference_target"] = cross.to_json()
            comparison["al_delta_by_k"] = [c - r for r, c in zip(ref_al, cand_al)]
            comparison["al_delta_from_mtp_by_k"] = [x - r for r, x in zip(ref_al, cross_al)]
            comparison["al_delta_from_target_by_k"] = [c - x for x, c in zip(cross_al, cand_al)]
            K = opts.k
            comparison["acceptance_delta_per_position"] = [
                c - r
                for r, c in zip(
                    ref_acc.by_k[K - 1].acceptance_per_position, cand_acc.by_k[K - 1].acceptance_per_position
                )
            ]
        if cand_run.hidden_on_ref is not None:
            ref_head = ref_w.tensor(ref_w.lm_head_name(), dtype)
            cand_head = cand_w.tensor(cand_w.lm_head_name(), dtype)
            main_cmp = compare_main(runs["ref"], ref_head, cand_run.hidden_on_ref, cand_head)
            report.main_kl = main_cmp.kl
            comparison["main"] = main_cmp.to_json()
        elif cand_run is runs["ref"]:
            comparison["main"] = None
            notes.append("Main-model comparison skipped: both pairs use the reference target from the hidden file.")
        data["comparison"] = comparison
    timing["mtp_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    evaluated = sum(r.num_tokens for r in {id(r): r for r in runs.values()}.values())
    timing["sequence_tokens"] = float(evaluated)
    timing["tokens_per_second"] = evaluated / timing["total_s"] if timing["total_s"] > 0 else 0.0
    data["timing"] = {k: round(v, 3) for k, v in timing.items()}
    data["notes"] = notes
    data["verdict"] = _verdict(opts, data)
    if opts.report_dir is not None:
        from mtpquant.validate.report import write_report

        write_report(report, opts.report_dir)
    log.info("validate: %s (%s)", data["verdict"]["status"], "; ".join(data["verdict"]["reasons"]))
    return report
