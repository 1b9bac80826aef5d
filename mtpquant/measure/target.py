"""The target (main) model for evaluation: loaded from ``weights.CheckpointWeights`` (``load_target``) and run over
planned sequences (``capture``: its continuations, greedy or sampled, and its hidden states, computed once and
measured against as many MTPs as needed: validate's sides, heal's before and after).

The target model is the family's transformers text class (``Qwen3_5ForCausalLM``, ...) built on the meta
device and filled tensor by tensor with the dequantized state dict (the wrapper prefix ``model.language_model.``
mapped to ``model.``; per-expert tensors re-fused into transformers' 3-D ``experts.gate_up_proj`` /
``experts.down_proj``), then placed by an accelerate ``device_map``: ``{"": "cpu"}`` on CPU,
``infer_auto_device_map`` over the GPUs (and CPU offload) otherwise. The same code path serves every device.
Activation emulation (``activations="emulate"``, the fake-quantizers of ``emulate.py``) is installed on its
quantized Linears. Only this module and ``drafter`` (of ``measure``) import transformers' model code.
"""

from __future__ import annotations

import copy
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from mtpquant.checkpoint.sharded import sharded_tables
from mtpquant.errors import ValidateLoadError
from mtpquant.families import FUSED_EXPERT_PIECES, TensorClass
from mtpquant.hfconfig import transformers_config
from mtpquant.measure.emulate import activation_quantizer, emulate_expert_banks, pre_hook
from mtpquant.measure.replay import SequenceRecord, TargetRun
from mtpquant.measure.rules import target_probs
from mtpquant.measure.weights import (
    CheckpointWeights,
    LinearFormat,
)
from mtpquant.mtp.qwen4_exp import exact_selections
from mtpquant.records.sampling import SamplingSettings
from mtpquant.text.prompts import PlannedSequence

__all__ = ["TargetModel", "capture", "load_target", "text_model_class"]

log = logging.getLogger(__name__)

_PER_EXPERT_PROJS = {p for pieces in FUSED_EXPERT_PIECES.values() for p in pieces}
_EXPERT_RE = re.compile(
    r"^(?P<stem>.*\.(?:mlp|mixer)\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(sorted(_PER_EXPERT_PROJS))
    + r")\.weight$"
)
# Nemotron-H's ungated experts (``mixer.experts.{e}.{up,down}_proj``): transformers' NemotronHExperts keeps each
# projection as its own 3-D parameter
_UNGATED_PIECES = {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}


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
        name = "model." + logical[len(weights.main_prefix) :]
        for theirs, ours in weights.spec.family.hf_renames:  # what transformers' conversion_mapping renames on load
            if name.endswith(theirs):
                return name[: -len(theirs)] + ours
        return name
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

    def release(self) -> None:
        """Free the model's memory before the next model loads (the target is unusable after)."""
        import gc

        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
        gated = any("gate_proj" in projs for projs in by_expert.values())
        want = _PER_EXPERT_PROJS if gated else set(_UNGATED_PIECES)
        missing = [e for e in range(count) if set(by_expert.get(e, {})) != want]
        if missing:
            raise ValidateLoadError(f"{weights.label}: {stem}: experts {missing[:8]} lack gate/up/down tensors")
        for fused, pieces in (FUSED_EXPERT_PIECES if gated else _UNGATED_PIECES).items():
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
    from mtpquant.runtime.hf_classes import model_class

    return model_class(weights.spec.family.text_class)


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
    exact_selections(model)  # Qwen4-Exp's QSA selections without transformers' per-query loop, bit for bit
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
    return emulated + emulate_expert_banks(modules, expert_scales)


def _batches(lengths: Sequence[Hashable], batch_size: int) -> list[list[int]]:
    """Indices of equal ``lengths`` in chunks of at most ``batch_size``, in first-seen order (no padding: every
    row of a batch has the inputs it would have alone)."""
    groups: dict[Hashable, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return [g[j : j + batch_size] for g in groups.values() for j in range(0, len(g), batch_size)]


def capture(
    target: TargetModel,
    plan: Sequence[PlannedSequence],
    *,
    label: str,
    reference: TargetRun | None = None,
    progress: bool = True,
    batch_size: int = 16,
    sampling: SamplingSettings | None = None,
    lookahead: int = 0,
) -> TargetRun:
    """Continuations (greedy, or sampled with ``sampling``) and hidden states for each planned sequence (and over
    ``reference``'s sequences).

    Sequences of the same prompt and continuation lengths are generated together, ``batch_size`` at a time (nothing
    is padded or masked). The tokens are those of one prompt at a time (a sampled prompt draws from its own
    generator, seeded by ``sampling.for_prompt(i)``); the hidden states are bit-identical on CPU for the dense
    family and within float rounding for MoE experts, whose GEMMs see more rows when batched
    (tests/test_validate.py); on GPU batched GEMMs may round differently too.

    ``lookahead``: the target continues each sequence that many tokens past its plan, recorded as after its ``end``
    (the engine drafts k at its last steps and verifies them against the target's tokens past ``max_tokens``).
    """
    shapes = [(len(s.prompt), s.new_tokens) for s in plan]
    records: list[SequenceRecord | None] = [None] * len(plan)
    with tqdm(total=len(plan), desc=f"target {label}", unit="prompt", disable=not progress) as bar:
        for batch in _batches(shapes, batch_size):
            new = plan[batch[0]].new_tokens
            prompt = torch.tensor([list(plan[i].prompt) for i in batch], dtype=torch.long)
            generators = (
                [torch.Generator().manual_seed(sampling.for_prompt(i).seed) for i in batch]
                if sampling is not None and not sampling.greedy
                else []
            )
            tokens = target.generate(prompt, new + lookahead, sampling, generators).cpu()
            head, mtp_input = target.hidden_states(tokens)
            for row, i in enumerate(batch):
                extra = None if mtp_input is None else mtp_input[row].cpu().clone()
                end = len(plan[i].prompt) + new if lookahead else None
                records[i] = SequenceRecord(tokens[row].clone(), len(plan[i].prompt), head[row].cpu().clone(), extra,
                                            end)
            bar.update(len(batch))
    seqs = [r for r in records if r is not None]
    on_ref = None
    if reference is not None:
        ref_seqs = reference.sequences
        hidden_on_ref: list[torch.Tensor | None] = [None] * len(ref_seqs)
        with tqdm(total=len(ref_seqs), desc=f"target {label} on reference", disable=not progress) as bar:
            for batch in _batches([len(s.tokens) for s in ref_seqs], batch_size):
                hidden = target.hidden(torch.stack([ref_seqs[i].tokens for i in batch])).cpu()
                for row, i in enumerate(batch):
                    hidden_on_ref[i] = hidden[row].clone()
                bar.update(len(batch))
        on_ref = [h for h in hidden_on_ref if h is not None]
    return TargetRun(label, seqs, on_ref, sampling or SamplingSettings())
