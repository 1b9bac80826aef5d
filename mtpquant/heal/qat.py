"""Quantization-aware healing: nvidia-modelopt's fake quantization inside the MTP layer while it trains.

A quantized MTP is healed with ``mtq.quantize`` applied to the family's reference layer (``mtp.build.reference_mtp``:
Qwen's ``mtp.module.MtpLayer``, or the appended-layer ``mtp.nextn.NextnMtp`` of GLM-4.5 / DeepSeek-V3, its Linears
found by the layer's own checkpoint-name map, ``mtp.names.module_name``): modelopt inserts its ``TensorQuantizer`` on
exactly the Linears QUANT stores quantized, calibrates them (``max``) on a batch
of the heal data, and its straight-through estimator carries the gradients through the rounding. The input
quantizers then take QUANT's own ``input_scale`` (amax = input_scale x 6 x 448 for NVFP4, x 448 for FP8), so
training sees the activations exactly as the engines quantize them with the scales that stay in the checkpoint.

Qwen4-Exp's and the appended-layer reference forwards compute the routed experts fused (transformers' 3-D
``gate_up_proj`` / ``down_proj``) while QUANT stores them per expert: modelopt wraps such a module as
``_QuantFusedExperts`` (one weight quantizer per expert and projection, ``gate_up_proj_weight_quantizers.{e}`` /
``down_proj_weight_quantizers.{e}``, and one shared input quantizer per projection), so expert e's gate/up is rounded
as one group (the global scale they share on export) and its down on its own; the shared input quantizers take the
bank's input scale (the largest, as vLLM takes one per bank).

modelopt 0.47 fake-quantizes FP8 on any device, but its NVFP4 fake quantization (dynamic 16-element blocks with
E4M3 scales) runs only in its CUDA extension or Triton kernel. For NVFP4 the quantizers therefore use a modelopt
*backend* (``register_quant_backend``, the extension point modelopt provides for this), ``mtpquant_nvfp4``: the
weight rounded to NVFP4 with modelopt's export math (``formats.nvfp4.quantize_nvfp4``, global scale from max|W|)
and dequantized; the input quantized as the W4A4 kernels do (``quantize_activation_nvfp4``, what validate's
``--activations emulate`` applies); gradients pass straight through. The same code runs on the CPU and the GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.formats.kinds import NVFP4
from mtpquant.formats.nvfp4 import (
    E2M1_MAX,
    E4M3_MAX,
    dequantize_nvfp4,
    global_scale_from_amax,
    quantize_activation_nvfp4,
    quantize_nvfp4,
    weight_amax,
)
from mtpquant.heal.precision import MtpStorage
from mtpquant.mtp.names import module_name
from mtpquant.mtp.quantize import expert_linear, is_fused_experts

__all__ = ["NVFP4_BACKEND", "fake_quant_config", "nvfp4_fake_quant", "quantize_for_training"]

log = logging.getLogger(__name__)

NVFP4_BACKEND = "mtpquant_nvfp4"
# modelopt fake-quantizes NVFP4 only in CUDA code: its quantizers run through mtpquant's backend instead (module text)
_BACKENDS = {NVFP4: NVFP4_BACKEND}


def nvfp4_fake_quant(inputs: Tensor, quantizer: Any) -> Tensor:
    """The ``mtpquant_nvfp4`` backend: NVFP4 round trip of a weight or an activation, straight-through gradients."""
    role = (getattr(quantizer, "backend_extra_args", None) or {}).get("role")
    x = inputs.detach()
    if role == "weight":
        q = quantize_nvfp4(x, weight_scale_2=global_scale_from_amax(weight_amax(x)))
        fake = dequantize_nvfp4(q.packed, q.weight_scale, q.weight_scale_2, dtype=x.dtype)
    elif role == "input":
        amax = quantizer.amax
        if amax is None:
            raise RuntimeError("internal: an NVFP4 input quantizer without its amax")
        fake = quantize_activation_nvfp4(x, amax.float() / (E2M1_MAX * E4M3_MAX))
    else:
        raise RuntimeError(f"internal: backend {NVFP4_BACKEND} needs role weight or input, got {role!r}")
    return inputs + (fake - x).to(inputs.dtype)


def _quantizers(module: str, fused: Collection[str], rename: Callable[[str], str]) -> dict[str, str]:
    """The quantizer names (``weight``, ``input``) of QUANT's quantized MTP Linear ``module`` (its checkpoint name) in
    the reference layer (``rename``: checkpoint name -> the layer's, ``mtp.names.module_name``): its own, or, for an
    expert of a fused bank in ``fused`` (the layer's names), the bank's quantizers of its projection
    (``_QuantFusedExperts``)."""
    expert = expert_linear(module)
    stem = None if expert is None else rename(expert["stem"])
    if expert is None or stem not in fused:
        name = rename(module)
        return {"weight": f"{name}.weight_quantizer", "input": f"{name}.input_quantizer"}
    proj = "down_proj" if expert["proj"] == "down_proj" else "gate_up_proj"
    return {"weight": f"{stem}.{proj}_weight_quantizers.{expert['e']}", "input": f"{stem}.{proj}_input_quantizer"}


def fake_quant_config(
    storage: MtpStorage, fused: Collection[str] = (), rename: Callable[[str], str] | None = None
) -> dict[str, Any]:
    """``mtq.quantize``'s config: every quantizer off but the weight (and input) quantizers of QUANT's quantized MTP
    Linears, each in the format QUANT stores it in; module names as the reference layer has them (``rename``: a
    checkpoint name -> the layer's, by default Qwen's, without ``mtp.``; ``fused``: its fused expert banks)."""
    rename = rename or (lambda name: module_name(None, name))
    entries: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
    kinds = ("weight", "input") if storage.activations else ("weight",)
    seen: set[str] = set()
    for module in storage.quantized:
        names = _quantizers(module, fused, rename)
        for kind in kinds:
            if names[kind] in seen:  # a fused bank's shared input quantizer, or gate and up of one expert
                continue
            seen.add(names[kind])
            stored = storage.kind_of(module)
            cfg = dict(stored.modelopt_cfg)
            if (backend := _BACKENDS.get(stored)) is not None:
                cfg |= {"backend": backend, "backend_extra_args": {"role": kind}}
            entries.append({"quantizer_name": names[kind], "cfg": cfg})
    return {"quant_cfg": entries, "algorithm": "max"}


def _register_backend() -> None:
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )

    if not is_registered_quant_backend(NVFP4_BACKEND):
        register_quant_backend(NVFP4_BACKEND, nvfp4_fake_quant)


def quantize_for_training(layer: nn.Module, storage: MtpStorage, calibrate: Callable[[nn.Module], None]) -> int:
    """Insert modelopt's fake quantizers into ``layer`` (in place) as QUANT stores its MTP; returns how many.

    ``calibrate(layer)`` runs a batch through the layer (modelopt's max calibration); the input quantizers then take
    QUANT's own input scales.
    """
    import modelopt.torch.quantization as mtq

    from mtpquant.runtime.libraries import modelopt_quiet

    if not storage.kinds:
        return 0
    _register_backend()
    fused = {name for name, mod in layer.named_modules() if is_fused_experts(mod)}

    def rename(name: str) -> str:
        return module_name(layer, name)

    config = fake_quant_config(storage, fused, rename)
    with modelopt_quiet(progress=False), torch.no_grad():
        mtq.quantize(layer, config, calibrate)
    # modelopt matches quantizer names as patterns: one that names no quantizer of the layer is silently skipped
    wanted = {e["quantizer_name"] for e in config["quant_cfg"] if e.get("cfg")}
    enabled = {name for name, mod in layer.named_modules() if getattr(mod, "is_enabled", False) is True}
    if wanted != enabled:
        odd = sorted(wanted ^ enabled)[0]
        raise RuntimeError(f"internal: heal's fake quantization would not match QUANT's quantized Linears ({odd})")
    if storage.activations:
        scales: dict[str, float] = {}  # input quantizer -> its amax from QUANT's input scale (a fused bank's: largest)
        for module in storage.quantized:
            name = _quantizers(module, fused, rename)["input"]
            factor = storage.kind_of(module).input_amax_factor
            scales[name] = max(scales.get(name, 0.0), storage.input_scales[module] * factor)
        for name, amax in scales.items():
            quantizer: Any = layer.get_submodule(name)
            quantizer.amax = torch.tensor(amax, dtype=torch.float32)
    count = len(storage.quantized)
    log.info("heal: modelopt fake quantization on %d MTP Linears (%s)", count, storage.label)
    return count
