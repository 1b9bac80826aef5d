"""The search with ``--heal`` (``convert --mtp auto --heal``, ``tune-mtp --heal``): each finalist healed before it
is confirmed, so the budget is met by the healed MTP that is written (torch-free: the records, the healer's
interface).

The finalists (``decide.finalists``) are few: the smallest configurations the engines load that were not beyond the
budget on the selection prompts (heal may bring an inconclusive one within), smallest first, at most ``finalists``.
The healer is heal's (``heal.finalists.FinalistHealer``; the API hands it to convert and tune-mtp, which import no
other command): it collects its training data from the quantized target while the search holds it (the target runs
once; its files inside OUT's partial directory), then trains each finalist from the BF16 MTP with every quantized
Linear fake-quantized in its own format and input scale (``heal.train.train_layer``). Each healed MTP is confirmed on
the held-out confirmation prompts like any finalist (Holm's procedure); the smallest confirmed one is chosen (the BF16
MTP when none is) and written healed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mtpquant.records.record import Record
from mtpquant.search.space import Assignment

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.formats.kinds import StorageKind

__all__ = ["HealSettings", "HealedFinalist", "Healer", "Training"]


@dataclass(frozen=True)
class HealSettings(Record):
    """How each finalist is healed: heal's data and schedule."""

    data: str  # the calibration text the prompts come from (public: a local file by its base name)
    samples: int  # prompts the target continues
    prompt_len: int
    new_tokens: int
    steps: int
    lr: float
    batch_size: int
    chain: int
    seed: int


@dataclass(frozen=True)
class Training(Record):
    """How one finalist's training went: the distillation loss at its start and end, its time."""

    first_loss: float
    last_loss: float
    seconds: float


@dataclass(frozen=True)
class HealedFinalist(Record):
    """One finalist: its configuration, its rows in the report before and after heal (indices into ``evaluated``),
    its training."""

    assignment: Assignment
    before: int
    after: int
    training: Training


@runtime_checkable
class Healer(Protocol):
    """What the search asks of heal (``heal.finalists.FinalistHealer``)."""

    @property
    def settings(self) -> HealSettings:
        """How it heals (for the report)."""
        ...

    def collect(self, target: Any, source: CheckpointSource, vocab: int, scratch: Path) -> None:
        """Its training data from the quantized ``target`` (``measure.target.TargetModel``), prompts tokenized with
        ``source``'s tokenizer of ``vocab`` entries, any file of it under ``scratch`` (a directory to create, inside
        OUT's partial directory; the search removes it when done); called once, while the search holds the target."""
        ...

    def heal(
        self,
        config: Mapping[str, object],
        master: dict[str, Tensor],
        kinds: Mapping[str, StorageKind],
        input_scales: Mapping[str, float],
        *,
        shared: tuple[Tensor, Tensor],
        device: Any,
    ) -> tuple[dict[str, Tensor], Training]:
        """The MTP weights ``master`` (float32, checkpoint names) healed with each Linear of ``kinds`` (module -> its
        storage kind, NVFP4 or FP8) fake-quantized in it (``input_scales``: module -> its input scale; empty: weights
        only), against the embedding and LM head ``shared``: the healed float32 weights by checkpoint name."""
        ...
