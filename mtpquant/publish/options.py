"""``mtpquant publish``'s options, as one frozen record."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mtpquant.records.record import FLAG, Options

__all__ = ["PublishOptions"]


@dataclass(frozen=True)
class PublishOptions(Options):
    """One ``mtpquant publish`` invocation."""

    out: Path
    repo: str
    private: bool = False
    revision: str | None = None  # branch to commit to (created from main when missing) or refs/pr/N
    create_pr: bool = False
    commit_message: str | None = None
    dry_run: bool = False
    force: bool = False
    overwrite_card: bool = False
    token: str | None = field(default=None, repr=False, metadata={FLAG: None})  # None: huggingface_hub's own
    endpoint: str | None = None  # None: HF_ENDPOINT read at call time, else huggingface_hub's default
    base_model: str | None = None  # the Hub id of the base model, recorded in OUT's provenance and the card
    base_model_revision: str | None = None
    command: tuple[str, ...] = field(default=(), metadata={FLAG: None})  # the command line (the CLI sets it)
