"""Load any supported checkpoint for evaluation: its MTP layer and its target (main) model.

Weights are read header-first through :class:`mtpquant.checkpoint.table.Checkpoint`, one tensor at a
time, and dequantized exactly per the formats (``mtpquant.formats``):

- BF16/FP16/FP32 tensors as they are (cast to the compute dtype; BF16 -> FP32 is exact);
- ModelOpt NVFP4: ``weight`` uint8 + ``weight_scale`` fp8 + ``weight_scale_2`` fp32;
- compressed-tensors NVFP4: ``weight_packed`` + ``weight_scale`` + ``weight_global_scale`` (reciprocal);
- FP8 per tensor (ModelOpt: ``weight`` fp8 + ``weight_scale`` fp32 scalar; per-channel scales too);
- FP8 blocks (Qwen: ``weight`` fp8 + ``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``).

The format is recognised per Linear from tensor names and dtypes alone, so MIXED_PRECISION
checkpoints and hand-made ones need no metadata. Activation emulation (``activations="emulate"``)
quantizes each quantized Linear's input with the checkpoint's ``input_scale`` (NVFP4: dynamic fp8
block scales, as the W4A4 kernels do; FP8: the static per-tensor scale) through forward pre-hooks.

The target model is the family's transformers text class (``Qwen3_5ForCausalLM``, ...) built on
the meta device and filled tensor by tensor with the dequantized state dict (the wrapper prefix
``model.language_model.`` mapped to ``model.``; per-expert tensors re-fused into transformers' 3-D
``experts.gate_up_proj`` / ``experts.down_proj``), then placed by an accelerate ``device_map``:
``{"": "cpu"}`` on CPU, ``infer_auto_device_map`` over the GPUs (and CPU offload) otherwise. The
same code path serves every device. Only this module (of ``validate``) imports transformers.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import CheckpointError, ConfigError
from mtpquant.families import TensorClass
from mtpquant.formats.fp8 import FP8_E4M3_MAX, dequantize_fp8_block, dequantize_fp8_per_tensor
from mtpquant.formats.nvfp4 import dequantize_nvfp4, from_compressed_tensors, quantize_activation_nvfp4
from mtpquant.mtp.module import MtpConfig, MtpLayer, MtpLayoutError
from mtpquant.validate import ACTIVATION_MODES

__all__ = [
    "ACTIVATION_MODES",
    "CheckpointWeights",
    "LinearFormat",
    "MtpBundle",
    "TargetModel",
    "compute_dtype",
    "load_mtp",
    "load_target",
    "resolve_device",
]

log = logging.getLogger(__name__)


# Tensor suffixes that carry quantization parameters of the Linear ``<m>`` they follow.
_SCALE_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "weight_scale_inv",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "pre_quant_scale",
)
# KV-cache scales (modelopt ``k_proj.k_scale`` ...): not weights; the KV cache is not emulated.
_KV_SCALE_SUFFIXES = ("k_scale", "v_scale")
_FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}


class ValidateLoadError(CheckpointError):
    """A checkpoint cannot be loaded for evaluation (unknown quantization layout, bad shapes, ...)."""


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` (or ``cuda:N``) or ``auto`` (CUDA when available) as a torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValidateLoadError("--device cuda: no CUDA device is available (use --device cpu)")
    if dev.type not in {"cpu", "cuda"}:
        raise ValidateLoadError(f"--device {device}: only cpu, cuda and auto are supported")
    return dev


def compute_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    """The compute dtype: explicit, else float32 on CPU (BF16 weights upcast exactly) and bfloat16 on CUDA."""
    if dtype is not None:
        table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in table:
            raise ValidateLoadError(f"dtype {dtype!r}: expected one of {', '.join(table)}")
        return table[dtype]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@dataclass(frozen=True)
class LinearFormat:
    """How one Linear's weight is stored."""

    module: str
    kind: str  # nvfp4 | nvfp4-ct | fp8 | fp8-block
    input_scale: float | None = None  # modelopt convention (compressed-tensors' reciprocal undone)
    has_pre_quant_scale: bool = False


def _split(name: str) -> tuple[str, str]:
    module, _, suffix = name.rpartition(".")
    return module, suffix


