"""Hub publishing (``mtpquant publish``): ``card`` builds the model card, ``files`` lists what OUT
uploads (and refuses private strings), ``publish`` gates and uploads.

The entry point is ``mtpquant.hub.publish.publish(PublishOptions) -> PublishResult``. It is not re-exported
here: a package attribute named ``publish`` would shadow the ``mtpquant.hub.publish`` module.
"""

from __future__ import annotations

from mtpquant.hub.card import build_card, card_origin, validate_card_metadata
from mtpquant.hub.files import PublishFile
from mtpquant.hub.publish import (
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
