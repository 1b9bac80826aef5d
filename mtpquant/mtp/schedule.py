"""The learning-rate schedule every MTP training in mtpquant follows (heal's self-distillation, the tiny models'
training): a linear warm-up to the peak, then a cosine decay to ``min_ratio`` x the peak."""

from __future__ import annotations

import math

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, *, steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """The learning rate of step ``step`` (0-based) of ``steps``: ``peak * (step + 1) / warmup`` during the
    ``warmup`` first steps, then cosine from ``peak`` down to ``min_ratio * peak`` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
