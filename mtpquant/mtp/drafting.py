"""Drafting with the MTP layer as the engines do: teacher-forced rows, chained greedy drafts.

``draft_chain`` is the engines' loop for one step (the accepted rows, then the layer's own next-step hidden and
argmax fed back k - 1 times). ``chain_logits`` computes that chain from every row of one sequence at once, batched
over rows: each row's queries see the teacher-forced cache up to their own row plus their own chain (an explicit
mask), so the tokens are those of ``draft_chain`` from that row (tests/test_mtp_module.py) while the layer runs
k passes instead of k per row; fed the sequence's own tokens instead of its argmax, it is the chain of sampled
drafts that were accepted. ``draft_rows`` is its argmax. Any MTP with a ``step`` method (``mtp.step.MtpForward``)
drafts here: for Qwen3.5 the head and the next step read the same output; for Qwen4-Exp the next step reads the
multi-stream one, and with ``index_share_for_mtp_iteration`` steps 2..k attend to the keys the first step's indexer
selected for the row (vLLM's ``set_skip_topk``: ``mtp.qwen4_exp``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mtpquant.mtp.step import MtpForward, MtpStep

__all__ = [
    "DraftResult",
    "TeacherForcedResult",
    "chain_logits",
    "draft_chain",
    "draft_rows",
    "mtp_logits",
    "step_head",
    "teacher_forced",
]


def mtp_logits(mtp_out: Tensor, lm_head_weight: Tensor) -> Tensor:
    """Logits from the MTP output with the target's ``lm_head`` ``[V, H]``, in the head's dtype."""
    return F.linear(mtp_out.to(lm_head_weight.dtype), lm_head_weight)


def step_head(step: MtpStep, lm_head_weight: Tensor) -> Tensor:
    """The head a step drafts with: its layer's own (Step-3.5's ``shared_head.output``), else the target's."""
    return lm_head_weight if step.head is None else step.head.to(lm_head_weight.device)


@dataclass(frozen=True)
class TeacherForcedResult:
    """MTP outputs for every row of a sequence; row t's logits predict ``x_{t+2}``."""

    step: MtpStep
    logits: Tensor

    @property
    def mtp_out(self) -> Tensor:
        """The stream the LM head reads, ``[B, T, H]``."""
        return self.step.out


def teacher_forced(
    layer: MtpForward,
    hidden: Tensor,
    next_tokens: Tensor,
    embed_fn: Callable[[Tensor], Tensor],
    lm_head_weight: Tensor,
    positions: Tensor | None = None,
) -> TeacherForcedResult:
    """One causal pass over ``h_0..h_{T-1}`` ``[B, T, *]`` and ``x_1..x_T`` ``[B, T]`` (k = 1)."""
    with torch.no_grad():
        step = layer.step(hidden, embed_fn(next_tokens), positions)
        return TeacherForcedResult(step, mtp_logits(step.out, step_head(step, lm_head_weight)))


@dataclass(frozen=True)
class DraftResult:
    """A chain of k greedy drafts: tokens ``[B, k]``, logits ``[B, k, V]``, MTP outputs ``[B, k, H]``."""

    tokens: Tensor
    logits: Tensor
    mtp_out: Tensor
    past_kv: Any


