"""heal's held-out check: the MTP's acceptance before and after, on prompts heal never trained on.

The quantized target continues held-out prompts: validate's default prompts (``validate.prompts``: text held out
from the tiny model's training and from heal's data), cut into 300-character pieces so that 64 of them are all
different (the prompts use at most half of a 128-token sequence, about 64 tokens, either way), at each sampling
setting checked (greedily by default; ``heal --temperature 0 0.7``: also sampled at 0.7, prompt i with seed + i, as
validate samples); on those sequences the built-in replay (``measure.replay.evaluate_acceptance``: the engines'
drafting, greedy verification or the sampled walk under the verification rule) measures the AL of QUANT's MTP and
of the healed one, for k = 1..K, each sequence counted on its own. The change is decided with the paired bootstrap
over the sequences (``records.evidence.better_beyond_noise``), at each k of each setting: better when the lower end of
the 95 % interval of AL(after) - AL(before) is above 0, worse when its upper end is below 0. Whether the healed MTP
is written is ``decision.decide``'s rule: better at the served k (``--k``; every k with ``--strict``) of the first
setting checked (the headline: greedy by default) and worse at no k of any (a heal that helps greedy acceptance and
hurts sampled acceptance is not written).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtpquant.errors import OutputVerificationError
from mtpquant.heal.decision import SERVED, AlChange, HealRule, KVerdict, decide, setting_verdict
from mtpquant.measure.drafter import load_mtp
from mtpquant.measure.replay import TargetRun, evaluate_acceptance
from mtpquant.records.evidence import CONFIDENCE, UnitCounts, better_beyond_noise
from mtpquant.records.sampling import GREEDY, SamplingSettings

if TYPE_CHECKING:
    from torch import Tensor

    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.measure.target import TargetModel
    from mtpquant.measure.weights import CheckpointWeights

__all__ = ["CONFIDENCE", "AlChange", "CheckResult", "HeldOut", "SettingCheck", "check", "check_prompts", "compare",
           "held_out_runs"]

PROMPT_CHARS = 300


def check_prompts(n: int) -> list[str]:
    """``n`` held-out prompts, all different (validate's default prompts, in pieces of ``PROMPT_CHARS``)."""
    from mtpquant.text.prompts import default_prompts

    return list(dict.fromkeys(default_prompts(n, chars=PROMPT_CHARS)))


@dataclass(frozen=True)
class SettingCheck:
    """The check at one sampling setting: the change per k."""

    sampling: SamplingSettings
    by_k: tuple[AlChange, ...]
    rule: HealRule = SERVED

    @property
    def better(self) -> bool:
        """Whether the healed MTP is better beyond noise under the rule (at the served k; every k when strict) and
        worse beyond noise at no k."""
        return self.verdict == "better"

    @property
    def worse(self) -> bool:
        """Whether the healed MTP is worse beyond noise at some k."""
        return any(c.worse for c in self.by_k)

    @property
    def verdict(self) -> KVerdict:
        """``better``, ``worse`` or ``no change`` (beyond noise), under the rule (``decision.setting_verdict``)."""
        return setting_verdict(self.by_k, self.rule)


@dataclass(frozen=True)
class CheckResult:
    """The held-out check: sequences, their tokens (per setting), the check at each sampling setting (the first is
    the headline) and the verification rule of the sampled ones."""

    sequences: int
    tokens: int
    settings: tuple[SettingCheck, ...]
    rule: str = "vllm"
    decision: HealRule = SERVED

    @property
    def by_k(self) -> tuple[AlChange, ...]:
        """The change per k at the first setting (greedy by default)."""
        return self.settings[0].by_k if self.settings else ()

    @property
    def better(self) -> bool:
        """Whether the healed MTP is written: better beyond noise under the decision rule at the first setting and
        worse beyond noise at no k of any (``decision.decide``)."""
        return decide([s.by_k for s in self.settings], self.decision)

    @property
    def greedy_only(self) -> bool:
        """Whether the check ran at the default setting alone (greedy)."""
        return len(self.settings) == 1 and self.settings[0].sampling.greedy


@dataclass(frozen=True)
class HeldOut:
    """The check's sequences at one sampling setting: the target's continuations, greedy or sampled by it."""

    sampling: SamplingSettings
    run: TargetRun


def held_out_runs(
    target: TargetModel,
    source: CheckpointSource,
    vocab: int,
    prompts: int,
    seq_len: int,
    settings: Sequence[SamplingSettings] = (GREEDY,),
    *,
    batch_size: int,
    progress: bool,
) -> tuple[HeldOut, ...]:
    """The target's continuations of ``prompts`` held-out prompts (tokenized with ``source``'s tokenizer, of
    ``vocab`` entries) to ``seq_len`` tokens at each of ``settings`` (greedy ones share one greedy run): the check's
    sequences, per setting."""
    from mtpquant.measure.target import capture
    from mtpquant.text.prompts import plan_sequences, tokenize_prompts

    texts = check_prompts(prompts)
    plan = plan_sequences(tokenize_prompts(source, texts, vocab), seq_len)
    runs: dict[SamplingSettings | None, TargetRun] = {}
    for s in settings:
        key = None if s.greedy else s
        if key not in runs:
            label = "held-out" if key is None else f"held-out {s.label}"
            runs[key] = capture(target, plan, label=label, progress=progress, batch_size=batch_size, sampling=key)
    return tuple(HeldOut(s, runs[None if s.greedy else s]) for s in settings)


def check(
    before: CheckpointWeights,
    after: CheckpointWeights,
    held_out: Sequence[HeldOut],
    shared: tuple[Tensor, Tensor],
    *,
    activations: str,
    k: int,
    rule: str = "vllm",
    decision: HealRule = SERVED,
) -> CheckResult:
    """QUANT's MTP (``before``) and the healed one as written (``after``) measured on each held-out run (one per
    sampling setting, ``held_out_runs``; a sampled run verified by ``rule`` with the target's head, ``shared``'s),
    each sequence a unit, for k = 1..``k``; then compared.

    The check is heal's last phase and must not raise its peak memory above training's: it uses training's
    embedding and LM head (``shared``; reading them again takes twice their size for a moment, 2.5 GB on
    Qwen3.5-4B) and loads one MTP at a time.
    """
    embed, head = shared
    counts: list[list[list[UnitCounts]]] = []  # [MTP][run] -> per k
    for label, weights in (("QUANT's", before), ("the healed", after)):
        bundle, err = load_mtp(weights, dtype=embed.dtype, device=embed.device, activations=activations,
                               shared=(embed, head))
        if bundle is None:
            raise OutputVerificationError(f"{label} MTP does not load for evaluation: {err}")
        counts.append([
            evaluate_acceptance(bundle, h.run, k, progress=False, sampling=None if h.sampling.greedy else h.sampling,
                                rule=rule, target_head=head).units
            for h in held_out
        ])
        del bundle
        gc.collect()
    return compare(counts[0], counts[1], held_out, rule, decision)


def compare(
    before: Sequence[Sequence[UnitCounts]], after: Sequence[Sequence[UnitCounts]], held_out: Sequence[HeldOut],
    rule: str = "vllm",
    decision: HealRule = SERVED,
) -> CheckResult:
    """The check's result from the per-k counts of QUANT's MTP and the healed one at each setting of ``held_out``."""
    settings = []
    for b_run, a_run, h in zip(before, after, held_out):
        changes = []
        for k, (b, a) in enumerate(zip(b_run, a_run), 1):
            better, change = better_beyond_noise(b, a)
            changes.append(
                AlChange(k, b.mean_acceptance_length, a.mean_acceptance_length, change.low, change.high, better)
            )
        settings.append(SettingCheck(h.sampling, tuple(changes), decision))
    first = held_out[0].run
    return CheckResult(len(first.sequences), first.num_tokens, tuple(settings), rule, decision)
