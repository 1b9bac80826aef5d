"""Greedy speculative decoding replayed exactly as the engines run it, and comparisons on identical inputs.

A target's greedy sequences (``TargetRun``) come from ``target.capture`` or a hidden-state file
(``hidden``). On them the MTP layer drafts with its own KV cache, chaining for k > 1
(``mtpquant.mtp.drafting.draft_rows``: the engines' chain from every row, batched over rows), and greedy
verification accepts the longest matching prefix plus one target token (``replay_greedy``). ``compare_mtp`` /
``compare_main`` put two models' logits side by side at identical positions, with the tested metrics of
``metrics.py`` (KL, top-1 agreement).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mtpquant.errors import ReplayError
from mtpquant.measure.drafter import MtpBundle
from mtpquant.measure.metrics import (
    StepRecord,
    acceptance_stats,
    context_buckets,
    kl_per_position,
    summarize,
    token_agreement,
    unit_counts,
)
from mtpquant.measure.rules import target_probs, terms
from mtpquant.mtp.drafting import chain_logits, draft_rows, mtp_logits, step_head
from mtpquant.mtp.step import MtpStep
from mtpquant.records.acceptance import Acceptance, AcceptanceRow, AcceptanceStats, ContextBucket
from mtpquant.records.evidence import CONFIDENCE, Bootstrap, UnitCounts
from mtpquant.records.sampling import SamplingSettings
from mtpquant.records.validation import Agreement, KlSummary

__all__ = [
    "AcceptanceResult",
    "LogitAgreement",
    "SequenceRecord",
    "TargetRun",
    "compare_main",
    "compare_mtp",
    "evaluate_acceptance",
    "replay_greedy",
    "walk",
]

# Rows of [rows, vocab] logits computed at once (bounded memory for 248k-token vocabularies).
_LOGIT_CHUNK = 256


# ---- sequences and hidden states --------------------------------------------------------------------
@dataclass
class SequenceRecord:
    """One evaluated sequence: prompt + the target's greedy continuation, and its hidden states."""

    tokens: Tensor  # int64 [T]
    prompt_len: int
    hidden: Tensor  # [T, H], what the target's lm_head reads (post-final-norm)
    # [T, *] what the MTP reads where that is another tensor (Qwen4-Exp: the multi-stream state before the final
    # hyper-connection mixer, [T, hc_count * H]); None: ``hidden``
    mtp_input: Tensor | None = None
    # where the engine's request ends (prompt + max_tokens); the tokens after it are the target's lookahead, which
    # verifies the full k drafts the engine still makes at its last steps. None: the sequence's length (no lookahead)
    end: int | None = None

    @property
    def length(self) -> int:
        """The sequence as the engine's request produces it (prompt + max_tokens), lookahead excluded."""
        return int(self.tokens.numel()) if self.end is None else self.end

    @property
    def mtp_hidden(self) -> Tensor:
        """The MTP's hidden input at every position."""
        return self.hidden if self.mtp_input is None else self.mtp_input


@dataclass
class TargetRun:
    """A target model's sequences (and, for a candidate, its hidden states over the reference's)."""

    source: str
    sequences: list[SequenceRecord]
    hidden_on_ref: list[Tensor] | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)  # how the target produced the sequences

    @property
    def non_finite(self) -> int:
        """Positions whose hidden states hold a NaN or an infinity (their logits are not finite either)."""
        return sum(int((~torch.isfinite(s.hidden)).any(dim=-1).sum()) for s in self.sequences)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return sum(s.length for s in self.sequences)

    @property
    def generated_tokens(self) -> int:
        """Tokens the target generated (continuations)."""
        return sum(s.length - s.prompt_len for s in self.sequences)


# ---- MTP evaluation -----------------------------------------------------------------------------
@dataclass
class AcceptanceResult:
    """Acceptance of one (target, MTP) pair for k = 1..K, plus teacher-forced agreement."""

    by_k: list[AcceptanceStats]
    teacher_forced_agreement: float  # MTP argmax at row t == target's token t+2, over continuations
    steps_by_k: list[int] = field(default_factory=list)
    units: list[UnitCounts] = field(default_factory=list)  # per k: the counts of each sequence (prompt)
    non_finite: int = 0  # teacher-forced MTP rows whose output was not finite
    sampling: SamplingSettings | None = None  # how the target's sequences were sampled (None: greedy)
    rule: str = "vllm"
    by_context: list[tuple[ContextBucket, ...]] = field(default_factory=list)  # per k

    def typed(self, level: float = CONFIDENCE) -> Acceptance:
        """The report's ``Acceptance``, with AL's bootstrap interval (at ``level``) over the prompts per k."""
        rows = []
        for k, stats in enumerate(self.by_k, 1):
            units = self.units[k - 1] if len(self.units) >= k else None
            interval = Bootstrap(units.units, level=level).al(units) if units is not None else None
            context = self.by_context[k - 1] if len(self.by_context) >= k else ()
            rows.append(AcceptanceRow.of(k, stats, units, interval, context))
        return Acceptance(tuple(rows), self.teacher_forced_agreement, self.sampling or SamplingSettings(), self.rule)


