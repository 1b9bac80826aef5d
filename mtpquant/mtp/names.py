"""A reference MTP's parameter and module names as the checkpoint names them, whatever the family.

Qwen's forwards (``module.MtpLayer``, ``qwen4_exp.Qwen4ExpMtp``) name every parameter as its checkpoint tensor less the
``mtp.`` namespace; an appended-layer MTP (``nextn.NextnMtp``: transformers' ``MtpLayer`` nesting the block under
``mtp_block``) maps its names itself (``checkpoint_name`` / ``parameter_name``). Calibration, quantization, activation
emulation, training and heal's write-back name tensors through here.
"""

from __future__ import annotations

from typing import Any

from mtpquant.families import MTP_PREFIX

__all__ = ["checkpoint_name", "module_name"]


def checkpoint_name(layer: Any, name: str) -> str:
    """The checkpoint's name of ``layer``'s parameter or module ``name``."""
    rename = getattr(layer, "checkpoint_name", None)
    return MTP_PREFIX + name if rename is None else str(rename(name))


def module_name(layer: Any, checkpoint: str) -> str:
    """``layer``'s name of the MTP tensor or module the checkpoint calls ``checkpoint``."""
    rename = getattr(layer, "parameter_name", None)
    return checkpoint.removeprefix(MTP_PREFIX) if rename is None else str(rename(checkpoint))
