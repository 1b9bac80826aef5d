"""Greedy speculative decoding replayed exactly as the engines run it, and comparisons on identical inputs.

A target's greedy sequences (``TargetRun``) come from ``builtin.capture`` or a hidden-state file
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

from mtpquant.errors import UsageError
from mtpquant.mtp.drafting import draft_rows, mtp_logits
from mtpquant.mtp.step import MtpStep
from mtpquant.validate.load import MtpBundle
from mtpquant.validate.metrics import (
    AcceptanceStats,
    StepRecord,
    acceptance_stats,
    kl_per_position,
    summarize,
    token_agreement,
)
from mtpquant.validate.schema import Acceptance, AcceptanceRow, Agreement, KlSummary

__all__ = [
    "AcceptanceResult",
    "Comparison",
    "ReplayError",
    "SequenceRecord",
    "TargetRun",
    "compare_main",
    "compare_mtp",
    "evaluate_acceptance",
    "replay_greedy",
]

# Rows of [rows, vocab] logits computed at once (bounded memory for 248k-token vocabularies).
_LOGIT_CHUNK = 256


class ReplayError(UsageError):
    """Nothing to evaluate (no sequence long enough to draft on)."""


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

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return sum(int(s.tokens.numel()) for s in self.sequences)

    @property
    def generated_tokens(self) -> int:
        """Tokens the target generated (continuations)."""
        return sum(int(s.tokens.numel()) - s.prompt_len for s in self.sequences)


# ---- MTP evaluation -----------------------------------------------------------------------------
@dataclass
class AcceptanceResult:
    """Acceptance of one (target, MTP) pair for k = 1..K, plus teacher-forced agreement."""

    by_k: list[AcceptanceStats]
    teacher_forced_agreement: float  # MTP argmax at row t == target's token t+2, over continuations
    steps_by_k: list[int] = field(default_factory=list)

    def typed(self) -> Acceptance:
        """The report's ``Acceptance``."""
        return Acceptance(
            tuple(AcceptanceRow.of(k, s) for k, s in enumerate(self.by_k, 1)), self.teacher_forced_agreement
        )


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
    for seq in tqdm(run.sequences, desc=f"MTP {label}".rstrip(), unit="seq", disable=not progress):
        tokens = seq.tokens.tolist()
        T, P = len(tokens), seq.prompt_len
        if T - P < 2:
            continue
        rows = range(P - 1, T - 2)  # every row a step can draft from
        teacher = _tf_pass(bundle, seq)
        chains = draft_rows(bundle.layer, teacher, rows, bundle.embed, bundle.lm_head_weight, k_max).tolist()
        # Teacher-forced agreement over the continuation: row t's first draft (its argmax) predicts token t+2.
        tf_hits += sum(chain[0] == tokens[t + 2] for t, chain in zip(rows, chains))
        tf_total += len(rows)

        def drafts(t: int, n: int, chains: list[list[int]] = chains, first: int = rows.start) -> list[int]:
            return chains[t - first][:n]

        for k in range(1, k_max + 1):
            records[k - 1].extend(replay_greedy(tokens, P, k, drafts))
    if not records[0]:
        raise ReplayError("no sequence long enough to draft on (raise --max-len)")
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

    def typed(self) -> Agreement:
        """The report's ``Agreement`` (KL summary: mean, median, p99, max)."""
        s = summarize(self.kl) if self.kl.numel() else None
        kl = None if s is None else KlSummary(s.mean, s.median, s.p99, float(self.kl.max()))
        return Agreement(self.positions, self.top1_agreement, kl)


def _compare(pairs: Sequence[tuple[list[Tensor], list[Tensor]]]) -> Comparison:
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
        return Comparison(0, 0.0, torch.zeros(0, dtype=torch.float64))
    kl = torch.cat(kls)
    return Comparison(int(kl.numel()), token_agreement(torch.cat(cand_top), torch.cat(ref_top)), kl)


def compare_mtp(ref: MtpBundle, cand: MtpBundle, run: TargetRun) -> Comparison:
    """Both MTP layers, teacher-forced on the same (reference) hidden states and tokens."""
    pairs = []
    for seq in run.sequences:
        out_r, out_c = _tf_pass(ref, seq).out, _tf_pass(cand, seq).out
        pairs.append((_chunked_logits(out_r, ref.lm_head_weight), _chunked_logits(out_c, cand.lm_head_weight)))
    return _compare(pairs)


def compare_main(ref_run: TargetRun, ref_head: Tensor, cand_hidden: Sequence[Tensor], cand_head: Tensor) -> Comparison:
    """Both targets' next-token logits over the reference sequences."""
    return _compare(
        [
            (_chunked_logits(seq.hidden, ref_head), _chunked_logits(hc, cand_head))
            for seq, hc in zip(ref_run.sequences, cand_hidden)
        ]
    )
