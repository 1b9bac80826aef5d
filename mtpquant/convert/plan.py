"""Convert, step 1: the plan, from config.json and safetensors headers only, and every early refusal.

Nothing here loads a tensor: ``--dry-run`` prints this plan (also for a Hub repo, through ranged header reads)
and stops. (transformers, and with it torch, is imported once: config.json is validated as transformers will
read it, so a config it refuses is refused here, before any output exists.) The refusals are one line each and
happen before any output directory exists: unsupported architecture, an already quantized source, an MTP mode the source
cannot serve (no MTP, incomplete MTP), a Linear the recipe would quantize whose input dimension is
not a multiple of 16, an existing output without ``--overwrite``, an output that is the source.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.modules import FUSED_EXPERT_PARAMS, linear_modules
from mtpquant.checkpoint.table import PICKLE_SUFFIXES, Checkpoint
from mtpquant.convert.ct_format import check_ct_recipe
from mtpquant.convert.options import ConvertOptions
from mtpquant.convert.resume import resume_interval
from mtpquant.errors import (
    IndivisibleDimensionError,
    OutputExistsError,
    RecipeError,
    SourceQuantizedError,
    UnsupportedArchitectureError,
    UsageError,
)
from mtpquant.families import FAMILIES, TensorClass
from mtpquant.formats.quant_config import HF_QUANT_CONFIG
from mtpquant.hfconfig import transformers_config
from mtpquant.recipes.recipe import (
    MTP_FORMATS,
    RECIPE_FILE,
    CalibrationSection,
    Recipe,
    apply_overrides,
    byte_size,
    default_recipe_name,
    load_recipe,
    quantizer_enabled,
    with_values,
)
from mtpquant.records.provenance import PROVENANCE_FILE, check_base_model
from mtpquant.runtime.machine import resolve_device
from mtpquant.runtime.memory import MemoryPlan, available_cpu_bytes, model_blocks, plan_memory
from mtpquant.search.mode import SearchMode
from mtpquant.search.settings import SearchSettings
from mtpquant.surgery.modes import BLOCK, MtpMode, choose_mode
from mtpquant.text.calibration import check_calibration_source

__all__ = [
    "ConvertOptions",
    "ConvertPlan",
    "carried_files",
    "plan_convert",
]

log = logging.getLogger(__name__)

# Files convert writes itself (or must not copy) instead of carrying them over from the source.
_REWRITTEN = {"config.json", HF_QUANT_CONFIG, INDEX_NAME, PROVENANCE_FILE, "README.md", "README", "model_card.md"}


@dataclass(frozen=True)
class ConvertPlan:
    """What convert will do, decided from headers only."""

    src: str
    out: Path
    mtp_out: Path | None
    family: str
    family_display: str
    architecture: str
    recipe: Recipe
    mtp_mode: MtpMode  # the mode object (``surgery.modes``) that does the MTP part of this plan
    mtp_format: str
    device: str
    max_shard_bytes: int
    source_tensors: int
    source_bytes: int
    source_shards: int
    mtp_tensors: tuple[str, ...]
    mtp_bytes: int
    mtp_declaration: str
    mtp_quantized: tuple[str, ...]  # quantize mode: MTP Linears to quantize
    mtp_unquantized: tuple[str, ...]  # the family's MTP Linears a quantized MTP keeps BF16 (fnmatch patterns)
    vision_tensors: int
    vision_bytes: int
    quantized_modules: tuple[str, ...]  # main-model Linears (checkpoint names) the recipe quantizes
    unquantized_modules: tuple[str, ...]  # main-model Linears left in the source precision
    carried_files: tuple[str, ...]
    memory: MemoryPlan
    notes: tuple[str, ...] = field(default_factory=tuple)
    resume_every: int = 1  # layer-wise calibration commits its resume state every N layers
    resume_activation_bytes: int = 0  # the layer inputs each commit saves (estimate)
    overwrite: bool = False  # an existing OUT (and MTP output) may be replaced
    command: tuple[str, ...] = ()  # the command line, recorded in the provenance file and the recipe's header
    base_model: str | None = None  # --base-model
    base_model_revision: str | None = None
    output_format: str = "modelopt"  # modelopt | compressed-tensors
    search: SearchSettings | None = None  # --mtp auto: what the search is asked
    search_space: dict[str, Any] | None = None  # --mtp auto: the configurations the engines load, from headers
    search_memory: MemoryPlan | None = None  # --mtp auto: where the quantized target the search measures on goes

    @property
    def mode(self) -> str:
        """The MTP mode's name (keep, quantize, extract, drop)."""
        return self.mtp_mode.name

    def mode_line(self) -> str:
        """One line saying what the MTP mode does."""
        return self.mtp_mode.plan_line(self)

    def to_json(self) -> dict[str, Any]:
        """Plain-data form for ``--json``."""
        return {
            "src": self.src,
            "out": str(self.out),
            "mtp_out": str(self.mtp_out) if self.mtp_out else None,
            "family": self.family,
            "architecture": self.architecture,
            "recipe": self.recipe.name,
            "mode": self.mode,
            "mtp_format": self.mtp_format,
            "format": self.output_format,
            "device": self.device,
            "max_shard_bytes": self.max_shard_bytes,
            "source": {"tensors": self.source_tensors, "bytes": self.source_bytes, "shards": self.source_shards},
            "mtp": {"tensors": len(self.mtp_tensors), "bytes": self.mtp_bytes, "declaration": self.mtp_declaration},
            "vision": {"tensors": self.vision_tensors, "bytes": self.vision_bytes},
            "main": {"quantized": len(self.quantized_modules), "unquantized": len(self.unquantized_modules)},
            "calibration": self.recipe.to_dict()["calibration"],
            "carried_files": list(self.carried_files),
            "memory": self.memory.to_json(),
            "resume_every": self.resume_every,
            "notes": list(self.notes),
            "base_model": self.base_model,
            "base_model_revision": self.base_model_revision,
            **({"search": {**self.search.to_json(), **(self.search_space or {}),
                           "memory": self.search_memory.to_json() if self.search_memory else None}}
               if self.search else {}),
        }