class CheckpointWeights:
    """A dequantizing view of one checkpoint: logical (unquantized) tensor names to float tensors."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.spec = ckpt.spec
        self.formats: dict[str, LinearFormat] = {}
        # logical name -> stored name of its data tensor
        self._logical: dict[str, str] = {}
        self.skipped: list[str] = []
        self._analyse()

    @classmethod
    def open(cls, ref: str | Path) -> CheckpointWeights:
        """Open a local directory or Hub repo id header-first (index defects raise)."""
        return cls(Checkpoint.open(ref))

    @property
    def label(self) -> str:
        """Path or repo id."""
        return self.ckpt.label

    # ---- layout analysis ----------------------------------------------------------------------
    def _analyse(self) -> None:
        tensors = self.ckpt.tensors
        by_module: dict[str, dict[str, str]] = defaultdict(dict)
        for name, entry in tensors.items():
            module, suffix = _split(name)
            by_module[module][suffix] = entry.dtype
        block = self._block_size()
        for module, parts in by_module.items():
            kind = self._kind(module, parts)
            if kind is not None:
                self.formats[module] = LinearFormat(
                    module,
                    kind,
                    self._input_scale(module, parts),
                    "pre_quant_scale" in parts,
                )
                if kind == "fp8-block":
                    self._check_block(module, block)
        for name in tensors:
            module, suffix = _split(name)
            if suffix in _KV_SCALE_SUFFIXES:
                self.skipped.append(name)
                continue
            if module in self.formats:
                if suffix in ("weight", "weight_packed"):
                    self._logical[f"{module}.weight"] = name
                elif suffix not in _SCALE_SUFFIXES:
                    self._logical[name] = name
                continue
            if suffix in _SCALE_SUFFIXES:
                # A scale next to a float weight: an exported leftover; engines reject it, we ignore it.
                self.skipped.append(name)
                continue
            self._logical[name] = name
        if self.skipped:
            log.info("%s: ignoring %d scale tensors of unquantized modules / KV cache", self.label, len(self.skipped))

    def _kind(self, module: str, parts: dict[str, str]) -> str | None:
        w = parts.get("weight")
        if "weight_packed" in parts:
            if "weight_global_scale" not in parts or "weight_scale" not in parts:
                raise ValidateLoadError(f"{self.label}: {module}.weight_packed without its scales")
            return "nvfp4-ct"
        if w == "U8":
            if parts.get("weight_scale") != "F8_E4M3" or "weight_scale_2" not in parts:
                raise ValidateLoadError(
                    f"{self.label}: {module}.weight is uint8 but weight_scale (fp8) / weight_scale_2 are missing"
                )
            return "nvfp4"
        if w == "F8_E4M3":
            if "weight_scale_inv" in parts:
                return "fp8-block"
            if "weight_scale" in parts:
                shape = self.ckpt.tensors[f"{module}.weight_scale"].shape
                wshape = self.ckpt.tensors[f"{module}.weight"].shape
                if len(shape) == 2 and shape[-1] > 1 and len(wshape) == 2:
                    return "fp8-block"
                return "fp8"
            raise ValidateLoadError(f"{self.label}: {module}.weight is fp8 but has no weight_scale / weight_scale_inv")
        if w is not None and w not in _FLOAT_DTYPES:
            raise ValidateLoadError(f"{self.label}: {module}.weight has unsupported dtype {w}")
        return None

    def _input_scale(self, module: str, parts: dict[str, str]) -> float | None:
        if "input_scale" in parts:
            return float(self.ckpt.read_tensor(f"{module}.input_scale").float().max())
        if "input_global_scale" in parts:
            return float(1.0 / self.ckpt.read_tensor(f"{module}.input_global_scale").float().max())
        return None

    def _block_size(self) -> tuple[int, int]:
        qc = self.ckpt.config.get("quantization_config") or {}
        size = qc.get("weight_block_size") if isinstance(qc, dict) else None
        if isinstance(size, list) and len(size) == 2:
            return int(size[0]), int(size[1])
        return 128, 128

    def _check_block(self, module: str, block: tuple[int, int]) -> None:
        rows, cols = self.ckpt.tensors[f"{module}.weight"].shape
        scale_name = self._scale_name(module)
        got = tuple(self.ckpt.tensors[scale_name].shape)
        want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if got != want:
            raise ValidateLoadError(f"{self.label}: {scale_name} shape {got} does not fit blocks {block} (want {want})")

    def _scale_name(self, module: str) -> str:
        inv = f"{module}.weight_scale_inv"
        return inv if inv in self.ckpt.tensors else f"{module}.weight_scale"

    # ---- queries ------------------------------------------------------------------------------
    def names(self, klass: str | None = None) -> list[str]:
        """Logical tensor names (optionally of one class: main / mtp / vision / embed / lm_head)."""
        names = sorted(self._logical)
        if klass is None:
            return names
        return [n for n in names if self.ckpt.classify(n) == klass]

    def has(self, name: str) -> bool:
        """Whether a logical tensor exists."""
        return name in self._logical

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a logical (dequantized) tensor."""
        stored = self.ckpt.tensors[self._logical[name]]
        module, _ = _split(name)
        fmt = self.formats.get(module)
        if fmt is not None and fmt.kind in ("nvfp4", "nvfp4-ct") and name == f"{module}.weight":
            return (*stored.shape[:-1], stored.shape[-1] * 2)
        return tuple(stored.shape)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32, *, fold_pre_quant: bool = True) -> Tensor:
        """The logical tensor, dequantized exactly and cast to ``dtype``.

        ``fold_pre_quant`` multiplies an AWQ ``pre_quant_scale`` into the weight's columns (exact for
        unquantized activations); activation emulation applies it to the input instead.
        """
        stored = self._logical[name]
        module, _ = _split(name)
        fmt = self.formats.get(module)
        read = self.ckpt.read_tensor
        if fmt is None or name != f"{module}.weight":
            return read(stored).to(dtype)
        if fmt.kind == "nvfp4":
            w = dequantize_nvfp4(read(stored), read(f"{module}.weight_scale"), read(f"{module}.weight_scale_2"))
        elif fmt.kind == "nvfp4-ct":
            w = from_compressed_tensors(
                read(stored), read(f"{module}.weight_scale"), read(f"{module}.weight_global_scale")
            ).dequantize()
        elif fmt.kind == "fp8":
            scale = read(f"{module}.weight_scale").float()
            q = read(stored)
            if scale.numel() == 1:
                w = dequantize_fp8_per_tensor(q, scale)
            else:  # per output channel, [out] or [out, 1]
                w = q.float() * scale.reshape(-1, *([1] * (q.dim() - 1)))
        else:
            w = dequantize_fp8_block(read(stored), read(self._scale_name(module)).float(), self._block_size())
        if fmt.has_pre_quant_scale and fold_pre_quant:
            w = w * read(f"{module}.pre_quant_scale").float()
        return w.to(dtype)

    def pre_quant_scale(self, module: str) -> Tensor | None:
        """The AWQ input scale of a Linear, if the checkpoint has one."""
        fmt = self.formats.get(module)
        if fmt is None or not fmt.has_pre_quant_scale:
            return None
        return self.ckpt.read_tensor(f"{module}.pre_quant_scale").float()

    # ---- summaries ----------------------------------------------------------------------------
    def precision_summary(self) -> dict[str, dict[str, int]]:
        """Linear count per storage kind for each tensor class, e.g. ``{"mtp": {"bf16": 6, "nvfp4": 0}}``."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for name in self._logical:
            module, suffix = _split(name)
            if suffix != "weight" or len(self.shape(name)) < 2:
                continue
            klass = self.ckpt.classify(name)
            fmt = self.formats.get(module)
            kind = fmt.kind if fmt else self.ckpt.tensors[self._logical[name]].dtype.lower()
            out[klass][kind] += 1
        return {k: dict(v) for k, v in sorted(out.items())}

    @property
    def main_prefix(self) -> str:
        """The main-model tensor prefix (``model.language_model.`` or ``model.``)."""
        return self.ckpt.main_prefix

    def embed_name(self) -> str:
        """Logical name of ``embed_tokens.weight``."""
        return f"{self.main_prefix}embed_tokens.weight"

    def lm_head_name(self) -> str:
        """Logical name of the output head (the embeddings when tied and no ``lm_head.weight`` exists)."""
        if self.has("lm_head.weight"):
            return "lm_head.weight"
        if self.spec.tied_embeddings:
            return self.embed_name()
        raise ConfigError(f"{self.label}: lm_head.weight is missing and tie_word_embeddings is false")


# ---- activation emulation -------------------------------------------------------------------------
def _fp8_activation(x: Tensor, scale: float) -> Tensor:
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def activation_quantizer(fmt: LinearFormat, pre_quant_scale: Tensor | None) -> Callable[[Tensor], Tensor] | None:
    """The input fake-quantizer of a quantized Linear (None when it has no input scale: weight-only)."""
    if fmt.input_scale is None:
        return None
    scale = fmt.input_scale
    nvfp4 = fmt.kind in ("nvfp4", "nvfp4-ct")

    def quantize(x: Tensor) -> Tensor:
        if pre_quant_scale is not None:
            x = x * pre_quant_scale.to(device=x.device, dtype=x.dtype)
        return quantize_activation_nvfp4(x, scale) if nvfp4 else _fp8_activation(x, scale)

    return quantize


def _hook(quantize: Callable[[Tensor], Tensor]) -> Callable[..., Any]:
    def pre_hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (quantize(args[0]), *args[1:])

    return pre_hook


# ---- MTP ------------------------------------------------------------------------------------------
@dataclass
class MtpBundle:
    """A checkpoint's MTP layer with the embeddings and head it shares with its target."""

    layer: MtpLayer
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
) -> tuple[MtpBundle | None, str | None]:
    """The MTP layer of a checkpoint, or ``(None, reason)`` when it is missing or malformed."""
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
        cfg = MtpConfig.from_text_config(weights.ckpt.config)
    except ValueError as exc:
        return None, f"MTP config: {exc}"
    emulate = activations == "emulate"
    tensors = {n: weights.tensor(n, dtype, fold_pre_quant=not emulate) for n in names}
    try:
        layer = MtpLayer.from_state_dict(cfg, tensors, dtype=dtype, device=device)
    except MtpLayoutError as exc:
        return None, str(exc)
    emulated: list[str] = []
    if emulate:
        modules = dict(layer.named_modules())
        for module, fmt in weights.formats.items():
            if not module.startswith("mtp."):
                continue
            quantize = activation_quantizer(fmt, weights.pre_quant_scale(module))
            if quantize is not None:
                modules[module.removeprefix("mtp.")].register_forward_pre_hook(_hook(quantize))
                emulated.append(module)
    bundle = MtpBundle(
        layer=layer,
        embed_weight=weights.tensor(weights.embed_name(), dtype).to(device),
        lm_head_weight=weights.tensor(weights.lm_head_name(), dtype).to(device),
        precision=weights.precision_summary().get(TensorClass.MTP, {}),
        emulated=emulated,
    )
    return bundle, None


