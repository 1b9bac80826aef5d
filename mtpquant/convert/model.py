"""The main (language) model through transformers and nvidia-modelopt: load, calibrate, export.

Loading uses the family's transformers class. ``device="cpu"`` keeps every weight in host memory;
``device="cuda"`` uses accelerate's ``device_map="auto"`` (GPU sharding with CPU and disk offload for
what does not fit), which is also the scale-out path: modelopt calibrates through accelerate's hooks
and ``export_hf_checkpoint`` switches to its streaming writer (one layer at a time) for offloaded
models. modelopt prints progress to stdout; here that text goes to the debug log instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import OutputVerificationError
from mtpquant.families import ModelSpec
from mtpquant.runtime.hf_classes import model_class
from mtpquant.runtime.libraries import modelopt_quiet
from mtpquant.runtime.memory import MemoryPlan

__all__ = [
    "base_model",
    "calibration_loop",
    "export_quantized",
    "final_hidden_states",
    "input_device",
    "is_offloaded",
    "load_main_model",
    "mtp_hidden_states",
    "placement",
    "quantize_main_model",
    "repair_exported_names",
    "source_dtype",
]

log = logging.getLogger(__name__)


def source_dtype(spec: ModelSpec) -> torch.dtype:
    """The dtype the source declares (``dtype`` / ``torch_dtype``), bfloat16 by default."""
    for cfg in (spec.config, spec.text):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if value in {"float16", "bfloat16", "float32"}:
            dtype: torch.dtype = getattr(torch, str(value))
            return dtype
    return torch.bfloat16


def load_main_model(src: Path, ckpt: Checkpoint, memory: MemoryPlan, device: str, offload_dir: Path) -> Any:
    """Load the main model with the family's transformers class (MTP tensors are skipped by it).

    In memory on ``cpu``; otherwise through accelerate's ``device_map="auto"`` under the plan's caps,
    with what does not fit left on disk, read from SRC's safetensors (experts transformers fuses while
    loading too: ``offload.py``; ``offload_dir`` takes whatever transformers must still re-save).
    """
    from mtpquant.convert.offload import fused_offload, install_fused_loader
    from mtpquant.runtime.memory import release_file_pages
    from mtpquant.units import format_bytes

    spec = ckpt.spec
    cls = model_class(spec.architecture)
    kwargs: dict[str, Any] = {"dtype": source_dtype(spec)}
    if memory.caps is not None or device == "cuda":
        kwargs["device_map"] = "auto"
        if memory.caps is not None:
            kwargs["max_memory"] = memory.caps.for_accelerate()
        offload_dir.mkdir(parents=True, exist_ok=True)
        kwargs["offload_folder"] = str(offload_dir)
    with modelopt_quiet(), fused_offload(ckpt, src) as fused:
        # the supported families never need remote code: never run code shipped with a checkpoint
        model = cls.from_pretrained(str(src), trust_remote_code=False, **kwargs)
    install_fused_loader(model, fused)
    if memory.offloaded:  # the pages transformers read through its mappings of SRC, the offloaded layers' included
        mapped = release_file_pages(str(src / shard) for shard in ckpt.shards)
        log.info("gave back the pages read from SRC's mapped files after loading (%s mapped)", format_bytes(mapped))
    model.eval()
    model.requires_grad_(False)
    placed = placement(model)
    if placed:
        log.info("accelerate placed the model: %s", ", ".join(f"{n} modules on {d}" for d, n in sorted(placed.items())))
    return model


def placement(model: Any) -> dict[str, int]:
    """Modules per device in accelerate's device map (empty when the model was loaded without one)."""
    counts: dict[str, int] = {}
    for device in (getattr(model, "hf_device_map", None) or {}).values():
        key = f"cuda:{device}" if isinstance(device, int) else str(device)
        counts[key] = counts.get(key, 0) + 1
    return counts


def is_offloaded(model: Any) -> bool:
    """Whether accelerate offloads part of the model (to disk, or to CPU under a GPU)."""
    from modelopt.torch.quantization.utils.core_utils import has_accelerate_offload

    return bool(has_accelerate_offload(model))