def carried_files(files: Sequence[str]) -> list[str]:
    """Source files copied unchanged: everything but weights, index, configs rewritten here, cards."""
    out = []
    for f in files:
        if f in _REWRITTEN or f.endswith((".safetensors", *PICKLE_SUFFIXES)):
            continue
        if f == RECIPE_FILE or f.endswith(".safetensors.index.json"):
            continue
        out.append(f)
    return sorted(out)


def _linear_modules(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Main-model Linear modules (checkpoint names; ``checkpoint.modules.linear_modules``) -> weight shape (fused
    3-D experts: [E, out, in])."""
    mods: dict[str, tuple[int, ...]] = {}
    for module in linear_modules(ckpt.tensors):
        name = module if module.endswith(FUSED_EXPERT_PARAMS) else module + ".weight"
        if name in ckpt.tensors and ckpt.classify(name) not in (TensorClass.MTP, TensorClass.VISION, TensorClass.EMBED):
            mods[module] = ckpt.tensors[name].shape
    return mods


def _quantizer_name(module: str) -> str:
    # Fused 3-D experts get `<experts>.gate_up_proj_weight_quantizer` in modelopt; either spelling
    # matches the same patterns (`*weight_quantizer`, `*.experts.*`).
    return f"{module}.weight_quantizer"


def _resolve_recipe(options: ConvertOptions, family: Any) -> Recipe:
    recipe = load_recipe(options.recipe or default_recipe_name(family))
    recipe = apply_overrides(recipe, options.overrides, "--set")  # --set key=value: text by nature
    flags: dict[tuple[str, str], Any] = {
        ("calibration", "data"): options.calib_data,
        ("calibration", "samples"): options.calib_samples,
        ("calibration", "seq_len"): options.calib_seq_len,
        # parsed here, once, with the flag's own message ("--max-shard-size: ... is not a size")
        ("output", "max_shard_size"): (
            None if options.max_shard_size is None else byte_size(options.max_shard_size, "--max-shard-size")
        ),
        ("mtp", "mode"): "search" if options.mtp == "auto" else options.mtp,
        ("mtp", "format"): options.mtp_format,
    }
    recipe = with_values(recipe, {k: v for k, v in flags.items() if v is not None}, "command-line flags")
    recipe.check_family(family)
    check_calibration_source(recipe.calibration.data)
    return recipe


def _check_output(path: Path, src: Path | None, overwrite: bool, what: str) -> None:
    if src is not None:
        a, b = path.resolve(), src.resolve()
        if a == b or b in a.parents or a in b.parents:
            raise OutputExistsError(f"{path}: {what} must not be the source directory, inside it, or contain it")
    if os.path.lexists(path):
        from mtpquant.records.provenance import check_replaceable

        check_replaceable(path)  # what --overwrite would refuse is refused so, with or without it
        if not overwrite:
            raise OutputExistsError(f"{path}: output already exists (use --overwrite to replace it)")


def _check_not_quantized(ckpt: Checkpoint) -> None:
    meta = ckpt.quant_metadata
    if meta is not None:
        raise SourceQuantizedError(
            f"{ckpt.label}: already quantized ({meta.method} {meta.algo}); convert needs the BF16 checkpoint "
            "(to add a missing MTP to an existing quant, use `mtpquant graft`)"
        )
    packed = next((n for n, e in ckpt.tensors.items() if e.dtype in {"U8", "F8_E4M3", "I8"}), None)
    if packed is not None:
        raise SourceQuantizedError(
            f"{ckpt.label}: tensor {packed} is {ckpt.tensors[packed].dtype}; convert needs a BF16 checkpoint"
        )


def plan_convert(options: ConvertOptions, ckpt: Checkpoint | None = None) -> tuple[ConvertPlan, Checkpoint]:
    """Build the plan and run every early refusal; returns the plan and the opened source."""
    base_model, base_revision = check_base_model(options.base_model, options.base_model_revision)
    options.check_fields(UsageError)
    if ckpt is None:
        ckpt = Checkpoint.open(options.src, revision=options.revision, strict=True)
    spec = ckpt.spec
    family = spec.family
    if not family.convert:  # recognised for the MTP doctor (inspect, graft, --fix-metadata), not converted
        convertible = ", ".join(sorted(f.display for f in FAMILIES if f.convert))
        raise UnsupportedArchitectureError(
            f"{ckpt.label}: convert does not quantize {family.display} ({spec.architecture}); it converts "
            f"{convertible}. inspect, graft and graft --fix-metadata work on it"
        )
    local_src = ckpt.source.local_root
    out = Path(options.out).expanduser()
    _check_output(out, local_src, options.overwrite, "OUT")  # before transformers loads (seconds): refused at once
    recipe = _resolve_recipe(options, family)
    _check_not_quantized(ckpt)
    mtp_format = recipe.mtp.format
    if mtp_format not in MTP_FORMATS:
        raise RecipeError(f"--mtp-format must be one of {', '.join(MTP_FORMATS)}")
    mtp_mode, auto_notes = choose_mode(recipe.mtp.mode, ckpt, extra={SearchMode.name: SearchMode()})
    mode = mtp_mode.name
    if options.mtp_out is not None and not mtp_mode.writes_side_output:
        raise RecipeError(f"--mtp-out is only used with --mtp extract (mode is {mode})")
    if options.mtp_format is not None and not mtp_mode.takes_format:
        raise RecipeError(f"--mtp-format is only used with --mtp quantize (mode is {mode})")
    if options.output_format == "compressed-tensors":
        q = recipe.quantization
        check_ct_recipe(q.quant_algo, q.activations, mtp_format, mode)
    searching = mtp_mode.needs_target
    if options.search != SearchSettings() and not searching:
        raise RecipeError(
            "--al-budget, --engine, --mtp-precisions and --search-prompts are only used with --mtp auto "
            f"(mode is {mode})"
        )
    if searching and options.output_format != "modelopt":
        raise RecipeError("--mtp auto writes the ModelOpt format only (--format modelopt)")
    q = recipe.quantization
    checked = mtp_mode.check(ckpt, mtp_format, q.targets, tuple(q.exclude))
    search_space = _search_space(ckpt, options.search, recipe) if searching else None
    if options.plan_check is not None:  # before transformers loads: refused in a second, not after the conversion
        options.plan_check(ckpt, mode)
    transformers_config(ckpt.config)  # transformers' own validation: refused here (exit 3), not at a later load
    notes = [*auto_notes, *checked.notes]

    # Which main Linears the recipe quantizes, and their block divisibility.
    quant_cfg = recipe.to_modelopt_config(family)["quant_cfg"]
    linears = _linear_modules(ckpt)
    quantized = sorted(m for m in linears if quantizer_enabled(_quantizer_name(m), quant_cfg))
    unquantized = sorted(set(linears) - set(quantized))
    for m in quantized:
        in_dim = linears[m][-1]
        if in_dim % BLOCK:
            raise IndivisibleDimensionError(
                f"{m}: input dimension {in_dim} is not a multiple of {BLOCK} (the NVFP4 block size); keep it in BF16 "
                f"with --set 'quantization.exclude=[\"{m}\"]' or use another recipe"
            )

    mtp_out: Path | None = None
    if mtp_mode.writes_side_output:
        mtp_out = Path(options.mtp_out).expanduser() if options.mtp_out else out.with_name(out.name + "-mtp")
        if mtp_out.resolve() == out.resolve():
            raise OutputExistsError(f"{mtp_out}: --mtp-out must differ from OUT")
        _check_output(mtp_out, local_src, options.overwrite, "--mtp-out")
    device = resolve_device(options.device, indexed=False, probe=not options.dry_run)
    groups = ckpt.by_class()
    vision = groups.get(TensorClass.VISION, [])
    mtp = ckpt.mtp_tensors()
    memory = plan_memory(
        _loaded_blocks(ckpt),
        device=device,
        max_memory=options.max_memory,
        layerwise=options.layerwise,
        shard_bytes=recipe.output.max_shard_size.bytes,
        available=_available_memory(device),
    )
    layers = spec.dim("num_hidden_layers")
    activations = _layer_inputs_bytes(ckpt, recipe.calibration)
    plan = ConvertPlan(
        src=ckpt.label if local_src is None else str(local_src),
        out=out,
        mtp_out=mtp_out,
        family=family.key,
        family_display=family.display,
        architecture=spec.architecture,
        recipe=recipe,
        mtp_mode=mtp_mode,
        mtp_format=mtp_format,
        device=device,
        max_shard_bytes=memory.shard_bytes,
        source_tensors=len(ckpt.tensors),
        source_bytes=ckpt.total_bytes,
        source_shards=len(ckpt.shards),
        mtp_tensors=tuple(e.name for e in mtp),
        mtp_bytes=sum(e.nbytes for e in mtp),
        mtp_declaration=spec.mtp.describe(),
        mtp_quantized=checked.quantized,
        mtp_unquantized=family.mtp.unquantized,
        vision_tensors=len(vision),
        vision_bytes=sum(e.nbytes for e in vision),
        quantized_modules=tuple(quantized),
        unquantized_modules=tuple(unquantized),
        carried_files=tuple(carried_files(ckpt.source.list_files())),
        memory=memory,
        notes=tuple(notes),
        resume_every=options.resume_every or resume_interval(layers, activations, memory.model_bytes),
        resume_activation_bytes=activations,
        overwrite=options.overwrite,
        command=tuple(options.command),
        base_model=base_model,
        base_model_revision=base_revision,
        output_format=options.output_format,
        search=options.search if searching else None,
        search_space=search_space,
        search_memory=_search_memory(ckpt, device, options.max_memory, recipe) if searching else None,
    )
    return plan, ckpt


def _search_memory(ckpt: Checkpoint, device: str, max_memory: str | None, recipe: Recipe) -> MemoryPlan:
    """Where the quantized main model goes while the search measures on it (dequantized in the compute dtype, the
    logical shapes SRC's): convert's memory plan under the same ``--max-memory``, the rest read from OUT's files."""
    from mtpquant.measure.memory import plan_target_memory
    from mtpquant.runtime.machine import DTYPE_BYTES, compute_dtype

    shapes = ((e.name, tuple(e.shape)) for e in ckpt.tensors.values())
    return plan_target_memory(shapes, ckpt.classify, DTYPE_BYTES[compute_dtype(device, None)], device,
                              max_memory=max_memory, shard_bytes=recipe.output.max_shard_size.bytes,
                              who="convert --mtp auto")  # fmt: skip


def _search_space(ckpt: Checkpoint, settings: SearchSettings, recipe: Recipe) -> dict[str, Any]:
    """What ``--dry-run`` says of the search from headers: the groups, how many configurations the engines load,
    the BF16 MTP's bytes and the smallest configuration's. Refuses a search with nothing to choose from."""
    from mtpquant.search.run import search_space

    q = recipe.quantization
    space = search_space(ckpt, settings, main_algo=q.quant_algo, activations=q.activations, exclude=q.exclude)
    configurations = space.configurations()
    if len(configurations) < 2:
        raise RecipeError(
            f"--mtp auto: {settings.engine} loads no quantized configuration of this MTP with the precisions "
            f"{', '.join(settings.precisions)}; nothing to search (use --mtp keep)"
        )
    return {
        "groups": list(space.group_keys),
        "configurations": len(configurations),
        "bf16_bytes": space.nbytes(space.bf16),
        "smallest_bytes": space.nbytes(configurations[0]),
    }


_LOAD_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _layer_inputs_bytes(ckpt: Checkpoint, cal: CalibrationSection) -> int:
    """What modelopt saves as one layer's inputs: per calibration token the hidden state and the rotary cos/sin
    (a quarter of head_dim each) in the load dtype, and its position id; plus ~2 kB of file structure per batch."""
    spec = ckpt.spec
    head_dim = spec.text.get("head_dim")
    rotary = 2 * (head_dim // 4) if isinstance(head_dim, int) and not isinstance(head_dim, bool) else 0
    tokens = cal.samples * cal.seq_len
    per_token = (spec.hidden_size + rotary) * _loaded_bytes_per_element(ckpt) + 8
    return tokens * per_token + 2048 * -(-cal.samples // max(1, cal.batch_size))


def _loaded_bytes_per_element(ckpt: Checkpoint) -> int:
    for cfg in (ckpt.spec.config, ckpt.spec.text):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if value in _LOAD_DTYPE_BYTES:
            return _LOAD_DTYPE_BYTES[str(value)]
    return 2


def _loaded_blocks(ckpt: Checkpoint) -> list[Any]:
    """The main model's blocks as transformers loads them (every float tensor in the config's dtype; no MTP)."""
    size = _loaded_bytes_per_element(ckpt)
    entries = []
    vision: dict[str, bool] = {}
    for name, e in ckpt.tensors.items():
        cls = ckpt.classify(name)
        if cls == TensorClass.MTP:
            continue
        n = 1
        for d in e.shape:
            n *= d
        entries.append((name, n * size if e.dtype in FLOAT_DTYPES else e.nbytes))
        vision[name] = cls == TensorClass.VISION
    return model_blocks(entries, is_vision=vision)


def _available_memory(device: str) -> dict[str, int]:
    """Free memory per device: the CPU's, and each GPU's when the device is cuda."""
    out: dict[str, int] = {}
    cpu = available_cpu_bytes()
    if cpu is not None:
        out["cpu"] = cpu
    if device == "cuda":
        import torch

        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = int(torch.cuda.mem_get_info(i)[0])
    return out
