"""``mtpquant publish``: ``card`` builds the model card, ``files`` lists what OUT uploads (and refuses private
strings), ``run`` gates and uploads (``run.publish(PublishOptions) -> PublishResult``)."""

from __future__ import annotations

from mtpquant.publish.card import build_card, card_origin, validate_card_metadata
from mtpquant.publish.files import PublishFile
from mtpquant.publish.run import (
    PublishOptions,
    PublishRefusedError,
    PublishResult,
    PublishUsageError,
    UploadError,
)

__all__ = [
    "PublishFile",
    "PublishOptions",
    "PublishRefusedError",
    "PublishResult",
    "PublishUsageError",
    "UploadError",
    "build_card",
    "card_origin",
    "validate_card_metadata",
]
