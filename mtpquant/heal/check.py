"""heal's held-out check: the MTP's acceptance before and after, on prompts heal never trained on.

The quantized target continues held-out prompts greedily: validate's default prompts (``validate.prompts``: text
held out from the tiny model's training and from heal's data), cut into 300-character pieces so that 64 of them are
all different (the prompts use at most half of a 128-token sequence, about 64 tokens, either way); on those
sequences the built-in replay (``measure.replay.evaluate_acceptance``, the engines' drafting and greedy
verification) measures the AL of QUANT's MTP and of the healed one, for k = 1..K, each sequence counted on its own.
The change is decided with the paired bootstrap over the sequences (``records.evidence.better_beyond_noise``):
the healed MTP is better when, at every k, the lower end of the 95 % interval of AL(after) - AL(before) is above 0.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtpquant.errors import OutputVerificationError
from mtpquant.measure.drafter import load_mtp
from mtpquant.measure.replay import TargetRun, evaluate_acceptance
from mtpquant.records.evidence import CONFIDENCE, UnitCounts, better_beyond_noise

if TYPE_CHECKING:
    from torch import Tensor

    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.measure.target import TargetModel
    from mtpquant.measure.weights import CheckpointWeights

__all__ = ["CONFIDENCE", "AlChange", "CheckResult", "check", "check_prompts", "compare", "held_out_run"]

PROMPT_CHARS = 300


def check_prompts(n: int) -> list[str]:
    """``n`` held-out prompts, all different (validate's default prompts, in pieces of ``PROMPT_CHARS``)."""
    from mtpquant.text.prompts import default_prompts

    return list(dict.fromkeys(default_prompts(n, chars=PROMPT_CHARS)))


@dataclass(frozen=True)
class AlChange:
    """AL at one k before and after healing, the change and its paired 95 % interval, and the decision."""

    k: int
    before: float
    after: float
    low: float
    high: float
    better: bool

    @property
    def change(self) -> float:
        """AL(after) - AL(before)."""
        return self.after - self.before


@dataclass(frozen=True)
class CheckResult:
    """The held-out check: sequences, their tokens, and the change per k."""

    sequences: int
    tokens: int
    by_k: tuple[AlChange, ...]

    @property
    def better(self) -> bool:
        """Whether the healed MTP is better beyond noise at every k."""
        return bool(self.by_k) and all(c.better for c in self.by_k)


def held_out_run(
    target: TargetModel, source: CheckpointSource, vocab: int, prompts: int, seq_len: int, *, batch_size: int,
    progress: bool,
) -> TargetRun:
    """The target's greedy continuations of ``prompts`` held-out prompts (tokenized with ``source``'s tokenizer, of
    ``vocab`` entries) to ``seq_len`` tokens: the check's sequences."""
    from mtpquant.measure.target import capture
    from mtpquant.text.prompts import plan_sequences, tokenize_prompts

    texts = check_prompts(prompts)
    ids = tokenize_prompts(source, texts, vocab)
    return capture(target, plan_sequences(ids, seq_len), label="held-out", progress=progress, batch_size=batch_size)


def check(
    before: CheckpointWeights,
    after: CheckpointWeights,
    held_out: TargetRun,
    shared: tuple[Tensor, Tensor],
    *,
    activations: str,
    k: int,
) -> CheckResult:
    """QUANT's MTP (``before``) and the healed one as written (``after``) measured on the held-out run, each
    sequence a unit, for k = 1..``k``; then compared.

    The check is heal's last phase and must not raise its peak memory above training's: it uses training's
    embedding and LM head (``shared``; reading them again takes twice their size for a moment, 2.5 GB on
    Qwen3.5-4B) and loads one MTP at a time.
    """
    embed, head = shared
    counts = []
    for label, weights in (("QUANT's", before), ("the healed", after)):
        bundle, err = load_mtp(weights, dtype=embed.dtype, device=embed.device, activations=activations,
                               shared=(embed, head))
        if bundle is None:
            raise OutputVerificationError(f"{label} MTP does not load for evaluation: {err}")
        counts.append(evaluate_acceptance(bundle, held_out, k, progress=False).units)
        del bundle
        gc.collect()
    return compare(counts[0], counts[1], held_out)


def compare(before: Sequence[UnitCounts], after: Sequence[UnitCounts], run: TargetRun) -> CheckResult:
    """The check's result from the per-k counts of QUANT's MTP and the healed one on ``run``."""
    changes = []
    for k, (b, a) in enumerate(zip(before, after), 1):
        better, change = better_beyond_noise(b, a)
        changes.append(AlChange(k, b.mean_acceptance_length, a.mean_acceptance_length, change.low, change.high, better))
    return CheckResult(len(run.sequences), run.num_tokens, tuple(changes))
