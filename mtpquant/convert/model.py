"""The main (language) model through transformers and nvidia-modelopt: load, calibrate, export.

Loading uses the family's transformers class. ``device="cpu"`` keeps every weight in host memory;
``device="cuda"`` uses accelerate's ``device_map="auto"`` (GPU sharding with CPU and disk offload for
what does not fit), which is also the scale-out path: modelopt calibrates through accelerate's hooks
and ``export_hf_checkpoint`` switches to its streaming writer (one layer at a time) for offloaded
models. modelopt prints progress to stdout; here that text goes to the debug log instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mtpquant.families import ModelSpec

__all__ = [
    "base_model",
    "export_quantized",
    "input_device",
    "library_progress",
    "load_main_model",
    "modelopt_quiet",
    "quantize_main_model",
    "source_dtype",
]

log = logging.getLogger(__name__)


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
def library_progress(enabled: bool) -> Iterator[None]:
    """transformers' and huggingface_hub's own progress bars on or off for the block (restored after)."""
    if enabled:
        yield
        return
    import huggingface_hub.utils as hf_utils
    import transformers.utils.logging as tf_logging

    tf_was = tf_logging.is_progress_bar_enabled()
    hf_was = not hf_utils.are_progress_bars_disabled()
    tf_logging.disable_progress_bar()
    hf_utils.disable_progress_bars()
    try:
        yield
    finally:
        if tf_was:
            tf_logging.enable_progress_bar()
        if hf_was:
            hf_utils.enable_progress_bars()


@contextlib.contextmanager
def modelopt_quiet() -> Iterator[None]:
    """Send what modelopt prints to the debug log (library code never prints)."""
    writer = _LogWriter(logging.getLogger("mtpquant.modelopt"))
    with contextlib.redirect_stdout(writer):
        yield
    writer.flush()


def source_dtype(spec: ModelSpec) -> torch.dtype:
    """The dtype the source declares (``dtype`` / ``torch_dtype``), bfloat16 by default."""
    for cfg in (spec.config, spec.text):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if value in {"float16", "bfloat16", "float32"}:
            dtype: torch.dtype = getattr(torch, str(value))
            return dtype
    return torch.bfloat16


def load_main_model(src: Path, spec: ModelSpec, device: str, offload_dir: Path | None) -> Any:
    """Load the main model with the family's transformers class (MTP tensors are skipped by it)."""
    import transformers

    cls = getattr(transformers, spec.architecture)
    kwargs: dict[str, Any] = {"dtype": source_dtype(spec)}
    if device == "cuda":
        kwargs["device_map"] = "auto"
        if offload_dir is not None:
            offload_dir.mkdir(parents=True, exist_ok=True)
            kwargs["offload_folder"] = str(offload_dir)
    with modelopt_quiet():
        # the supported families never need remote code: never run code shipped with a checkpoint
        model = cls.from_pretrained(str(src), trust_remote_code=False, **kwargs)
    model.eval()
    model.requires_grad_(False)
    return model


def base_model(model: Any) -> Any:
    """The decoder stack whose ``last_hidden_state`` is the post-final-norm hidden state."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise TypeError(f"{type(model).__name__} has no .model decoder")
    return inner


def input_device(model: Any) -> torch.device:
    """Where calibration token ids go (accelerate's hooks move them on from there)."""
    emb = model.get_input_embeddings()
    dev = emb.weight.device
    if dev.type == "meta":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    return dev


def quantize_main_model(model: Any, quant_cfg: dict[str, Any], forward_loop: Callable[[Any], None]) -> Any:
    """``mtq.quantize`` with the recipe's config and the calibration forward loop."""
    import modelopt.torch.quantization as mtq

    with modelopt_quiet(), torch.no_grad():
        return mtq.quantize(model, quant_cfg, forward_loop)


def export_quantized(model: Any, export_dir: Path, dtype: torch.dtype) -> None:
    """``export_hf_checkpoint`` into ``export_dir`` (streaming for offloaded models)."""
    from modelopt.torch.export import export_hf_checkpoint

    with modelopt_quiet():
        export_hf_checkpoint(model, dtype=dtype, export_dir=str(export_dir))
