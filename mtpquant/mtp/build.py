"""The reference MTP of a checkpoint, whichever family: ``MtpLayer`` (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) or
``Qwen4ExpMtp`` (Qwen3.8-Flash-Next), built from its ``mtp.*`` tensors for calibration (convert ``--mtp quantize``)
and validation. The family's registry entry says which forward it has (``Family.mtp_forward``) and what it reads;
``families.mtp_config`` refuses, before anything loads, what a forward cannot compute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from mtpquant.families import FUSED_EXPERT_PIECES, ModelSpec, mtp_config, resolve
from mtpquant.mtp.module import MtpLayer, MtpLayoutError, check_mtp_tensors
from mtpquant.mtp.step import MtpForward

__all__ = ["fuse_mtp_experts", "reference_mtp"]

_Builder = Callable[[ModelSpec, Mapping[str, Any], Mapping[str, Tensor], Any, Any], MtpForward]


def fuse_mtp_experts(tensors: Mapping[str, Tensor], experts: int) -> dict[str, Tensor]:
    """A per-expert MTP expert bank (``...mlp.experts.{e}.{gate,up,down}_proj.weight``) as transformers' fused 3-D
    ``experts.gate_up_proj`` / ``experts.down_proj`` (gate rows then up rows, experts stacked); other tensors as
    they are. Both forms load in vLLM; the reference forward computes with the fused one."""
    out: dict[str, Tensor] = {}
    stems: set[str] = set()
    for name, t in tensors.items():
        stem, sep, rest = name.partition(".mlp.experts.")
        if sep and rest.split(".", 1)[0].isdigit():
            stems.add(stem + ".mlp.experts")
        else:
            out[name] = t
    for stem in sorted(stems):
        for fused, pieces in FUSED_EXPERT_PIECES.items():
            try:
                out[f"{stem}.{fused}"] = torch.stack(
                    [torch.cat([tensors[f"{stem}.{e}.{p}.weight"] for p in pieces]) for e in range(experts)]
                )
            except KeyError as exc:
                raise MtpLayoutError(f"MTP expert bank {stem} lacks {exc.args[0]}") from None
    return out


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


# The reference forward of each family that has one (Family.mtp_forward); the Qwen3 forward by default.
_BUILDERS: dict[str, _Builder] = {"qwen4_exp": _qwen4_exp}


def reference_mtp(
    config: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MtpForward:
    """The family's reference MTP with the checkpoint's ``mtp.*`` tensors (names and shapes checked; MtpLayoutError
    names what does not fit, MtpConfigError what the forward cannot compute)."""
    spec = resolve(config)
    return _BUILDERS.get(spec.family.key, _qwen3)(spec, config, tensors, dtype, device)
