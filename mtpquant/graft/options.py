"""``mtpquant graft``'s options, as one frozen record (torch-free)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Annotated

from annotated_types import Ge

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from mtpquant.records.record import FLAG, Options

__all__ = ["GraftOptions"]


@dataclass(frozen=True)
class GraftOptions(Options):
    """Everything ``mtpquant graft`` takes; the CLI builds one of these and calls ``graft``."""

    quant: str | os.PathLike[str]
    # SRC: a directory or Hub repo id (None with fix_metadata)
    source: str | os.PathLike[str] | None = field(default=None, metadata={FLAG: "--from"})
    out: str | os.PathLike[str] | None = None
    in_place: bool = False
    replace: bool = False
    fix_metadata: bool = False
    revision: str | None = None  # QUANT's Hub revision
    source_revision: str | None = field(default=None, metadata={FLAG: "--from-revision"})  # SRC's Hub revision
    token: str | None = field(default=None, repr=False, metadata={FLAG: None})
    max_shard_bytes: Annotated[int, Ge(1)] = field(default=DEFAULT_MAX_SHARD_BYTES, metadata={FLAG: "--max-shard-size"})
    link: bool = field(default=True, metadata={FLAG: "--copy"})  # hard-link untouched files (False: copy them)
    dry_run: bool = False
    command: tuple[str, ...] = field(default=(), metadata={FLAG: None})  # the command line (the CLI sets it)
