"""What the libraries mtpquant drives show while they work: their log messages and their progress bars.

transformers logs to stderr through a handler of its own, outside Python logging's configuration, and modelopt
warns through Python's ``warnings``, so their messages ignore ``-q``; and some of them read like failures though
they describe what mtpquant does on purpose: a calibration document longer than the model's context (calibration
cuts the token stream into rows), the CPU fallback of the linear-attention kernels, a deprecated config attribute
modelopt's export reads, modelopt's export keeping per-expert names it cannot map back to a fused source layout.
``library_output`` routes transformers' records and the Python warnings raised in a block through Python logging
(those in ``ON_PURPOSE`` at its level, every other at its own, all under the caller's ``-q`` / ``-v``) and turns
transformers' and huggingface_hub's progress bars off when asked. Everything is put back on exit, so a program
that embeds mtpquant keeps its own settings.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["ON_PURPOSE", "import_libraries", "library_output", "modelopt_quiet"]

log = logging.getLogger(__name__)

# The libraries' messages about what mtpquant does on purpose, and the level they are logged at instead.
ON_PURPOSE: tuple[tuple[re.Pattern[str], int], ...] = (
    # calibration tokenises whole documents and cuts the stream into rows itself
    (re.compile(r"Token indices sequence length is longer than the specified maximum sequence length"), logging.DEBUG),
    # modelopt's export reads the config's old attribute name
    (re.compile(r"`torch_dtype` is deprecated! Use `dtype` instead!"), logging.DEBUG),
    # transformers is pinned past the versions nvidia-modelopt names (pyproject.toml says why)
    (re.compile(r"transformers \S+ is not tested with current version of modelopt"), logging.DEBUG),
    # the linear-attention kernels' PyTorch fallback (always so on CPU): slower, not wrong
    (re.compile(r"The fast path is not available because one of the required library is not installed"), logging.INFO),
    (re.compile(r"is falling back to its reference PyTorch implementation"), logging.INFO),
    # modelopt's export cannot map per-expert NVFP4 names back to a fused source layout (qwen4_exp's experts):
    # per-expert names are what vLLM loads, and convert verifies its output (exact MTP and vision sets, inspect)
    (re.compile(r"exported tensor names may not match the original HF hub checkpoint"), logging.INFO),
)


def _level(message: str, level: int) -> int:
    return next((to for pattern, to in ON_PURPOSE if pattern.search(message)), level)


class _Forward(logging.Handler):
    """Hands transformers' records to the root logger's handlers, those in ``ON_PURPOSE`` at their level."""

    def emit(self, record: logging.LogRecord) -> None:
        level = _level(record.getMessage(), record.levelno)
        if level != record.levelno:  # a copy: other handlers of the logger keep the record as it was
            name = logging.getLevelName(level)
            record = logging.makeLogRecord({**record.__dict__, "levelno": level, "levelname": name})
        root = logging.getLogger()
        if root.isEnabledFor(record.levelno):
            root.handle(record)


def _show_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """``warnings.showwarning`` in a ``library_output`` block: the warning as a log record of ``py.warnings`` (the
    logger ``logging.captureWarnings`` uses), at its ``ON_PURPOSE`` level or WARNING."""
    del filename, lineno, file, line  # where in the library: not what a user acts on
    text = str(message)
    logging.getLogger("py.warnings").log(_level(text, logging.WARNING), "%s: %s", category.__name__, text)


def import_libraries(*names: str) -> None:
    """Import modules; the Python warnings they raise on import that ``ON_PURPOSE`` names are logged at its level
    instead, the others warned again."""
    import importlib
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in names:
            importlib.import_module(name)
    for w in caught:
        level = _level(str(w.message), logging.WARNING)
        if level == logging.WARNING:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            log.log(level, "%s: %s", w.category.__name__, w.message)


@contextlib.contextmanager
def library_output(progress: bool) -> Iterator[None]:
    """transformers' log records and Python warnings through Python logging, and (``progress`` False) no
    transformers or huggingface_hub progress bars, for the block."""
    import warnings

    import huggingface_hub.utils as hf_utils
    import transformers.utils.logging as tf_logging

    logger = logging.getLogger("transformers")
    outer = any(isinstance(h, _Forward) for h in logger.handlers)  # an enclosing block routes already
    propagate = logger.propagate  # transformers propagates when the environment says CI=1
    tf_bars = tf_logging.is_progress_bar_enabled()
    hf_bars = not hf_utils.are_progress_bars_disabled()
    forward = _Forward()
    show = warnings.showwarning
    warnings.showwarning = _show_warning
    if not outer:
        tf_logging.disable_default_handler()
        logger.addHandler(forward)
        logger.propagate = False  # _Forward hands each record on once, at its level
    if not progress:
        tf_logging.disable_progress_bar()
        hf_utils.disable_progress_bars()
    try:
        yield
    finally:
        warnings.showwarning = show
        if not outer:
            logger.removeHandler(forward)
            logger.propagate = propagate
            tf_logging.enable_default_handler()
        if tf_bars:
            tf_logging.enable_progress_bar()
        if hf_bars:
            hf_utils.enable_progress_bars()


class _LogWriter(io.TextIOBase):
    """A text stream that forwards complete lines to a logger at DEBUG."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._buf = ""

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.strip():
                self._logger.debug("modelopt: %s", line.strip())
        return len(s)

    def flush(self) -> None:
        if self._buf.strip():
            self._logger.debug("modelopt: %s", self._buf.strip())
        self._buf = ""


@contextlib.contextmanager
def modelopt_quiet(progress: bool = True) -> Iterator[None]:
    """Send what modelopt prints to the debug log (library code never prints); without ``progress``, its
    progress bars (stderr) too."""
    writer = _LogWriter(logging.getLogger("mtpquant.modelopt"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(writer))
        if not progress:
            stack.enter_context(contextlib.redirect_stderr(writer))
        yield
    writer.flush()
