"""Load a checkpoint's MTP layer and its target (main) model for evaluation, from ``weights.CheckpointWeights``.

Activation emulation (``activations="emulate"``, the fake-quantizers of ``emulate.py``) is installed on both models'
quantized Linears.

The target model is the family's transformers text class (``Qwen3_5ForCausalLM``, ...) built on the meta
device and filled tensor by tensor with the dequantized state dict (the wrapper prefix ``model.language_model.``
mapped to ``model.``; per-expert tensors re-fused into transformers' 3-D ``experts.gate_up_proj`` /
``experts.down_proj``), then placed by an accelerate ``device_map``: ``{"": "cpu"}`` on CPU,
``infer_auto_device_map`` over the GPUs (and CPU offload) otherwise. The same code path serves every device.
Only this module (of ``validate``) imports transformers.
"""

from __future__ import annotations

import copy
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from mtpquant.checkpoint.sharded import sharded_tables
from mtpquant.errors import ValidateLoadError
from mtpquant.families import FUSED_EXPERT_PIECES, MTP_PREFIX, TensorClass, mtp_config
from mtpquant.hfconfig import transformers_config
from mtpquant.measure import ACTIVATION_MODES
from mtpquant.measure.emulate import activation_quantizer, emulate_fused_experts, pre_hook, shared_quantizer
from mtpquant.measure.rules import target_probs
from mtpquant.measure.weights import (
    CheckpointWeights,
    LinearFormat,
    compute_dtype,
    resolve_device,
)
from mtpquant.mtp.build import reference_mtp
from mtpquant.mtp.module import MtpLayoutError
from mtpquant.mtp.step import MtpForward
from mtpquant.records.sampling import SamplingSettings

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
    "text_model_class",
]

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
        for module, fmt in weights.formats.items():
            if not weights.ckpt.is_mtp(module):
                continue
            quantize = activation_quantizer(fmt, weights.pre_quant_scale(module))
            if quantize is not None:
                modules[module.removeprefix(MTP_PREFIX)].register_forward_pre_hook(pre_hook(quantize))
                emulated.append(module)
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


