"""Activation emulation (``activations="emulate"``): each quantized Linear's input fake-quantized with the
checkpoint's ``input_scale`` (NVFP4: dynamic fp8 block scales, as the W4A4 kernels do; FP8: the static per-tensor
scale), through forward pre-hooks, and transformers' fused experts given a forward that quantizes both their inputs.
``load.py`` installs them on the MTP and the target model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.measure.weights import LinearFormat

__all__ = ["activation_quantizer", "emulate_expert_banks", "emulate_fused_experts", "pre_hook", "shared_quantizer"]


def activation_quantizer(fmt: LinearFormat, pre_quant_scale: Tensor | None) -> Callable[[Tensor], Tensor] | None:
    """The input fake-quantizer of a quantized Linear (None when it has no input scale: weight-only)."""
    if fmt.input_scale is None:
        return None
    scale, kind = fmt.input_scale, fmt.kind

    def quantize(x: Tensor) -> Tensor:
        if pre_quant_scale is not None:
            x = x * pre_quant_scale.to(device=x.device, dtype=x.dtype)
        return kind.fake_quantize_input(x, scale)

    return quantize


def pre_hook(quantize: Callable[[Tensor], Tensor]) -> Callable[..., Any]:
    """A forward pre-hook that fake-quantizes the module's first input with ``quantize``."""

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (quantize(args[0]), *args[1:])

    return hook


def shared_quantizer(fmts: list[LinearFormat]) -> Callable[[Tensor], Tensor] | None:
    """One input fake-quantizer for Linears that share an input (fused experts): the largest input scale, as vLLM
    takes."""
    scales = [f.input_scale for f in fmts if f.input_scale is not None]
    if not scales:
        return None
    return activation_quantizer(LinearFormat(fmts[0].module, fmts[0].kind, max(scales)), None)


def emulate_fused_experts(
    experts: nn.Module,
    q_in: Callable[[Tensor], Tensor] | None,
    q_mid: Callable[[Tensor], Tensor] | None,
) -> None:
    """Replace a transformers fused-experts forward by the same loop with activation fake-quant.

    Mirrors ``Qwen3_5MoeExperts.forward`` / ``Qwen3NextExperts.forward`` (transformers 5.x), and the ungated
    ``NemotronHExperts.forward`` (``up_proj`` without ``gate_up_proj``).
    """
    mod: Any = experts
    ungated = not hasattr(mod, "gate_up_proj")

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        final = torch.zeros_like(hidden_states)
        x_all = q_in(hidden_states) if q_in else hidden_states
        for e in torch.unique(top_k_index).tolist():
            token_idx, slot = torch.where(top_k_index == e)
            if ungated:  # Nemotron-H's NemotronHExperts: down(act(up(x)))
                mid = mod.act_fn(nn.functional.linear(x_all[token_idx], mod.up_proj[e]))
            else:
                gate, up = nn.functional.linear(x_all[token_idx], mod.gate_up_proj[e]).chunk(2, dim=-1)
                mid = mod.act_fn(gate) * up
            if q_mid:
                mid = q_mid(mid)
            out = nn.functional.linear(mid, mod.down_proj[e]) * top_k_weights[token_idx, slot, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    mod.forward = forward


def emulate_expert_banks(
    modules: Mapping[str, nn.Module], banks: Mapping[str, Mapping[str, Sequence[LinearFormat]]]
) -> list[str]:
    """Activation emulation on transformers' fused experts whose checkpoint stores them per expert: ``banks`` maps
    a fused experts module's name (in ``modules``) to the formats of its per-expert Linears by projection
    (``gate_proj``, ``up_proj``, ``down_proj``). All experts of a bank share one input scale for gate/up and one
    for down (vLLM takes the max when they differ). Returns the banks emulated."""
    emulated: list[str] = []
    for stem, by_proj in banks.items():
        gate_up = [f for p in ("gate_proj", "up_proj") for f in by_proj.get(p, [])]
        q_in = shared_quantizer(gate_up)
        q_mid = shared_quantizer(list(by_proj.get("down_proj", [])))
        if stem in modules and (q_in or q_mid):
            emulate_fused_experts(modules[stem], q_in, q_mid)
            emulated.append(stem)
    return emulated
