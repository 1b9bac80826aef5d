"""Whether a healed MTP is written: the one decision ``heal``, ``convert --heal`` and the demo share (torch-free).

The check measures, at each sampling setting, the AL of QUANT's MTP and of the healed one for k = 1..K on the same
held-out sequences; each k's change gets a paired 95 % interval (``records.evidence.better_beyond_noise``) and a
verdict: **better** (the interval's lower end above 0), **worse** (its upper end below 0) or **no change** (it
straddles 0).

The rule (``HealRule``): the healed MTP is written when, at the first setting checked (the headline: greedy by
default), it is better beyond noise at the **served k** (``--k``, default 3: the depth engines are usually run at,
e.g. ``--speculative-num-steps 3``) and, at every setting, worse beyond noise at **no** k. A heal that lifts k = 3 by
+0.27 while k = 1 moves within noise is a gain for whoever serves k = 3 and a loss for no one, so it is written.
``--strict`` asks more: better beyond noise at every k of the first setting (and worse at no k of any).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["SERVED", "AlChange", "HealRule", "KVerdict", "changes_text", "decide", "setting_verdict"]

KVerdict = Literal["better", "no change", "worse"]


@dataclass(frozen=True)
class AlChange:
    """AL at one k before and after healing, the change's paired 95 % interval ``[low, high]``, and whether the
    interval lies above 0 (``better``: computed with the interval, ``records.evidence.better_beyond_noise``)."""

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

    @property
    def worse(self) -> bool:
        """Whether the healed MTP is worse beyond noise (the interval's upper end below 0)."""
        return self.high < 0

    @property
    def verdict(self) -> KVerdict:
        """This k's verdict: ``better``, ``worse`` or ``no change`` (beyond noise)."""
        return "better" if self.better else "worse" if self.worse else "no change"

    def text(self) -> str:
        """``k=3 better: 2.171 -> 2.443 (+0.272 [+0.190, +0.352])``."""
        return (f"k={self.k} {self.verdict}: {self.before:.3f} -> {self.after:.3f} "
                f"({self.change:+.3f} [{self.low:+.3f}, {self.high:+.3f}])")


@dataclass(frozen=True)
class HealRule:
    """When the healed MTP is written: better beyond noise at ``served_k`` (0: the largest k checked) of the first
    setting, worse beyond noise at no k of any; ``strict``: better beyond noise at every k of the first setting."""

    served_k: int = 0
    strict: bool = False

    def served(self, by_k: Sequence[AlChange]) -> int:
        """The served k among ``by_k``'s (0 reads as the largest)."""
        return self.served_k or max((c.k for c in by_k), default=0)

    def text(self, largest: int) -> str:
        """The rule in words, for the plan and the messages."""
        if self.strict:
            return "better beyond noise at every k and worse beyond noise at none (--strict)"
        return f"better beyond noise at the served k = {self.served_k or largest} and worse beyond noise at no k"


SERVED = HealRule()  # the default rule: decide at the largest k checked (heal's --k, default 3)


def setting_verdict(by_k: Sequence[AlChange], rule: HealRule) -> KVerdict:
    """One setting's verdict under ``rule``: ``worse`` when some k is worse beyond noise; ``better`` when the rule's
    k are better beyond noise (the served k, or every k with ``strict``); else ``no change``."""
    if any(c.worse for c in by_k):
        return "worse"
    if not by_k:
        return "no change"
    if rule.strict:
        return "better" if all(c.better for c in by_k) else "no change"
    served = rule.served(by_k)
    return "better" if any(c.k == served and c.better for c in by_k) else "no change"


def decide(settings: Sequence[Sequence[AlChange]], rule: HealRule) -> bool:
    """Whether the healed MTP is written: better under ``rule`` at the first setting (the headline) and worse beyond
    noise at no k of any setting."""
    return bool(settings) and setting_verdict(settings[0], rule) == "better" and not any(
        c.worse for s in settings for c in s)


def changes_text(by_k: Sequence[AlChange]) -> str:
    """Every k's verdict with its change and interval, ``; ``-separated: the decision line's body."""
    return "; ".join(c.text() for c in by_k)
