"""``mtpquant convert``'s options, as one frozen record (torch-free: the CLI reads its defaults and choices at
start-up). ``None`` leaves a value to the recipe."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Ge

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.records.record import FLAG, Options
from mtpquant.search.finalists import Healer
from mtpquant.search.settings import SearchSettings

__all__ = ["ConvertOptions"]

Positive = Annotated[int, Ge(1)]


@dataclass(frozen=True)
class ConvertOptions(Options):
    """Everything ``convert`` needs; the CLI builds one from its flags (None: take the recipe's value)."""

    src: str | os.PathLike[str]
    out: Path | str
    recipe: str | None = None
    # None: the recipe's (its default keeps the MTP when SRC has one); auto: the precision search (a recipe's search)
    mtp: Literal["keep", "quantize", "extract", "drop", "auto"] | None = None
    mtp_format: Literal["nvfp4", "fp8"] | None = None  # quantize mode
    mtp_out: Path | str | None = None  # extract mode; default OUT-mtp
    calib_data: str | None = None  # offline | file | datasets name
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    device: Literal["cpu", "cuda", "auto"] = "auto"  # cuda: accelerate spreads the model over every GPU
    max_memory: str | None = None  # per-device caps, e.g. "cpu=8GiB" or "cuda:0=70GiB,cpu=200GiB"
    layerwise: bool = False  # calibrate layer by layer (resumable) even when the model fits in memory
    resume_every: Positive | None = None  # layer-wise: commit the resume state every N layers (None: as it suits)
    max_shard_size: str | int | None = None
    overrides: tuple[str, ...] = field(default=(), metadata={FLAG: "--set"})  # section.key=value
    dry_run: bool = False
    overwrite: bool = False
    revision: str | None = None
    progress: bool = field(default=True, metadata={FLAG: None})
    command: tuple[str, ...] = field(default=(), metadata={FLAG: None})  # the command line (the CLI sets it)
    base_model: str | None = None  # the Hub id of the base model (SRC is a local copy of it), for the card
    base_model_revision: str | None = None
    output_format: Literal["modelopt", "compressed-tensors"] = field(default="modelopt", metadata={FLAG: "--format"})
    # --mtp auto: the budget, the engines, the precisions tried and how acceptance is measured (--al-budget, --engine,
    # --mtp-precisions, --search-prompts set its fields)
    search: SearchSettings = field(default_factory=SearchSettings, metadata={FLAG: None})
    # A check the caller adds to the plan, called with SRC (headers) and the MTP mode once both are known and before
    # transformers loads: ``convert --heal`` (``api.convert_and_heal``) refuses there what heal would refuse on OUT.
    plan_check: Callable[[Checkpoint, str], None] | None = field(default=None, metadata={FLAG: None})
    # --mtp auto --heal (``api.convert_and_heal``): heal's training of the search's finalists, each healed before the
    # choice (``search.finalists.Healer``; convert imports no other command, so the caller hands it in)
    healer: Healer | None = field(default=None, metadata={FLAG: None})
