"""mtpquant: NVFP4 quantization of Qwen checkpoints that keeps their Multi-Token-Prediction layer."""

from __future__ import annotations

import logging

__version__ = "0.1.0"
__all__ = ["__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
