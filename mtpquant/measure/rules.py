"""The verification rules as arithmetic on distributions: what the built-in prediction computes at every draft.

``target_probs`` is the target's distribution as vLLM 0.32.0 samples from it
(``vllm/v1/sample/rejection_sampler.py::apply_sampling_constraints``: logits in float32 divided by the temperature,
then ``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch``: top-k keeps the logits at or above the
k-th largest, top-p drops the tokens whose ascending cumulative probability is at most 1 - p, keeping at least the
most likely one; then softmax). ``draft_probs`` is the MTP's: its argmax for the argmax-draft rule (``--rule vllm``)
and greedy requests, softmax(logits / temperature) for the sampled-draft rules (vLLM applies no top-k/top-p to drafts:
``llm_base_proposer.py::compute_probs_and_sample_next_token``).

For one draft position with target distribution p, draft distribution q and the token x the target's sequence
actually has there (``mtpquant.records.sampling`` describes the rules), ``terms`` gives

- ``expected``: the probability that the draft is accepted, beta = sum_v A(v) with A(v) = P(accepted and the
  emitted token is v): min(p, q) for argmax-draft (q one-hot: p(d)) and ``probabilistic``, p * q for ``strict``;
- ``posterior``: the probability that it was accepted given that the emitted token is x, w = A(x) / p(x): 1[x = d]
  for argmax-draft, min(p(x), q(x)) / p(x) for ``probabilistic``, q(x) for ``strict``;
- ``draft``: the draft token (q's argmax; for sampled drafts the token the chain continues with is x).

Why these two suffice (``replay.walk``): a sequence sampled from the target is distributed as speculative decoding's
output, and given its tokens the acceptance at each draft is a coin with probability w; the expected number of
drafts accepted from a row is sum_i (prod_{j<i} w_j) * beta_i, unbiased and with less noise than the coin flips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtpquant.records.sampling import RULES, SamplingSettings

__all__ = ["DraftTerms", "draft_probs", "target_probs", "terms"]


def _top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """vLLM's ``apply_top_k_top_p_pytorch`` for one setting: masked logits (-inf outside the kept set)."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if 0 < top_k < logits.shape[-1]:
        kth = logits_sort[..., logits.shape[-1] - top_k : logits.shape[-1] - top_k + 1]
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if top_p < 1.0:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - top_p
        mask[..., -1] = False  # at least one
        logits_sort = logits_sort.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, logits_idx, logits_sort)


def target_probs(logits: Tensor, sampling: SamplingSettings) -> Tensor:
    """The target's sampling distribution ``[..., V]`` in float32 (greedy: one-hot on the argmax)."""
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return _top_k_top_p(logits / sampling.temperature, sampling.top_k, sampling.top_p).softmax(dim=-1)


def draft_probs(logits: Tensor, sampling: SamplingSettings, rule: str) -> Tensor:
    """The MTP's draft distribution ``[..., V]`` under ``rule`` (``--rule``'s spelling; argmax rules and greedy
    requests: one-hot)."""
    logits = logits.float()
    if sampling.greedy or not RULES[rule].sampled_draft:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return (logits / sampling.temperature).softmax(dim=-1)


@dataclass(frozen=True)
class DraftTerms:
    """Per draft ``[...]``: the expected acceptance (beta), the posterior acceptance given the sequence's token (w),
    and the draft distribution's argmax."""

    expected: Tensor
    posterior: Tensor
    draft: Tensor


def terms(p: Tensor, q_logits: Tensor, x: Tensor, sampling: SamplingSettings, rule: str) -> DraftTerms:
    """The rule's terms for target distributions ``p`` ``[..., V]`` (``target_probs``), MTP logits ``q_logits``
    ``[..., V]`` and the sequence's tokens ``x`` ``[...]`` at the same positions."""
    spec = RULES.get(rule)
    if spec is None:
        raise ValueError(f"unknown rule {rule!r}")
    q = draft_probs(q_logits, sampling, rule)
    draft = q_logits.argmax(dim=-1)
    p_x = p.gather(-1, x[..., None])[..., 0]
    q_x = q.gather(-1, x[..., None])[..., 0]
    if sampling.greedy or not spec.sampled_draft:
        # one-hot q (argmax-draft): A = p(d) at d, 0 elsewhere
        expected = p.gather(-1, draft[..., None])[..., 0]
        posterior = (x == draft).float()
    elif not spec.exact_match:  # probabilistic: rejection sampling, accepted with min(1, p/q)
        expected = torch.minimum(p, q).sum(dim=-1)
        posterior = torch.where(p_x > 0, torch.minimum(p_x, q_x) / p_x.clamp_min(1e-30), torch.zeros_like(p_x))
    else:  # strict: the draft must equal the target's own independent sample
        expected = (p * q).sum(dim=-1)
        posterior = q_x
    return DraftTerms(expected.clamp(0.0, 1.0), posterior.clamp(0.0, 1.0), draft)