def _tf_pass(bundle: MtpBundle, seq: SequenceRecord) -> MtpStep:
    """Teacher-forced MTP rows 0..T-2 (outputs ``[1, T-1, H]``, the layer's cache)."""
    device = bundle.embed_weight.device
    h = seq.mtp_hidden[None, :-1].to(device)
    x = seq.tokens[None, 1:].to(device)
    with torch.no_grad():
        return bundle.layer.step(h, bundle.embed(x))


def _chunked_logits(out: Tensor, head: Tensor) -> list[Tensor]:
    rows = out.reshape(-1, out.shape[-1])
    return [mtp_logits(rows[i : i + _LOGIT_CHUNK], head).float() for i in range(0, rows.shape[0], _LOGIT_CHUNK)]


def replay_greedy(
    tokens: Sequence[int], prompt_len: int, k: int, drafts: Callable[[int, int], Sequence[int]], end: int | None = None
) -> list[StepRecord]:
    """Speculative decoding with greedy verification over a target's greedy sequence ``tokens``.

    ``tokens[:prompt_len]`` is the prompt, the rest the target's own greedy continuation (so the
    target's choice at every position is known). ``drafts(t, n)`` returns the MTP's first n drafts
    made from row t, i.e. from ``(h_t, tokens[t+1])``; draft i (1-based) proposes ``tokens[t+1+i]``.
    The first step drafts from the last prompt row (the target has just produced
    ``tokens[prompt_len]``); after accepting a drafts the target adds one token, so the next step
    drafts from row ``t + a + 1``. Steps run while the request has produced fewer than ``end`` tokens (default: all of
    ``tokens``), as the engine stops at ``max_tokens``; each drafts k, as vLLM drafts at its last steps too (it does
    not shorten the draft to the tokens left, and counts what its verification accepts before the output is cut),
    verified by the tokens after ``end`` (the target's lookahead); with fewer than k left to verify, it drafts fewer.
    """
    if k < 1 or prompt_len < 1:
        raise ValueError(f"k and prompt_len must be >= 1, got {k} and {prompt_len}")
    records: list[StepRecord] = []
    T = len(tokens)
    stop = T if end is None else end
    t = prompt_len - 1
    while True:
        if stop - t - 2 < 1:  # the request has its max_tokens
            break
        n = min(k, T - t - 2)  # tokens after tokens[t+1] that the target can verify
        d = drafts(t, n)
        accepted = 0
        while accepted < n and d[accepted] == tokens[t + 2 + accepted]:
            accepted += 1
        records.append(StepRecord(n, accepted, context=t + 2))
        t += accepted + 1
    return records


def walk(
    length: int, prompt_len: int, k: int, expected: Tensor, posterior: Tensor, generator: torch.Generator,
    verifiable: int | None = None,
) -> list[StepRecord]:
    """Speculative decoding along a sequence sampled from the target, under a sampling rule (``rules.terms``).

    ``expected[t - (prompt_len - 1), j]`` / ``posterior[...]``: for the step drafting from row t, the probability that
    draft j + 1 is accepted (given drafts 1..j were) and the probability that it was accepted given the token the
    sequence has there. Each step records, per drafted position i, the expected all-accepted-through-i
    (prod_{j<i} posterior_j * expected_i); where the next step starts follows acceptances drawn with the posterior
    probabilities (coins of probability 0 or 1 for the ``vllm`` rule, so no draw is random there), the walk the
    engine takes on this sequence. Steps as in ``replay_greedy`` (``length`` its ``end``; ``verifiable``: the tokens
    the terms cover, lookahead included, default ``length``).
    """
    if k < 1 or prompt_len < 1:
        raise ValueError(f"k and prompt_len must be >= 1, got {k} and {prompt_len}")
    records: list[StepRecord] = []
    first = prompt_len - 1
    exp, post = expected.tolist(), posterior.tolist()
    t = first
    available = length if verifiable is None else verifiable
    while length - t - 2 >= 1:
        n = min(k, available - t - 2)
        e, w = exp[t - first], post[t - first]
        through, carried = [], 1.0
        for j in range(n):
            through.append(carried * e[j])
            carried *= w[j]
        accepted = 0
        while accepted < n:
            chance = w[accepted]
            if chance < 1.0 and (chance <= 0.0 or float(torch.rand(1, generator=generator)) >= chance):
                break
            accepted += 1
        records.append(StepRecord(n, accepted, tuple(through), context=t + 2))
        t += accepted + 1
    return records


