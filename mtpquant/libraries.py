"""What the libraries mtpquant drives show while they work: their log messages and their progress bars.

transformers logs to stderr through a handler of its own, outside Python logging's configuration, so its
messages ignore ``-q``; and some of them read like failures though they describe what mtpquant does on
purpose: a calibration document longer than the model's context (calibration cuts the token stream into
rows), the CPU fallback of the linear-attention kernels, a deprecated config attribute modelopt's export
reads. ``library_output`` routes transformers' records through Python logging for the length of a block
(those at DEBUG, every other at its own level, all under the caller's ``-q`` / ``-v``) and turns
transformers' and huggingface_hub's progress bars off when asked. Everything is put back on exit, so a
program that embeds mtpquant keeps its own settings.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

__all__ = ["ON_PURPOSE", "library_output"]

# transformers' messages about what mtpquant does on purpose: logged at DEBUG (``-vv``).
ON_PURPOSE = (
    re.compile(r"Token indices sequence length is longer than the specified maximum sequence length"),
    re.compile(r"The fast path is not available because one of the required library is not installed"),
    re.compile(r"`torch_dtype` is deprecated! Use `dtype` instead!"),
)


class _Forward(logging.Handler):
    """Hands transformers' records to the root logger's handlers, those in ``ON_PURPOSE`` at DEBUG."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(p.search(message) for p in ON_PURPOSE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        root = logging.getLogger()
        if root.isEnabledFor(record.levelno):
            root.handle(record)


@contextlib.contextmanager
def library_output(progress: bool) -> Iterator[None]:
    """transformers' log records through Python logging, and (``progress`` False) no transformers or
    huggingface_hub progress bars, for the block."""
    import huggingface_hub.utils as hf_utils
    import transformers.utils.logging as tf_logging

    logger = logging.getLogger("transformers")
    outer = any(isinstance(h, _Forward) for h in logger.handlers)  # an enclosing block routes already
    tf_bars = tf_logging.is_progress_bar_enabled()
    hf_bars = not hf_utils.are_progress_bars_disabled()
    forward = _Forward()
    if not outer:
        tf_logging.disable_default_handler()
        logger.addHandler(forward)
    if not progress:
        tf_logging.disable_progress_bar()
        hf_utils.disable_progress_bars()
    try:
        yield
    finally:
        if not outer:
            logger.removeHandler(forward)
            tf_logging.enable_default_handler()
        if tf_bars:
            tf_logging.enable_progress_bar()
        if hf_bars:
            hf_utils.enable_progress_bars()