def base_model(model: Any) -> Any:
    """The decoder stack whose ``last_hidden_state`` is the post-final-norm hidden state."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise TypeError(f"{type(model).__name__} has no .model decoder")
    return inner


def input_device(model: Any) -> torch.device:
    """Where calibration token ids go (accelerate's hooks move them on from there)."""
    emb = model.get_input_embeddings()
    dev = emb.weight.device
    if dev.type == "meta":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    return dev


def calibration_loop(
    batches: Callable[[], Iterable[torch.Tensor]],
    device: torch.device,
    *,
    bar: Any | None = None,
    before_pass: Callable[[], None] | None = None,
) -> Callable[[Any], None]:
    """The forward loop modelopt calls with the model: every calibration batch through the whole model.

    It calls the top-level model (modelopt's layer-wise mode stops that call early at the layer it
    captures) and keeps one logit per row (the LM head is never quantized; its output is unused).
    ``before_pass`` runs at the start of each pass (layer-wise calibration makes one per layer).
    """

    def loop(model: Any) -> None:
        if before_pass is not None:
            before_pass()
        with torch.no_grad():
            for batch in batches():
                model(input_ids=batch.to(device), use_cache=False, logits_to_keep=1)
                if bar is not None:
                    bar.update(int(batch.shape[0]))

    return loop


def quantize_main_model(
    model: Any,
    quant_cfg: dict[str, Any],
    forward_loop: Callable[[Any], None],
    *,
    layerwise_dir: str | None = None,
    save_every: int = 1,
    progress: bool = True,
) -> Any:
    """``mtq.quantize`` with the recipe's config and the calibration forward loop.

    ``layerwise_dir``: calibrate layer by layer through modelopt's ``layerwise`` mode, keeping its
    per-layer resume state there, committed every ``save_every`` layers. With max calibration it captures each
    layer's inputs with the quantizers off, so every layer sees the activations of the in-memory pass: the same
    amax.
    """
    import modelopt.torch.quantization as mtq

    cfg = dict(quant_cfg)
    if layerwise_dir is not None:
        method = cfg.get("algorithm")
        if method != "max":
            raise ValueError(f"layer-wise calibration is wired for max calibration, not {method!r}")
        cfg["algorithm"] = {
            "method": "max",
            "layerwise": {
                "enable": True,
                "checkpoint_dir": layerwise_dir,
                "save_every": save_every,
                "calib_mutates_weights": False,
            },
        }
    with modelopt_quiet(progress), torch.no_grad():
        return mtq.quantize(model, cfg, forward_loop)


def mtp_hidden_states(decoder: Any, ids: torch.Tensor, hidden_source: str | None = None) -> torch.Tensor:
    """The MTP's hidden input at every position of ``ids``: the decoder's ``last_hidden_state`` (after the final
    norm), or, with ``hidden_source`` (the family's ``MtpLayout.hidden_source``, Qwen4-Exp's
    ``hyper_connection_mixer``), the input of that decoder submodule (the multi-stream state the mixer collapses)."""
    if hidden_source is None:
        out: torch.Tensor = decoder(input_ids=ids, use_cache=False).last_hidden_state
        return out
    found = [m for n, m in decoder.named_modules() if n == hidden_source or n.endswith("." + hidden_source)]
    if len(found) != 1:
        raise TypeError(f"{type(decoder).__name__}: expected one {hidden_source!r} module, found {len(found)}")
    seen: list[torch.Tensor] = []
    handle = found[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        decoder(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen[-1]


def final_hidden_states(
    model: Any, batches: Callable[[], Iterable[torch.Tensor]], device: torch.device, hidden_source: str | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch, the MTP's calibration inputs: its hidden input at ``t`` (``mtp_hidden_states``) and the
    embedding of ``x_{t+1}``.

    Runs after calibration with every quantizer off, so these are the hidden states of the source
    model, exactly those the in-memory calibration pass computes (its quantizers only observe).
    """
    from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context

    decoder = base_model(model)
    embed = model.get_input_embeddings()
    with set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}]), torch.no_grad():
        for batch in batches():
            ids = batch.to(device)
            hidden = mtp_hidden_states(decoder, ids, hidden_source)[:, :-1]
            yield hidden, embed(ids[:, 1:])


def _source_precision_hooks(model: Any, src: Any) -> list[Any]:
    """State-dict hooks that put back the source bytes of unquantized tensors whose dtype loading changed.

    Qwen3.5 stores ``linear_attn.A_log`` and the gated norm in float32; transformers loads the whole
    model in bfloat16. When the exported value is exactly the source value rounded, the export gets
    the source tensor itself (same bytes, float32), so the exported shards are final as written.
    """
    from mtpquant.checkpoint.dtypes import torch_dtype

    hooks = []
    owners: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        entry = src.tensors.get(name)
        if entry is None or not param.is_floating_point():
            continue
        src_dtype = torch_dtype(entry.dtype)
        if src_dtype == param.dtype or not src_dtype.is_floating_point:
            continue
        module_name, _, leaf = name.rpartition(".")
        owners.setdefault(module_name, {})[leaf] = entry
    modules = dict(model.named_modules())
    for module_name, leaves in owners.items():

        def hook(
            module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any, leaves: dict[str, Any] = leaves
        ) -> None:
            del module, local_metadata
            for leaf, entry in leaves.items():
                value = state_dict.get(prefix + leaf)
                if not isinstance(value, torch.Tensor) or value.is_meta or tuple(value.shape) != tuple(entry.shape):
                    continue
                original = src.read_tensor(entry.name)
                if torch.equal(original.to(value.dtype), value.to(original.device)):
                    state_dict[prefix + leaf] = original

        hooks.append(modules[module_name].register_state_dict_post_hook(hook))
    return hooks


def _sharded_table_hooks(model: Any, src: Any) -> list[Any]:
    """State-dict hooks that leave out of the export every table the source stores in row shards (the PLE n-gram
    table: ~95 GiB a layer at full size); ``assemble.place_main_shards`` writes the source's shards instead."""
    from mtpquant.checkpoint.sharded import sharded_tables

    tables = set(sharded_tables(src.tensors))
    hooks = []
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        if name not in tables:
            continue
        module_name, _, leaf = name.rpartition(".")

        def hook(module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any, leaf: str = leaf) -> None:
            del module, local_metadata
            state_dict.pop(prefix + leaf, None)

        hooks.append(modules[module_name].register_state_dict_post_hook(hook))
    return hooks


def _layer_progress_hooks(model: Any, bar: Any) -> list[Any]:
    """Advance ``bar`` once per decoder layer as the export reads it."""
    from modelopt.torch.quantization.utils.layerwise_calib import LayerActivationCollector

    layers = LayerActivationCollector.get_decoder_layers(model) or []
    seen: set[int] = set()

    def hook(module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        del state_dict, prefix, local_metadata
        if id(module) not in seen:
            seen.add(id(module))
            bar.update(1)

    return [layer.register_state_dict_post_hook(hook) for layer in layers]


def export_quantized(
    model: Any, export_dir: Path, dtype: torch.dtype, src: Any, max_shard_bytes: int, bar: Any | None = None
) -> None:
    """``export_hf_checkpoint`` into ``export_dir`` (modelopt streams an offloaded model layer by layer).

    Unquantized tensors come out in their source dtype and bytes (``_source_precision_hooks``), so
    the exported shards need no second write.
    """
    from modelopt.torch.export import export_hf_checkpoint

    hooks = _source_precision_hooks(model, src) + _sharded_table_hooks(model, src)
    if bar is not None:
        hooks += _layer_progress_hooks(model, bar)
    try:
        with modelopt_quiet():
            export_hf_checkpoint(model, dtype=dtype, export_dir=str(export_dir), max_shard_size=max_shard_bytes)
    finally:
        for h in hooks:
            h.remove()
    repair_exported_names(export_dir)


# modelopt 0.47 (export/quant_aware_conversion.py build_reverse_name_mapper) renames each exclusion back to the hub's
# names with ".\x00modelopt_name_sentinel" appended and then strips that suffix; a rename rule that matches "model."
# with its dot as any character (Nemotron-H's model. -> backbone.) rewrites the sentinel too ("modelo" ->
# "backbone."), so the suffix stays: "backbone.layers.0.\x00backbone.pt_name_sentinel*" matches no module and vLLM
# quantizes what the export left BF16 (the exclude_modules "corrupt suffix" of TensorRT-LLM#18607)
_SENTINEL = re.compile(r"\.?\x00[^*]*?_name_sentinel")


def _without_sentinel(value: Any) -> Any:
    if isinstance(value, str):
        return _SENTINEL.sub("", value)
    if isinstance(value, list):
        return [_without_sentinel(v) for v in value]
    if isinstance(value, dict):
        return {_without_sentinel(k): _without_sentinel(v) for k, v in value.items()}
    return value


def repair_exported_names(export_dir: Path) -> list[str]:
    """Strip modelopt's leftover name sentinel from the exclusions of ``export_dir``'s ``hf_quant_config.json`` and
    ``config.json`` (rewritten in place, only when one is there); returns the repaired files' names. An exclusion
    that still holds a NUL after the repair is an error (one line), never written on."""
    repaired = []
    for name in ("hf_quant_config.json", "config.json"):
        path = export_dir / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        if "\\u0000" not in text and "\x00" not in text:
            continue
        data = _without_sentinel(json.loads(text))
        dumped = json.dumps(data, indent=2, ensure_ascii=False)
        if "\\u0000" in dumped or "\x00" in dumped:
            raise OutputVerificationError(f"{path}: modelopt wrote a module name with a NUL mtpquant cannot repair")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(dumped + "\n", encoding="utf-8")
        os.replace(tmp, path)
        repaired.append(name)
        log.info("%s: removed modelopt's name sentinel from its exclusions", name)
    return repaired