def _logit_chunk(k: int, vocab: int) -> int:
    """Rows per chunk when k steps of full-vocabulary distributions are held at once (about 64 MB of them)."""
    return max(1, min(64, (1 << 24) // max(1, k * vocab)))


def _sampled_terms(
    bundle: MtpBundle,
    seq: SequenceRecord,
    teacher: MtpStep,
    rows: range,
    k: int,
    sampling: SamplingSettings,
    rule: str,
    target_head: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``rows`` and chain step: expected acceptance, posterior acceptance and the MTP's argmax
    (``rules.terms``), from the MTP chain fed the sequence's tokens and the target's distributions along it."""
    device = bundle.embed_weight.device
    tokens = seq.tokens.to(device)
    T = tokens.shape[0]
    expected, posterior, drafts = [], [], []
    head = target_head.to(device)
    chunk = _logit_chunk(k, int(head.shape[0]))
    for t, q_logits in chain_logits(
        bundle.layer, teacher, rows, bundle.embed, bundle.lm_head_weight, k, feed=tokens, chunk=chunk
    ):
        steps = torch.arange(1, k + 1, device=device)
        at = (t[:, None] + steps[None, :]).clamp_max(T - 2)  # target row whose distribution verifies draft j
        p = target_probs(mtp_logits(seq.hidden.to(device)[at], head), sampling)
        x = tokens[at + 1]
        terms_ = terms(p, q_logits, x, sampling, rule)
        expected.append(terms_.expected.cpu())
        posterior.append(terms_.posterior.cpu())
        drafts.append(terms_.draft.cpu())
    return torch.cat(expected), torch.cat(posterior), torch.cat(drafts)


def evaluate_acceptance(
    bundle: MtpBundle,
    run: TargetRun,
    k_max: int,
    *,
    progress: bool = True,
    label: str = "",
    sampling: SamplingSettings | None = None,
    rule: str = "vllm",
    target_head: Tensor | None = None,
    context_edges: Sequence[int] = (),
) -> AcceptanceResult:
    """Replay speculative decoding on every sequence of ``run``, for k = 1..k_max.

    Greedy (``sampling`` None or temperature 0): exact greedy verification (``replay_greedy``) on the target's greedy
    sequences. Sampled: ``walk`` with the ``rule``'s terms on the target's sampled sequences; ``target_head`` is the
    head of the target that produced ``run`` (its distributions verify the drafts). ``context_edges``: the context
    buckets per-position acceptance is also reported in.
    """
    sampled = sampling is not None and not sampling.greedy
    if sampled and target_head is None:
        raise ValueError("a sampled evaluation needs the target's lm_head")
    per_seq: list[list[list[StepRecord]]] = [[] for _ in range(k_max)]  # [k - 1][sequence] -> its steps
    tf_hits = tf_total = non_finite = 0
    for index, seq in enumerate(tqdm(run.sequences, desc=f"MTP {label}".rstrip(), unit="seq", disable=not progress)):
        tokens = seq.tokens.tolist()
        T, P = seq.length, seq.prompt_len  # the engine's request: prompt + max_tokens (lookahead after it)
        if T - P < 2:  # nothing to draft on: an empty unit keeps the prompts of both sides aligned
            for by_seq in per_seq:
                by_seq.append([])
            continue
        teacher = _tf_pass(bundle, seq)
        non_finite += int((~torch.isfinite(teacher.out)).any(dim=-1).sum())
        rows = range(P - 1, T - 2)  # every row a step can draft from
        if sampled:
            assert sampling is not None and target_head is not None
            expected, posterior, firsts = _sampled_terms(
                bundle, seq, teacher, rows, k_max, sampling, rule, target_head
            )
            first_drafts = firsts[:, 0].tolist()
            generator = torch.Generator().manual_seed(sampling.for_prompt(index).seed)
            for k in range(1, k_max + 1):
                per_seq[k - 1].append(walk(T, P, k, expected[:, :k], posterior[:, :k], generator, len(tokens)))
        else:
            chains = draft_rows(bundle.layer, teacher, rows, bundle.embed, bundle.lm_head_weight, k_max).tolist()
            first_drafts = [chain[0] for chain in chains]

            def drafts(t: int, n: int, chains: list[list[int]] = chains, first: int = rows.start) -> list[int]:
                return chains[t - first][:n]

            for k in range(1, k_max + 1):
                per_seq[k - 1].append(replay_greedy(tokens, P, k, drafts, end=T))
        # Teacher-forced agreement over the continuation: row t's first draft (its argmax) predicts token t+2.
        tf_hits += sum(d == tokens[t + 2] for t, d in zip(rows, first_drafts))
        tf_total += len(rows)
    records = [[r for seq_records in by_seq for r in seq_records] for by_seq in per_seq]
    if not records[0]:
        raise ReplayError("no sequence long enough to draft on (raise --max-len)")
    return AcceptanceResult(
        by_k=[acceptance_stats(r) for r in records],
        teacher_forced_agreement=tf_hits / max(1, tf_total),
        steps_by_k=[len(r) for r in records],
        units=[unit_counts(by_seq, k) for k, by_seq in enumerate(per_seq, 1)],
        non_finite=non_finite,
        sampling=sampling,
        rule=rule,
        by_context=[context_buckets(r, context_edges, k) for k, r in enumerate(records, 1)] if context_edges else [],
    )


@dataclass
class LogitAgreement:
    """Candidate vs reference logits at identical positions, per position (the report's ``Agreement`` summarises
    it; the plots show the per-position KL)."""

    positions: int
    top1_agreement: float
    kl: Tensor  # per position, float64 (NaN where either side's logits were not finite)

    def typed(self) -> Agreement:
        """The report's ``Agreement``: the KL summary (mean, median, p99, max) over the positions where it is
        defined, and how many were not (a NaN or an infinity in either side's logits)."""
        finite = self.kl[torch.isfinite(self.kl)]
        s = summarize(finite) if finite.numel() else None
        kl = None if s is None else KlSummary(s.mean, s.median, s.p99, float(finite.max()))
        return Agreement(self.positions, self.top1_agreement, kl, int(self.kl.numel() - finite.numel()))


def _compare(pairs: Sequence[tuple[list[Tensor], list[Tensor]]]) -> LogitAgreement:
    """KL(ref || cand) per position and top-1 agreement over chunked logits (metrics.py's functions)."""
    kls: list[Tensor] = []
    ref_top: list[Tensor] = []
    cand_top: list[Tensor] = []
    for ref_chunks, cand_chunks in pairs:
        for r, c in zip(ref_chunks, cand_chunks):
            kls.append(kl_per_position(r, c, chunk_rows=r.shape[0]).cpu())
            ref_top.append(r.argmax(-1).cpu())
            cand_top.append(c.argmax(-1).cpu())
    if not kls:
        return LogitAgreement(0, 0.0, torch.zeros(0, dtype=torch.float64))
    kl = torch.cat(kls)
    return LogitAgreement(int(kl.numel()), token_agreement(torch.cat(cand_top), torch.cat(ref_top)), kl)


def compare_mtp(ref: MtpBundle, cand: MtpBundle, run: TargetRun) -> LogitAgreement:
    """Both MTP layers, teacher-forced on the same (reference) hidden states and tokens."""
    pairs = []
    for seq in run.sequences:
        n = seq.length - 1  # rows of the engine's sequence (the lookahead left out)
        step_r, step_c = _tf_pass(ref, seq), _tf_pass(cand, seq)
        out_r, out_c = step_r.out[:, :n], step_c.out[:, :n]
        head_r, head_c = step_head(step_r, ref.lm_head_weight), step_head(step_c, cand.lm_head_weight)
        pairs.append((_chunked_logits(out_r, head_r), _chunked_logits(out_c, head_c)))
    return _compare(pairs)


def compare_main(
    ref_run: TargetRun, ref_head: Tensor, cand_hidden: Sequence[Tensor], cand_head: Tensor
) -> LogitAgreement:
    """Both targets' next-token logits over the reference sequences."""
    return _compare(
        [
            (_chunked_logits(seq.hidden[: seq.length], ref_head), _chunked_logits(hc[: seq.length], cand_head))
            for seq, hc in zip(ref_run.sequences, cand_hidden)
        ]
    )
