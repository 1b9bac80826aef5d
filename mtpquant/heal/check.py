"""heal's held-out check: the MTP's acceptance before and after, on prompts heal never trained on.

The quantized target continues held-out prompts greedily: validate's default prompts (``validate.prompts``: text
held out from the tiny model's training and from heal's data), cut into 300-character pieces so that 64 of them are
all different (the prompts use at most half of a 128-token sequence, about 64 tokens, either way); on those
sequences the built-in replay (``validate.replay.evaluate_acceptance``, the engines' drafting and greedy
verification) measures the AL of QUANT's MTP and of the healed one, for k = 1..K, each sequence counted on its own.
The change is decided with validate's paired bootstrap over the sequences (``validate.evidence.better_beyond_noise``):
the healed MTP is better when, at every k, the lower end of the 95 % interval of AL(after) - AL(before) is above 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtpquant.errors import ReplayError
from mtpquant.measure.load import MtpBundle
from mtpquant.measure.replay import TargetRun, evaluate_acceptance
from mtpquant.records.evidence import CONFIDENCE, UnitCounts, better_beyond_noise

__all__ = ["CONFIDENCE", "AlChange", "CheckResult", "check_prompts", "compare", "unit_counts"]

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


def unit_counts(bundle: MtpBundle, run: TargetRun, k_max: int) -> list[UnitCounts]:
    """Per k = 1..k_max, the counts of every sequence of ``run`` (``evaluate_acceptance`` one sequence at a time)."""
    steps: list[list[int]] = [[] for _ in range(k_max)]
    accepted: list[list[float]] = [[] for _ in range(k_max)]
    for seq in run.sequences:
        try:
            result = evaluate_acceptance(bundle, TargetRun(run.source, [seq]), k_max, progress=False)
        except ReplayError:  # too short to draft on: no steps, nothing to count
            continue
        for i, stats in enumerate(result.by_k):
            steps[i].append(stats.num_steps)
            accepted[i].append(stats.num_accepted)
    return [UnitCounts(tuple(s), tuple(a), ((),) * len(s), ((),) * len(s)) for s, a in zip(steps, accepted)]


def compare(before: Sequence[UnitCounts], after: Sequence[UnitCounts], run: TargetRun) -> CheckResult:
    """The check's result from the per-k counts of QUANT's MTP and the healed one on ``run``."""
    changes = []
    for k, (b, a) in enumerate(zip(before, after), 1):
        better, change = better_beyond_noise(b, a)
        changes.append(AlChange(k, b.mean_acceptance_length, a.mean_acceptance_length, change.low, change.high, better))
    return CheckResult(len(run.sequences), run.num_tokens, tuple(changes))