def draft_chain(
    layer: MtpForward,
    hidden: Tensor,
    next_tokens: Tensor,
    embed_fn: Callable[[Tensor], Tensor],
    lm_head_weight: Tensor,
    k: int,
    past_kv: Any = None,
    positions: Tensor | None = None,
) -> DraftResult:
    """Draft k tokens greedily, reusing the one layer and its cache as the engines do.

    Step 1 runs the rows ``hidden`` ``[B, T, *]`` / ``next_tokens`` ``[B, T]`` (T >= 1; usually the
    rows accepted since the last step) and drafts from the last row. Step j+1 feeds step j's own
    next-step hidden (Qwen3.5: its post-norm output) and its argmax token as the input token, at position + 1;
    with index sharing it attends to the keys step 1 selected for the last row (and none of the chain's).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if positions is None:
        start = 0 if past_kv is None else past_kv.length
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device)
    if positions.dim() == 1:
        positions = positions[None].expand(hidden.shape[0], -1)
    tokens: list[Tensor] = []
    logits: list[Tensor] = []
    outs: list[Tensor] = []
    with torch.no_grad():
        h, x, pos, cache = hidden, next_tokens, positions, past_kv
        shared: Tensor | None = None
        for j in range(k):
            selection = None
            if shared is not None:  # the first step's selection for the drafting row, none of the chain's keys
                pad = torch.zeros(*shared.shape[:-1], j, dtype=torch.bool, device=shared.device)
                selection = torch.cat((shared, pad), dim=-1)
            step = layer.step(h, embed_fn(x), pos, cache, step=j, selection=selection)
            cache = step.cache
            if j == 0 and layer.index_share and step.selection is not None:
                shared = step.selection[:, :, -1:]
            last = step.out[:, -1:]
            step_logits = mtp_logits(last, step_head(step, lm_head_weight))
            token = step_logits.argmax(dim=-1)
            tokens.append(token)
            logits.append(step_logits)
            outs.append(last)
            h, x, pos = step.next_hidden[:, -1:], token, pos[:, -1:] + 1
    return DraftResult(torch.cat(tokens, 1), torch.cat(logits, 1), torch.cat(outs, 1), cache)


def chain_logits(
    layer: MtpForward,
    teacher: MtpStep,
    rows: range,
    embed_fn: Callable[[Tensor], Tensor],
    lm_head_weight: Tensor,
    k: int,
    *,
    feed: Tensor | None = None,
    chunk: int = 64,
) -> Iterator[tuple[Tensor, Tensor]]:
    """The MTP chain of k steps from each of ``rows`` of one sequence, ``chunk`` rows at a time: yields the rows ``t``
    ``[R]`` and the logits of every step ``[R, k, V]``.

    ``teacher`` is the layer's teacher-forced pass over the sequence (``layer.step(hidden, embed(x))`` with batch
    1): its output at row t is step 1 of row t's chain and its cache up to row t what the chain attends to. Step
    j + 1 runs on step j's next-step hidden, at position t + j, masked to row t's prefix and its own chain (with index
    sharing: to the keys the teacher pass selected for row t), with the token step j drafted: its argmax (``feed``
    None: the engines' greedy chain, ``draft_chain``), or the sequence's own token ``feed[t + 1 + j]`` (a chain fed
    the tokens that were actually emitted, what an accepted sampled draft was; where the sequence has ended, the
    argmax).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out, nxt, cache = teacher.out, teacher.next_hidden, teacher.cache
    if out.shape[0] != 1:
        raise ValueError(f"the teacher-forced pass must have batch 1, got {tuple(out.shape)}")
    shared = layer.index_share and teacher.selection is not None
    with torch.no_grad():
        for start in range(rows.start, rows.stop, chunk):
            t = torch.arange(start, min(start + chunk, rows.stop), device=out.device)
            h = nxt[0, t][:, None]  # [R, 1, *]
            step_logits = mtp_logits(out[0, t][:, None], step_head(teacher, lm_head_weight))  # [R, 1, V]
            logits = [step_logits]
            prefix = torch.arange(cache.length, device=out.device)[None, :] <= t[:, None]  # [R, L]
            first = teacher.selection[0, 0, t].to(out.device) if shared and teacher.selection is not None else None
            base = cache.expand(len(t))
            parts: list[Any] = []
            for step in range(1, k):
                token = step_logits.argmax(dim=-1)  # [R, 1]
                if feed is not None:
                    pos = t + step + 1  # the sequence's token at this draft's input position
                    inside = pos < feed.shape[0]
                    fed = feed.to(out.device)[pos.clamp_max(feed.shape[0] - 1)][:, None]
                    token = torch.where(inside[:, None], fed, token)
                past = base.cat(parts)
                own = torch.ones(len(t), step, dtype=torch.bool, device=out.device)  # earlier chain rows + itself
                mask = torch.cat((prefix, own), dim=1)[:, None, None, :]
                selection = None
                if first is not None:
                    selection = torch.cat((first, torch.zeros_like(own)), dim=1)[:, None, None, :]
                new = layer.step(h, embed_fn(token), (t + step)[:, None], past, mask, step=step, selection=selection)
                parts.append(new.cache.last(1))
                step_logits = mtp_logits(new.out, step_head(new, lm_head_weight))
                h = new.next_hidden
                logits.append(step_logits)
            yield t, torch.cat(logits, dim=1)


def draft_rows(
    layer: MtpForward,
    teacher: MtpStep,
    rows: range,
    embed_fn: Callable[[Tensor], Tensor],
    lm_head_weight: Tensor,
    k: int,
    *,
    chunk: int = 64,
) -> Tensor:
    """The k greedy drafts ``draft_chain`` makes from each of ``rows`` of one sequence, ``[len(rows), k]``: the argmax
    of every step of ``chain_logits`` (k layer passes for all rows instead of k per row)."""
    drafts = [
        logits.argmax(dim=-1)
        for _, logits in chain_logits(layer, teacher, rows, embed_fn, lm_head_weight, k, chunk=chunk)
    ]
    return torch.cat(drafts).cpu() if drafts else torch.zeros(0, k, dtype=torch.long)
