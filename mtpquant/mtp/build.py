"""The reference MTP of a checkpoint, whichever family: ``MtpLayer`` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next),
``Qwen4ExpMtp`` (Qwen3.8-Flash-Next) or ``NextnMtp`` (the appended-layer families: GLM-4.5, DeepSeek-V3), built from
its MTP tensors for calibration (convert ``--mtp quantize``) and validation. The family's registry entry says which
forward it has (``Family.mtp_forward``, ``MtpLayout.appended``) and what it reads; ``families.check_mtp_forward``
refuses, before anything loads, what a forward cannot compute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from mtpquant.families import ModelSpec, check_mtp_forward, mtp_config, resolve
from mtpquant.mtp.module import MtpLayer, check_mtp_tensors
from mtpquant.mtp.quantize import fuse_mtp_experts
from mtpquant.mtp.step import MtpForward

__all__ = ["reference_mtp"]

_Builder = Callable[[ModelSpec, Mapping[str, Any], Mapping[str, Tensor], Any, Any], MtpForward]


def _qwen3(spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any) -> Any:
    del spec
    return MtpLayer.from_state_dict(mtp_config(config), tensors, dtype=dtype, device=device)


def _qwen4_exp(
    spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any
) -> Any:
    from mtpquant.mtp.qwen4_exp import Qwen4ExpMtp

    mtp_config(config)  # the plan-time refusals, again where a caller skipped the plan
    check_mtp_tensors(spec.expected_mtp_shapes(tensors), tensors)
    text = spec.text
    share = bool(text.get("index_share_for_mtp_iteration", False))
    fused = fuse_mtp_experts(tensors, spec.num_experts)
    return Qwen4ExpMtp.from_state_dict(text, spec.mtp.layers, fused, index_share=share, dtype=dtype, device=device)


def _nextn(spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any) -> Any:
    from mtpquant.mtp.nextn import NextnMtp

    check_mtp_forward(config)
    root = spec.appended_prefix(tensors) + "layers."
    expected = spec.expected_mtp_shapes(tensors)
    forward = spec.family.mtp.appended
    return NextnMtp.from_state_dict(
        spec.text, forward, spec.mtp.layers, root, spec.mtp_names.first, expected, tensors, dtype=dtype, device=device
    )


def _nemotron_h(
    spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any
) -> Any:
    from mtpquant.mtp.nemotron_h import NemotronHMtp

    del config
    check_mtp_tensors(spec.expected_mtp_shapes(tensors), tensors)
    return NemotronHMtp.from_state_dict(spec.text, spec.mtp.layers, tensors, dtype=dtype, device=device)


# The reference forward of each family that has one (Family.mtp_forward); the appended-layer one for the families
# whose layout says how it computes (MtpLayout.appended); the Qwen3 forward by default.
_BUILDERS: dict[str, _Builder] = {"qwen4_exp": _qwen4_exp, "nemotron_h": _nemotron_h}


def reference_mtp(
    config: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MtpForward:
    """The family's reference MTP with the checkpoint's MTP tensors (names and shapes checked; MtpLayoutError
    names what does not fit, MtpConfigError what the forward cannot compute)."""
    spec = resolve(config)
    if spec.family.mtp.appended is not None:
        return _nextn(spec, config, tensors, dtype, device)
    return _BUILDERS.get(spec.family.key, _qwen3)(spec, config, tensors, dtype, device)