# ---- target model ---------------------------------------------------------------------------------
_PER_EXPERT_PROJS = {p for pieces in FUSED_EXPERT_PIECES.values() for p in pieces}
_EXPERT_RE = re.compile(
    r"^(?P<stem>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(sorted(_PER_EXPERT_PROJS)) + r")\.weight$"
)


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

    def __init__(
        self,
        model: nn.Module,
        device_map: dict[str, Any],
        dtype: torch.dtype,
        emulated: list[str],
        hidden_source: str | None = None,
    ) -> None:
        self.model: Any = model
        self.device_map = device_map
        self.dtype = dtype
        self.emulated = emulated
        self.hidden_source = hidden_source  # the family's MtpLayout.hidden_source
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
        return self.hidden_states(tokens)[0]

    def hidden_states(self, tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        """One causal pass over ``tokens`` ``[B, T]``: what the LM head reads (post-final-norm / final mixer), and,
        where the family's MTP reads another tensor (Qwen4-Exp: the multi-stream state before the final mixer,
        ``[B, T, hc_count * H]``), that tensor (None otherwise)."""
        if self.hidden_source is None:
            with torch.no_grad():
                out = self.model.model(input_ids=tokens.to(self.input_device), use_cache=False)
            return out.last_hidden_state, None
        found = [m for n, m in self.model.model.named_modules() if n == self.hidden_source]
        seen: list[Tensor] = []
        handle = found[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            with torch.no_grad():
                out = self.model.model(input_ids=tokens.to(self.input_device), use_cache=False)
        finally:
            handle.remove()
        return out.last_hidden_state, seen[-1]

    def logits(self, hidden: Tensor) -> Tensor:
        """``lm_head(hidden)`` in float32."""
        w = self.lm_head_weight
        return nn.functional.linear(hidden.to(device=w.device, dtype=w.dtype), w).float()

    def greedy(self, prompt: Tensor, new_tokens: int) -> Tensor:
        """The target's greedy continuations: ``prompt`` ``[B, P]`` followed by ``new_tokens`` tokens per row."""
        return self.generate(prompt, new_tokens)

    def generate(
        self,
        prompt: Tensor,
        new_tokens: int,
        sampling: SamplingSettings | None = None,
        generators: Sequence[torch.Generator] = (),
    ) -> Tensor:
        """The target's continuations of ``prompt`` ``[B, P]`` by ``new_tokens`` tokens per row: greedy, or sampled
        from ``rules.target_probs`` (temperature, top-k, top-p as vLLM applies them) by the exponential race vLLM
        samples with (argmax of p / E, E ~ Exp(1)), each row with its own generator, so a row's tokens do not
        depend on which rows share its batch."""
        if new_tokens < 1:
            return prompt
        sample = sampling is not None and not sampling.greedy
        if sample and len(generators) != prompt.shape[0]:
            raise ValueError(f"sampling {prompt.shape[0]} rows needs one generator per row, got {len(generators)}")

        def pick(logits: Tensor) -> Tensor:
            if not sample:
                return logits.argmax(-1, keepdim=True)
            assert sampling is not None
            probs = target_probs(logits, sampling).cpu()
            noise = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=g) for g in generators])
            return (probs / noise).argmax(-1, keepdim=True).to(logits.device)

        ids = prompt.to(self.input_device)
        out_tokens = [ids]
        with torch.no_grad():
            out: Any = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            nxt = pick(out.logits[:, -1])
            for _ in range(new_tokens - 1):
                out_tokens.append(nxt)
                out = self.model(input_ids=nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                nxt = pick(out.logits[:, -1])
            out_tokens.append(nxt)
        return torch.cat(out_tokens, dim=1).cpu()


def _target_tensors(
    weights: CheckpointWeights, dtype: torch.dtype, fold_pre_quant: bool
) -> Iterator[tuple[str, Callable[[], Tensor]]]:
    """(transformers name, a function that reads and dequantizes it) for every main-model parameter and persistent
    buffer; per-expert tensors re-fused, row-sharded tables (the PLE n-gram tables) concatenated as transformers does
    on load."""
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))

    def read(logical: str) -> Callable[[], Tensor]:
        return lambda: weights.tensor(logical, dtype, fold_pre_quant=fold_pre_quant)

    def concat(shards: list[str]) -> Callable[[], Tensor]:
        return lambda: torch.cat([weights.tensor(n, dtype, fold_pre_quant=fold_pre_quant) for n in shards])

    def fuse(by_expert: dict[int, dict[str, str]], count: int, pieces: tuple[str, ...]) -> Callable[[], Tensor]:
        return lambda: torch.stack(
            [
                torch.cat([weights.tensor(by_expert[e][p], dtype, fold_pre_quant=fold_pre_quant) for p in pieces])
                for e in range(count)
            ]
        )

    tables = sharded_tables(weights.names())
    in_tables = {n for shards in tables.values() for n in shards}
    for table, shards in tables.items():
        target = _model_name(weights, table)
        if target is not None:
            yield target, concat(list(shards))
    for logical in weights.names():
        target = _model_name(weights, logical)
        if target is None or logical in in_tables:
            continue
        m = _EXPERT_RE.match(target)
        if m:
            experts[m["stem"]][int(m["e"])][m["proj"]] = logical
            continue
        yield target, read(logical)
    for stem, by_expert in experts.items():
        count = max(by_expert) + 1
        missing = [e for e in range(count) if set(by_expert.get(e, {})) != _PER_EXPERT_PROJS]
        if missing:
            raise ValidateLoadError(f"{weights.label}: {stem}: experts {missing[:8]} lack gate/up/down tensors")
        for fused, pieces in FUSED_EXPERT_PIECES.items():
            yield f"{stem}.{fused}", fuse(by_expert, count, pieces)


