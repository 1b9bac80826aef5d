"""``mtpquant tune-mtp``'s options, as one frozen record (torch-free: the CLI reads its defaults at start-up)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Ge

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from mtpquant.records.record import FLAG, Options
from mtpquant.search.finalists import Healer
from mtpquant.search.settings import SearchSettings

__all__ = ["TuneOptions"]


@dataclass(frozen=True)
class TuneOptions(Options):
    """Everything ``tune-mtp`` takes: QUANT (local), SRC (its BF16 source, local or a Hub repo), where the result goes,
    what the search is asked, the recipe whose exclusions the MTP keeps and whose calibration sets its input scales
    (``recipe``; None: QUANT's recipe, else the family's default recipe), that calibration's overrides."""

    quant: str | os.PathLike[str]
    source: str | os.PathLike[str] = field(metadata={FLAG: "--from"})
    out: str | os.PathLike[str] | None = None
    in_place: bool = False
    search: SearchSettings = field(default_factory=SearchSettings, metadata={FLAG: None})
    recipe: str | None = None  # the recipe QUANT is held to (None: QUANT's recipe.yaml, else the family's default)
    calib_data: str | None = None
    calib_samples: Annotated[int, Ge(1)] | None = None
    calib_seq_len: Annotated[int, Ge(2)] | None = None
    device: Literal["cpu", "cuda", "auto"] | str = "auto"
    max_memory: str | None = None  # caps of the quantized target the search measures on, e.g. "cpu=8GiB"
    source_revision: str | None = field(default=None, metadata={FLAG: "--from-revision"})
    max_shard_bytes: Annotated[int, Ge(1)] = field(default=DEFAULT_MAX_SHARD_BYTES, metadata={FLAG: "--max-shard-size"})
    link: bool = field(default=True, metadata={FLAG: "--copy"})  # hard-link untouched files (False: copy them)
    dry_run: bool = False
    progress: bool = field(default=True, metadata={FLAG: None})
    command: tuple[str, ...] = field(default=(), metadata={FLAG: None})  # the command line (the CLI sets it)
    # --heal (``api.tune_and_heal``): heal's training of the search's finalists, each healed before the choice
    # (``search.finalists.Healer``; tune-mtp imports no other command, so the caller hands it in)
    healer: Healer | None = field(default=None, metadata={FLAG: None})

    @property
    def out_path(self) -> Path | None:
        """``--out`` as a path (None: in place)."""
        return Path(self.out).expanduser() if self.out is not None else None
