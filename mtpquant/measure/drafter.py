"""A checkpoint's MTP layer loaded as a drafter for evaluation (``MtpBundle``: the layer, the embedding and head it
drafts with, the quantized Linears whose activations are emulated), from ``weights.CheckpointWeights``. The same
bundle serves validate's built-in path and heal's check.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from mtpquant.families import TensorClass, check_mtp_forward
from mtpquant.measure import ACTIVATION_MODES
from mtpquant.measure.emulate import activation_quantizer, emulate_expert_banks, pre_hook
from mtpquant.measure.weights import CheckpointWeights, LinearFormat
from mtpquant.mtp.build import reference_mtp
from mtpquant.mtp.module import MtpLayoutError
from mtpquant.mtp.names import checkpoint_name, module_name
from mtpquant.mtp.quantize import expert_linear
from mtpquant.mtp.step import MtpForward

__all__ = ["MtpBundle", "load_mtp", "mtp_bundle"]

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
        check_mtp_forward(weights.ckpt.config)
    except ValueError as exc:
        return None, f"MTP config: {exc}"
    emulate = activations == "emulate"
    tensors = {n: weights.tensor(n, dtype, fold_pre_quant=not emulate) for n in names}
    formats = {m: f for m, f in weights.formats.items() if weights.ckpt.is_mtp(m)} if emulate else {}
    if shared is None:
        shared = weights.embedding_and_head(dtype, device)
    try:
        bundle = mtp_bundle(
            weights.ckpt.config,
            tensors,
            shared=shared,
            dtype=dtype,
            device=device,
            emulate=formats,
            pre_quant_scale=weights.pre_quant_scale,
            precision=weights.precision_summary().get(TensorClass.MTP, {}),
        )
    except MtpLayoutError as exc:
        return None, str(exc)
    return bundle, None


def mtp_bundle(
    config: Mapping[str, Any],
    tensors: Mapping[str, Tensor],
    *,
    shared: tuple[Tensor, Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    emulate: Mapping[str, LinearFormat] | None = None,
    pre_quant_scale: Callable[[str], Tensor | None] = lambda _module: None,
    precision: dict[str, int] | None = None,
) -> MtpBundle:
    """The family's MTP from its logical ``mtp.*`` tensors (dequantized weights; per-expert or fused experts) with
    the target's embedding and head (``shared``), and the activations of the Linears in ``emulate`` (module -> its
    stored format) fake-quantized as the engines run them: a pre-hook per Linear, the shared input scale of each
    projection kind for transformers' fused experts (``emulate.emulate_expert_banks``). MtpLayoutError when the
    tensors do not fit the family's layout. ``load_mtp`` builds a checkpoint's through it; the precision search its
    candidates, from tensors in memory."""
    layer = reference_mtp(config, tensors, dtype=dtype, device=device)
    emulated: list[str] = []
    modules = dict(cast(nn.Module, layer).named_modules())
    banks: dict[str, dict[str, list[LinearFormat]]] = defaultdict(lambda: defaultdict(list))
    for module, fmt in sorted((emulate or {}).items()):
        name = module_name(layer, module)
        if name not in modules:  # stored per expert, computed fused (transformers' expert banks)
            expert = expert_linear(name)
            if expert is None or expert["stem"] not in modules:
                raise MtpLayoutError(f"{module}: no such Linear in the MTP to emulate its activations")
            banks[expert["stem"]][expert["proj"]].append(fmt)
            continue
        quantize = activation_quantizer(fmt, pre_quant_scale(module))
        if quantize is not None:
            modules[name].register_forward_pre_hook(pre_hook(quantize))
            emulated.append(module)
    emulated += [checkpoint_name(layer, stem) for stem in emulate_expert_banks(modules, banks)]
    return MtpBundle(layer=layer, embed_weight=shared[0], lm_head_weight=shared[1], precision=precision or {},
                     emulated=emulated)
