"""A checkpoint's MTP layer loaded as a drafter for evaluation (``MtpBundle``: the layer, the embedding and head it
drafts with, the quantized Linears whose activations are emulated), from ``weights.CheckpointWeights``. The same
bundle serves validate's built-in path and heal's check.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor, nn

from mtpquant.families import MTP_PREFIX, TensorClass, is_mtp_name, mtp_config
from mtpquant.measure import ACTIVATION_MODES
from mtpquant.measure.emulate import activation_quantizer, emulate_expert_banks, pre_hook
from mtpquant.measure.weights import CheckpointWeights, LinearFormat
from mtpquant.mtp.build import reference_mtp
from mtpquant.mtp.module import MtpLayoutError
from mtpquant.mtp.quantize import expert_linear
from mtpquant.mtp.step import MtpForward

__all__ = ["MtpBundle", "load_mtp"]

log = logging.getLogger(__name__)


# ---- MTP ------------------------------------------------------------------------------------------
@dataclass
class MtpBundle:
    """A checkpoint's MTP layer with the embeddings and head it shares with its target."""

    layer: MtpForward
    embed_weight: Tensor
    lm_head_weight: Tensor
    precision: dict[str, int]
    emulated: list[str] = field(default_factory=list)

    def embed(self, tokens: Tensor) -> Tensor:
        """``embed_tokens(tokens)`` with the target's table."""
        return nn.functional.embedding(tokens.to(self.embed_weight.device), self.embed_weight)


def load_mtp(
    weights: CheckpointWeights,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    activations: str = "off",
    shared: tuple[Tensor, Tensor] | None = None,
) -> tuple[MtpBundle | None, str | None]:
    """The MTP layer of a checkpoint, or ``(None, reason)`` when it is missing or malformed.

    ``shared``: the target's embedding and LM head, already in memory (not read again: heal compares two MTP layers
    of one target).
    """
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {activations!r}")
    names = weights.names(TensorClass.MTP)
    declared = weights.spec.mtp.declared
    if not names:
        reason = (
            f"MTP declared ({weights.spec.mtp.describe()}) but no mtp.* tensors are present"
            if declared
            else "the checkpoint has no MTP layer (no mtp.* tensors, none declared)"
        )
        return None, reason
    try:
        mtp_config(weights.ckpt.config)
    except ValueError as exc:
        return None, f"MTP config: {exc}"
    emulate = activations == "emulate"
    tensors = {n: weights.tensor(n, dtype, fold_pre_quant=not emulate) for n in names}
    try:
        layer = reference_mtp(weights.ckpt.config, tensors, dtype=dtype, device=device)
    except MtpLayoutError as exc:
        return None, str(exc)
    emulated: list[str] = []
    if emulate:
        modules = dict(cast(nn.Module, layer).named_modules())
        banks: dict[str, dict[str, list[LinearFormat]]] = defaultdict(lambda: defaultdict(list))
        for module, fmt in weights.formats.items():
            if not is_mtp_name(module):
                continue
            name = module.removeprefix(MTP_PREFIX)
            expert = expert_linear(name)
            if name not in modules and expert is not None:  # stored per expert, computed fused (Qwen4-Exp)
                banks[expert["stem"]][expert["proj"]].append(fmt)
                continue
            quantize = activation_quantizer(fmt, weights.pre_quant_scale(module))
            if quantize is not None:
                modules[name].register_forward_pre_hook(pre_hook(quantize))
                emulated.append(module)
        emulated += [MTP_PREFIX + stem for stem in emulate_expert_banks(modules, banks)]
    if shared is None:
        shared = weights.embedding_and_head(dtype, device)
    bundle = MtpBundle(
        layer=layer,
        embed_weight=shared[0],
        lm_head_weight=shared[1],
        precision=weights.precision_summary().get(TensorClass.MTP, {}),
        emulated=emulated,
    )
    return bundle, None
