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

    return _appended(NextnMtp, spec, config, tensors, dtype, device)


def _step3p5(spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any) -> Any:
    from mtpquant.mtp.step3p5 import Step3p5Mtp

    return _appended(Step3p5Mtp, spec, config, tensors, dtype, device)


def _mimo_v2(spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any) -> Any:
    from mtpquant.mtp.mimo_v2 import VLLM_LAYERS, MimoV2Mtp

    check_mtp_forward(config)
    root = spec.mtp_names.roots[0]
    depth = min(spec.mtp.layers, VLLM_LAYERS)  # vLLM builds (and drafts with) the first layer only
    read = {n: tensors[n] for n in tensors if (d := spec.mtp_names.depth_of(n)) is not None and d < depth}
    expected = {n: s for n, s in spec.expected_mtp_shapes(tensors).items() if n in read}
    return MimoV2Mtp.from_state_dict(spec.text, spec.family.mtp.appended, depth, root, 0, expected, read, dtype=dtype,
                                     device=device)  # fmt: skip


def _appended(cls: Any, spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any,
              device: Any) -> Any:
    check_mtp_forward(config)
    root = spec.appended_prefix(tensors) + "layers."
    expected = spec.expected_mtp_shapes(tensors)
    forward = spec.family.mtp.appended
    return cls.from_state_dict(
        spec.text, forward, spec.mtp.layers, root, spec.mtp_names.first, expected, tensors, dtype=dtype, device=device
    )


def _nemotron_h(
    spec: ModelSpec, config: Mapping[str, Any], tensors: Mapping[str, Tensor], dtype: Any, device: Any
) -> Any:
    from mtpquant.mtp.nemotron_h import NemotronHMtp

    del config
    check_mtp_tensors(spec.expected_mtp_shapes(tensors), tensors)
    return NemotronHMtp.from_state_dict(spec.text, spec.mtp.layers, tensors, dtype=dtype, device=device)


# The reference forward of each family that has one of its own (Family.mtp_forward): Qwen4-Exp's, Step-3.5's (its
# layers drafting in turn, each with its head and cache), MiMo-V2-Flash's (its first layer, as vLLM builds it),
# Nemotron-H's (two sub-layers of one depth); the
# appended-layer one for the other families whose layout says how it computes (MtpLayout.appended); the Qwen3 forward
# by default.
_BUILDERS: dict[str, _Builder] = {"qwen4_exp": _qwen4_exp, "step3p5": _step3p5, "mimo_v2_flash": _mimo_v2,
                               "nemotron_h": _nemotron_h}


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
    build = _BUILDERS.get(spec.family.key)
    if build is None:
        build = _nextn if spec.family.mtp.appended is not None else _qwen3
    return build(spec, config, tensors, dtype, device)