# ---- target model ---------------------------------------------------------------------------------
_EXPERT_RE = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _text_config(weights: CheckpointWeights) -> dict[str, Any]:
    config = weights.ckpt.config
    text = copy.deepcopy(dict(config.get("text_config") or config))
    for key in ("quantization_config", "architectures", "auto_map"):
        text.pop(key, None)
    text["tie_word_embeddings"] = weights.spec.tied_embeddings
    return text


def _model_name(weights: CheckpointWeights, logical: str) -> str | None:
    """The transformers text-class parameter name of a main-model tensor (None: not part of it)."""
    klass = weights.ckpt.classify(logical)
    if klass == TensorClass.LM_HEAD:
        return logical
    if klass in (TensorClass.MAIN, TensorClass.EMBED):
        return "model." + logical[len(weights.main_prefix) :]
    return None


class TargetModel:
    """A family's transformers text model with the checkpoint's (dequantized) weights."""

    def __init__(self, model: nn.Module, device_map: dict[str, Any], dtype: torch.dtype, emulated: list[str]) -> None:
        self.model: Any = model
        self.device_map = device_map
        self.dtype = dtype
        self.emulated = emulated
        self.input_device = next(model.parameters()).device

    @property
    def lm_head_weight(self) -> Tensor:
        """The output head ``[V, H]``."""
        return self.model.get_output_embeddings().weight

    @property
    def embed_weight(self) -> Tensor:
        """The input embeddings ``[V, H]``."""
        return self.model.get_input_embeddings().weight

    def hidden(self, tokens: Tensor) -> Tensor:
        """Post-final-norm hidden states ``[B, T, H]`` of one causal pass over ``tokens`` ``[B, T]``."""
        with torch.no_grad():
            out = self.model.model(input_ids=tokens.to(self.input_device), use_cache=False)
        return out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """``lm_head(hidden)`` in float32."""
        w = self.lm_head_weight
        return nn.functional.linear(hidden.to(device=w.device, dtype=w.dtype), w).float()

    def greedy(self, prompt: Tensor, new_tokens: int) -> Tensor:
        """The target's greedy continuation: ``prompt`` ``[1, P]`` followed by ``new_tokens`` tokens."""
        if new_tokens < 1:
            return prompt
        ids = prompt.to(self.input_device)
        out_tokens = [ids]
        with torch.no_grad():
            out: Any = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(new_tokens - 1):
                out_tokens.append(nxt)
                out = self.model(input_ids=nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out_tokens.append(nxt)
        return torch.cat(out_tokens, dim=1).cpu()


def _iter_target_tensors(
    weights: CheckpointWeights, dtype: torch.dtype, fold_pre_quant: bool
) -> Iterator[tuple[str, Tensor]]:
    """(transformers name, tensor) for every main-model parameter; per-expert tensors re-fused."""
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for logical in weights.names():
        target = _model_name(weights, logical)
        if target is None:
            continue
        m = _EXPERT_RE.match(target)
        if m:
            experts[m["stem"]][int(m["e"])][m["proj"]] = logical
            continue
        yield target, weights.tensor(logical, dtype, fold_pre_quant=fold_pre_quant)
    for stem, by_expert in experts.items():
        count = max(by_expert) + 1
        missing = [e for e in range(count) if set(by_expert.get(e, {})) != {"gate_proj", "up_proj", "down_proj"}]
        if missing:
            raise ValidateLoadError(f"{weights.label}: {stem}: experts {missing[:8]} lack gate/up/down tensors")
        # transformers: gate_up_proj [E, 2I, H] with the gate first; down_proj [E, H, I].
        yield (
            f"{stem}.gate_up_proj",
            torch.stack(
                [
                    torch.cat(
                        [
                            weights.tensor(by_expert[e]["gate_proj"], dtype, fold_pre_quant=fold_pre_quant),
                            weights.tensor(by_expert[e]["up_proj"], dtype, fold_pre_quant=fold_pre_quant),
                        ]
                    )
                    for e in range(count)
                ]
            ),
        )
        yield (
            f"{stem}.down_proj",
            torch.stack(
                [weights.tensor(by_expert[e]["down_proj"], dtype, fold_pre_quant=fold_pre_quant) for e in range(count)]
            ),
        )


def _device_map(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    if device.type == "cpu":
        return {"": "cpu"}
    from accelerate import infer_auto_device_map

    if device.index is not None:
        return {"": f"cuda:{device.index}"}
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    device_map = dict(infer_auto_device_map(model, no_split_module_classes=no_split, dtype=dtype))
    if "disk" in device_map.values():
        # Dequantized weights are built in memory anyway; keep what does not fit the GPUs in RAM.
        log.warning("the dequantized model does not fit the GPUs: offloading part of it to CPU memory")
        device_map = {k: ("cpu" if v == "disk" else v) for k, v in device_map.items()}
    return device_map


def load_target(
    weights: CheckpointWeights,
    *,
    device: torch.device,
    dtype: torch.dtype,
    activations: str = "off",
) -> TargetModel:
    """Build the family's transformers text model from the checkpoint and place it per device."""
    import transformers
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    family = weights.spec.family
    cls = getattr(transformers, family.text_class)
    hf_config = cls.config_class.from_dict(_text_config(weights))
    with init_empty_weights():
        model = cls(hf_config)
    model.eval()
    device_map = _device_map(model, device, dtype)

    def place(name: str) -> str:
        best = ""
        for key in device_map:
            if (key == "" or name == key or name.startswith(key + ".")) and len(key) >= len(best):
                best = key
        return str(device_map[best])

    emulate = activations == "emulate"
    expected = {n for n, _ in model.named_parameters()}
    loaded: set[str] = set()
    for name, tensor in _iter_target_tensors(weights, dtype, fold_pre_quant=not emulate):
        if name not in expected:
            raise ValidateLoadError(f"{weights.label}: tensor for {name!r} has no place in {family.text_class}")
        set_module_tensor_to_device(model, name, place(name), value=tensor)
        loaded.add(name)
    if hf_config.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.tie_weights()
        loaded.add("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:6]) + (f", ... ({len(missing) - 6} more)" if len(missing) > 6 else "")
        raise ValidateLoadError(f"{weights.label}: {len(missing)} main-model weights missing: {shown}")
    # Buffers (rotary inv_freq) were built on CPU; dispatch_model moves everything per the map.
    model = (
        dispatch_model(model, device_map=device_map)
        if len(set(device_map.values())) > 1
        else model.to(next(iter(device_map.values())))
    )
    emulated = _install_target_emulation(model, weights) if emulate else []
    return TargetModel(model, device_map, dtype, emulated)


def _install_target_emulation(model: nn.Module, weights: CheckpointWeights) -> list[str]:
    """Activation fake-quant hooks on the target's quantized Linears (fused experts: see below)."""
    modules = dict(model.named_modules())
    emulated: list[str] = []
    expert_scales: dict[str, dict[str, list[LinearFormat]]] = defaultdict(lambda: defaultdict(list))
    for module, fmt in weights.formats.items():
        target = _model_name(weights, module + ".weight")
        if target is None:
            continue
        target_module = target.removesuffix(".weight")
        m = _EXPERT_RE.match(target)
        if m:
            expert_scales[m["stem"]][m["proj"]].append(fmt)
            continue
        quantize = activation_quantizer(fmt, weights.pre_quant_scale(module))
        if quantize is not None and target_module in modules:
            modules[target_module].register_forward_pre_hook(_hook(quantize))
            emulated.append(module)
    for stem, by_proj in expert_scales.items():
        # All experts of a layer share one input scale for gate/up and one for down (vLLM takes the
        # max when they differ); the fused experts module gets a forward that quantizes both inputs.
        gate_up = [f for p in ("gate_proj", "up_proj") for f in by_proj.get(p, [])]
        down = by_proj.get("down_proj", [])
        q_in = _shared_quantizer(gate_up)
        q_mid = _shared_quantizer(down)
        if stem in modules and (q_in or q_mid):
            _emulate_fused_experts(modules[stem], q_in, q_mid)
            emulated.append(stem)
    return emulated


def _shared_quantizer(fmts: list[LinearFormat]) -> Callable[[Tensor], Tensor] | None:
    scales = [f.input_scale for f in fmts if f.input_scale is not None]
    if not scales:
        return None
    return activation_quantizer(LinearFormat(fmts[0].module, fmts[0].kind, max(scales)), None)


def _emulate_fused_experts(
    experts: nn.Module,
    q_in: Callable[[Tensor], Tensor] | None,
    q_mid: Callable[[Tensor], Tensor] | None,
) -> None:
    """Replace a transformers fused-experts forward by the same loop with activation fake-quant.

    Mirrors ``Qwen3_5MoeExperts.forward`` / ``Qwen3NextExperts.forward`` (transformers 5.x).
    """
    mod: Any = experts

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        final = torch.zeros_like(hidden_states)
        x_all = q_in(hidden_states) if q_in else hidden_states
        for e in torch.unique(top_k_index).tolist():
            token_idx, slot = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(x_all[token_idx], mod.gate_up_proj[e]).chunk(2, dim=-1)
            mid = mod.act_fn(gate) * up
            if q_mid:
                mid = q_mid(mid)
            out = nn.functional.linear(mid, mod.down_proj[e]) * top_k_weights[token_idx, slot, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    mod.forward = forward
