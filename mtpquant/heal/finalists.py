"""heal's training for the precision search's finalists (``convert --mtp auto --heal``, ``tune-mtp --heal``).

``FinalistHealer`` is the search's ``Healer`` (``search.finalists``): the quantized target continues heal's training
prompts once, while the search holds it (``data.training_data``, in shards in the scratch directory the search gives
it, inside OUT's partial directory, so a kill leaves nothing the next run's clean-up does not find; removed when the
healer closes); each finalist then trains from the BF16 MTP as heal trains a quantized MTP
(``train.train_layer``: modelopt's fake quantization on each quantized Linear in its own format, NVFP4 or FP8, with
the input scale the output will carry; self-distillation on the target's distributions), with the same schedule and
seed, so a run is deterministic with its seed. The held-out before/after check is the search's own measurement.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from mtpquant.heal.options import HealOptions
from mtpquant.heal.plan import Schedule
from mtpquant.heal.precision import MtpStorage
from mtpquant.public import public_text
from mtpquant.search.finalists import HealSettings, Training

if TYPE_CHECKING:
    from torch import Tensor

    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.formats.kinds import StorageKind
    from mtpquant.heal.data import HealData

__all__ = ["FinalistHealer"]

log = logging.getLogger(__name__)


class FinalistHealer:
    """Heals the search's finalists with ``options``' data and schedule (the fields ``convert --heal-*`` set);
    its scratch data lives where ``collect`` is told (inside OUT's partial directory) while it is open."""

    def __init__(self, options: HealOptions) -> None:
        self.options = options
        sizes = options.sizes
        self.schedule = Schedule(options.steps, options.lr, sizes.batch_size, options.chain, options.seed)
        self.scratch: Path | None = None
        self.data: HealData | None = None

    def __enter__(self) -> FinalistHealer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Remove the training data."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch, self.data = None, None

    @property
    def settings(self) -> HealSettings:
        """How each finalist is healed."""
        o, t = self.options, self.schedule
        return HealSettings(public_text(o.data), o.samples, o.sizes.prompt_len, o.sizes.new_tokens, t.steps, t.lr,
                            t.batch_size, t.chain, t.seed)  # fmt: skip

    def collect(self, target: Any, source: CheckpointSource, vocab: int, scratch: Path) -> None:
        """The training data: heal's prompts continued by the quantized ``target``, with its hidden states, in shards
        under ``scratch`` (a new directory)."""
        from mtpquant.heal.data import training_data

        o = self.options
        scratch.mkdir(parents=True)
        self.scratch = scratch
        self.data = training_data(target, source, vocab, o.data, o.samples, o.sizes, temperature=o.data_temperature,
                                  seed=o.seed, directory=self.scratch, progress=o.progress)  # fmt: skip

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
        """One finalist healed (``search.finalists.Healer.heal``)."""
        from mtpquant.heal.train import train_layer

        if self.data is None:
            raise RuntimeError("internal: a finalist healed before the training data was collected")
        storage = MtpStorage(dict(kinds), bool(input_scales), dict(input_scales))
        log.info("heal: a finalist, %s", storage.label)
        weights, trained = train_layer(dict(config), master, storage, self.data, shared, self.schedule, device=device,
                                       progress=self.options.progress)  # fmt: skip
        return weights, Training(trained.first_loss, trained.last_loss, trained.seconds)