def _persistent(model: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` is saved with the model (``state_dict``), i.e. a checkpoint tensor."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in getattr(module, "_non_persistent_buffers_set", set())


class _OnDisk(Mapping[str, Tensor]):
    """The weights accelerate's disk offload reads (``OffloadedWeightsLoader``'s state dict): each read and
    dequantized from the checkpoint when its module runs, so memory holds the modules placed in it plus one."""

    def __init__(self, producers: dict[str, Callable[[], Tensor]]) -> None:
        self._producers = producers

    def __getitem__(self, key: str) -> Tensor:
        return self._producers[key]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._producers)

    def __len__(self) -> int:
        return len(self._producers)


def _device_map(
    model: nn.Module, device: torch.device, dtype: torch.dtype, max_memory: Mapping[int | str, int] | None = None
) -> dict[str, Any]:
    from accelerate import infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    if max_memory is not None:  # accelerate's placement under the caps; what does not fit stays on disk
        placed = dict(
            infer_auto_device_map(model, max_memory=dict(max_memory), no_split_module_classes=no_split, dtype=dtype)
        )
        if next(iter(placed.values()), "disk") == "disk":
            # accelerate keeps room for the largest layer (here the embedding or the LM head) beside what it places:
            # when that leaves the first module on disk, its forward would start from the meta device
            from mtpquant.errors import MemoryPlanError
            from mtpquant.units import format_bytes

            caps = ",".join(f"{d}={format_bytes(n)}" for d, n in max_memory.items())
            name = str(dtype).removeprefix("torch.")
            raise MemoryPlanError(
                f"--max-memory {caps}: accelerate leaves the model's first weights on disk in {name} "
                "(it keeps room for the largest layer, the embedding or the LM head, beside them); raise the cap or "
                "compute in bfloat16 (--dtype bfloat16)"
            )
        return placed
    if device.type == "cpu":
        return {"": "cpu"}
    if device.index is not None:
        return {"": f"cuda:{device.index}"}
    device_map = dict(infer_auto_device_map(model, no_split_module_classes=no_split, dtype=dtype))
    if "disk" in device_map.values():
        # Dequantized weights are built in memory anyway; keep what does not fit the GPUs in RAM.
        log.warning("the dequantized model does not fit the GPUs: offloading part of it to CPU memory")
        device_map = {k: ("cpu" if v == "disk" else v) for k, v in device_map.items()}
    return device_map


def text_model_class(weights: CheckpointWeights) -> Any:
    """The family's transformers text class (``Qwen3_5ForCausalLM``, ...); importing it takes seconds."""
    import transformers

    return getattr(transformers, weights.spec.family.text_class)


def load_target(
    weights: CheckpointWeights,
    *,
    device: torch.device,
    dtype: torch.dtype,
    activations: str = "off",
    max_memory: Mapping[int | str, int] | None = None,
) -> TargetModel:
    """Build the family's transformers text model from the checkpoint and place it per device.

    ``max_memory`` (accelerate's: GPU index or ``"cpu"`` -> bytes) caps what is placed where; the modules that do not
    fit stay on disk, read from the checkpoint and dequantized each time they run (bounded memory, as convert's
    offloaded models are read from SRC's files).
    """
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    family = weights.spec.family
    cls = text_model_class(weights)
    hf_config = transformers_config(_text_config(weights), cls.config_class)
    with init_empty_weights():
        model = cls(hf_config)
    model.eval()
    device_map = _device_map(model, device, dtype, max_memory)

    def place(name: str) -> str:
        best = ""
        for key in device_map:
            if (key == "" or name == key or name.startswith(key + ".")) and len(key) >= len(best):
                best = key
        return str(device_map[best])

    emulate = activations == "emulate"
    expected = {n for n, _ in model.named_parameters()}
    buffers = {n for n, _ in model.named_buffers() if _persistent(model, n)}
    loaded: set[str] = set()
    on_disk: dict[str, Callable[[], Tensor]] = {}
    for name, produce in _target_tensors(weights, dtype, fold_pre_quant=not emulate):
        if name not in expected and name not in buffers:
            raise ValidateLoadError(f"{weights.label}: tensor for {name!r} has no place in {family.text_class}")
        if place(name) == "disk":
            on_disk[name] = produce
        else:
            set_module_tensor_to_device(model, name, place(name), value=produce())
        loaded.add(name)
    if hf_config.tie_word_embeddings and "lm_head.weight" not in loaded:
        model.tie_weights()
        loaded.add("lm_head.weight")
        if place("lm_head.weight") == "disk":  # accelerate's offload reads the tied head by its own name
            embedding = model.get_input_embeddings().weight
            embed_name = next(n for n, p in model.named_parameters() if p is embedding)
            on_disk["lm_head.weight"] = on_disk.get(embed_name) or (lambda: embedding.detach())
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:6]) + (f", ... ({len(missing) - 6} more)" if len(missing) > 6 else "")
        raise ValidateLoadError(f"{weights.label}: {len(missing)} main-model weights missing: {shown}")
    # Emulation first: a fused-experts forward it replaces is then the one accelerate's hooks wrap.
    emulated = _install_target_emulation(model, weights) if emulate else []
    # Buffers (rotary inv_freq) were built on CPU; dispatch_model moves everything per the map. Modules on disk
    # read their weights from ``_OnDisk`` (offload_index {}: nothing was saved to an offload folder).
    if on_disk:
        model = dispatch_model(model, device_map=device_map, state_dict=_OnDisk(on_disk), offload_index={})
    elif len(set(device_map.values())) > 1:
        model = dispatch_model(model, device_map=device_map)
    else:
        model = model.to(next(iter(device_map.values())))
    if on_disk:
        log.info("%s: %d weights stay on disk, dequantized when their module runs", weights.label, len(on_disk))
    return TargetModel(model, device_map, dtype, emulated, family.mtp.hidden_source)


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
            modules[target_module].register_forward_pre_hook(pre_hook(quantize))
            emulated.append(module)
    for stem, by_proj in expert_scales.items():
        # All experts of a layer share one input scale for gate/up and one for down (vLLM takes the
        # max when they differ); the fused experts module gets a forward that quantizes both inputs.
        gate_up = [f for p in ("gate_proj", "up_proj") for f in by_proj.get(p, [])]
        down = by_proj.get("down_proj", [])
        q_in = shared_quantizer(gate_up)
        q_mid = shared_quantizer(down)
        if stem in modules and (q_in or q_mid):
            emulate_fused_experts(modules[stem], q_in, q_mid)
            emulated.append(stem)
    return emulated
