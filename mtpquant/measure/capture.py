"""The target's side of a measurement: its continuations of planned sequences (greedy or sampled) and its hidden
states, computed once and measured against as many MTPs as needed (validate's sides, heal's before and after)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from tqdm.auto import tqdm

from mtpquant.measure.load import TargetModel
from mtpquant.measure.replay import SequenceRecord, TargetRun
from mtpquant.records.sampling import SamplingSettings
from mtpquant.text.prompts import PlannedSequence

__all__ = ["capture"]


def _batches(lengths: Sequence[Hashable], batch_size: int) -> list[list[int]]:
    """Indices of equal ``lengths`` in chunks of at most ``batch_size``, in first-seen order (no padding: every
    row of a batch has the inputs it would have alone)."""
    groups: dict[Hashable, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return [g[j : j + batch_size] for g in groups.values() for j in range(0, len(g), batch_size)]


def capture(
    target: TargetModel,
    plan: Sequence[PlannedSequence],
    *,
    label: str,
    reference: TargetRun | None = None,
    progress: bool = True,
    batch_size: int = 16,
    sampling: SamplingSettings | None = None,
) -> TargetRun:
    """Continuations (greedy, or sampled with ``sampling``) and hidden states for each planned sequence (and over
    ``reference``'s sequences).

    Sequences of the same prompt and continuation lengths are generated together, ``batch_size`` at a time (nothing
    is padded or masked). The tokens are those of one prompt at a time (a sampled prompt draws from its own
    generator, seeded by ``sampling.for_prompt(i)``); the hidden states are bit-identical on CPU for the dense
    family and within float rounding for MoE experts, whose GEMMs see more rows when batched
    (tests/test_validate.py); on GPU batched GEMMs may round differently too.
    """
    shapes = [(len(s.prompt), s.new_tokens) for s in plan]
    records: list[SequenceRecord | None] = [None] * len(plan)
    with tqdm(total=len(plan), desc=f"target {label}", unit="prompt", disable=not progress) as bar:
        for batch in _batches(shapes, batch_size):
            new = plan[batch[0]].new_tokens
            prompt = torch.tensor([list(plan[i].prompt) for i in batch], dtype=torch.long)
            generators = (
                [torch.Generator().manual_seed(sampling.for_prompt(i).seed) for i in batch]
                if sampling is not None and not sampling.greedy
                else []
            )
            tokens = target.generate(prompt, new, sampling, generators).cpu()
            head, mtp_input = target.hidden_states(tokens)
            for row, i in enumerate(batch):
                extra = None if mtp_input is None else mtp_input[row].cpu().clone()
                records[i] = SequenceRecord(tokens[row].clone(), len(plan[i].prompt), head[row].cpu().clone(), extra)
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
    return TargetRun(label, seqs, on_ref, sampling or SamplingSettings())
