"""``mtpquant graft``'s options, as one frozen object (torch-free)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES

__all__ = ["GraftOptions"]


@dataclass(frozen=True)
class GraftOptions:
    """Everything ``mtpquant graft`` takes; the CLI builds one of these and calls ``graft``."""

    quant: str | os.PathLike[str]
    source: str | os.PathLike[str] | None = None  # SRC: a directory or Hub repo id (None with fix_metadata)
    out: str | os.PathLike[str] | None = None
    in_place: bool = False
    replace: bool = False
    fix_metadata: bool = False
    revision: str | None = None  # QUANT's Hub revision
    source_revision: str | None = None  # SRC's Hub revision
    token: str | None = field(default=None, repr=False)
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    link: bool = True  # hard-link untouched files (False: copy them)
    dry_run: bool = False
    command: tuple[str, ...] = ()  # the command line, recorded in the provenance file (the CLI sets it)
