"""What the precision search is asked (torch-free: convert's and tune-mtp's options hold one; the CLI reads its
defaults and choices)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from annotated_types import Ge, Interval, Le

from mtpquant.measure import Activations
from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.space import PRECISIONS, EngineChoice, Precision, engines_of

__all__ = ["SearchSettings"]


@dataclass(frozen=True)
class SearchSettings(Record):
    """The budget, the engines, the precisions tried and how acceptance is measured."""

    budget: Annotated[float, Ge(0)] = 0.05  # AL the MTP may lose against the BF16 MTP's, at every k and setting
    engine: EngineChoice = "vllm"  # the engines that must load the result (any: all of them)
    precisions: tuple[Precision, ...] = PRECISIONS  # type: ignore[assignment]  # what a group may take (bf16 always)
    k: Annotated[int, Ge(1), Le(8)] = 3  # AL at k = 1..k
    temperatures: tuple[Annotated[float, Ge(0)], ...] = (0.0,)  # sampling settings measured (0: greedy)
    num_prompts: Annotated[int, Ge(5)] = 64  # held-out prompts the selection measures on (each a bootstrap unit)
    confirm_prompts: Annotated[int, Ge(5)] = 64  # other held-out prompts, never selected on, that confirm finalists
    max_len: Annotated[int, Ge(8)] = 128  # tokens per sequence: the prompt (at most half) and the continuation
    activations: Activations = "emulate"  # the target's and the MTP's activations quantized as the engines do
    seed: int = 0  # sampled continuations and the bootstrap's resampling plan
    confidence: Annotated[float, Interval(ge=0.5, lt=1)] = 0.95  # 1 - the family-wise error over the finalists
    max_confirm: Annotated[int, Ge(0)] = 3  # combinations measured after the groups alone (selection)
    finalists: Annotated[int, Ge(1)] = 3  # configurations confirmed on the held-out prompts (Holm over them)
    batch_size: Annotated[int, Ge(1)] = 16

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines a configuration must load in."""
        return engines_of(self.engine)

    @property
    def sampling(self) -> tuple[SamplingSettings, ...]:
        """Greedy first, then every other temperature given, each seeded with ``seed``."""
        temps = [0.0, *(t for t in self.temperatures if t > 0)]
        return tuple(SamplingSettings(t, seed=self.seed) for t in dict.fromkeys(temps))
