"""``tune-mtp``: shrink an existing quant's MTP to the smallest precision per group that keeps its acceptance, without
a new conversion: QUANT's main model is the quantized target the precision search measures on, SRC's BF16 MTP the
one it re-quantizes, and only the MTP bytes are written.

Steps: plan from headers (QUANT local and a ModelOpt NVFP4 quant, SRC's MTP complete and fitting QUANT (graft's
lineage check), the configurations the chosen engines load; ``--dry-run`` stops there) -> the calibration rows
(QUANT's recipe's calibration, else the family's default recipe's) -> the search (``search.run.search_mtp``: the same
inputs as ``convert --mtp auto`` of the same source, so the same choice) -> the chosen MTP (``search.write``) written
the graft way (``surgery.write``: new ``mtp-*`` shards, every other file linked, the metadata's MTP entries replaced
and MIXED_PRECISION where the choice needs it, the recipe and the report ``mtp_search/``), verified (headers, index,
exclusions, the MTP as planned, every other tensor QUANT's bytes, the chosen engines load the MTP) -> put in place.
With a healer (``--heal``: ``api.tune_and_heal``), the search's finalists are healed before the choice and the chosen
one is written healed (``search.finalists``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.precision import is_quantized, linear_precisions
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import GraftError, OutputExistsError, OutputVerificationError, TuneRefusedError, UsageError
from mtpquant.formats.quant_config import (
    HF_QUANT_CONFIG,
    QuantMetadata,
    exclusion_lists,
    mixed_precision_config,
    without_exclusions,
)
from mtpquant.public import public_args, public_checkpoint, public_name, public_ref
from mtpquant.recipes.recipe import RECIPE_FILE, CalibrationSection, Recipe, default_recipe_name, load_recipe
from mtpquant.records.provenance import Step
from mtpquant.search.run import SearchResult, search_space
from mtpquant.search.settings import SearchSettings
from mtpquant.surgery.metadata import MetadataPlan, plan_metadata
from mtpquant.surgery.write import Verified, WriteLog
from mtpquant.tune.options import TuneOptions
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from mtpquant.runtime.memory import MemoryPlan
    from mtpquant.search.run import SearchOutcome
    from mtpquant.search.write import ChosenMtp

__all__ = ["TuneOptions", "TunePlan", "TuneResult", "plan_tune", "tune_mtp"]

log = logging.getLogger(__name__)

_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")


@dataclass(frozen=True)
class TunePlan:
    """What tune-mtp will do, from headers."""

    quant: str
    source: str
    destination: str
    family: str
    main_algo: str
    activations: bool
    calibration: CalibrationSection
    calibration_from: str  # --recipe, QUANT's recipe, or the family's default recipe
    exclude: tuple[str, ...]  # that recipe's quantization.exclude: the MTP Linears it matches stay BF16
    fixed: tuple[str, ...]  # the groups the recipe keeps BF16 (a Linear of theirs excluded)
    settings: SearchSettings
    groups: tuple[str, ...]
    configurations: int
    bf16_bytes: int
    smallest_bytes: int
    mtp_bytes: int  # QUANT's MTP now
    memory: MemoryPlan  # where the quantized target the search measures on goes (convert's memory plan)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        data = dataclasses.asdict(self)
        data["calibration"] = dataclasses.asdict(self.calibration)
        data["settings"] = self.settings.to_json()
        data["memory"] = self.memory.to_json()
        return data


@dataclass(frozen=True, kw_only=True)
class TuneResult(WriteLog):
    """What tune-mtp did (or, with ``dry_run``, would do); what it wrote in ``WriteLog``'s fields."""

    plan: TunePlan
    action: str  # "planned" | "tuned"
    message: str
    destination: str | None = None
    search: SearchResult | None = None
    mtp_bytes_before: int = 0
    mtp_bytes_after: int = 0
    metadata_changes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("plan", "search")}
        out["plan"] = self.plan.to_json()
        out["search"] = self.search.to_json() if self.search is not None else None
        return out


def _main_algo(quant: Checkpoint, meta: QuantMetadata | None) -> str:
    """The quant_algo of QUANT's main model (a MIXED_PRECISION config: its main modules' one algo); refuses what the
    search cannot write beside (not ModelOpt, not NVFP4, compressed-tensors)."""
    label = quant.label
    if meta is None or not meta.is_modelopt:
        what = "no quantization" if meta is None else f"{meta.method} {meta.algo}"
        raise TuneRefusedError(
            f"{label}: tune-mtp re-quantizes the MTP of a ModelOpt NVFP4 quant; this checkpoint declares {what}"
        )
    algo = meta.algo.upper()
    if algo == "MIXED_PRECISION":
        algos = {
            str(v.get("quant_algo", "")).upper()
            for k, v in meta.quantized_layers.items()
            if not quant.is_mtp(k) and isinstance(v, dict)
        }
        nvfp4 = sorted(a for a in algos if a in _NVFP4_ALGOS)
        if len(nvfp4) != 1:
            raise TuneRefusedError(f"{label}: its MIXED_PRECISION main model is not NVFP4 ({', '.join(sorted(algos))})")
        return nvfp4[0]
    if algo not in _NVFP4_ALGOS:
        raise TuneRefusedError(f"{label}: its main model is {meta.algo}; tune-mtp writes beside an NVFP4 main model")
    return algo


def _recipe(quant: Checkpoint, options: TuneOptions) -> tuple[Recipe, str]:
    """The recipe QUANT is held to: ``--recipe``, else QUANT's resolved recipe (what it was converted with), else the
    family's default recipe; its exclusions are law for the MTP as convert's are (``convert.plan``)."""
    from mtpquant.checkpoint.source import read_text
    from mtpquant.recipes.recipe import recipe_from_mapping

    if options.recipe is not None:
        return load_recipe(options.recipe), f"recipe {options.recipe}"
    if RECIPE_FILE in quant.source.list_files():
        import yaml

        text = read_text(quant.source, RECIPE_FILE, what="recipe")
        return recipe_from_mapping(yaml.safe_load(text), f"{quant.label}/{RECIPE_FILE}"), f"QUANT's {RECIPE_FILE}"
    recipe = load_recipe(default_recipe_name(quant.spec.family))
    return recipe, f"recipe {recipe.name}"


def _calibration(recipe: Recipe, options: TuneOptions) -> CalibrationSection:
    """The MTP's calibration: the recipe's; the flags override it."""
    changes: dict[str, Any] = {
        "data": options.calib_data,
        "samples": options.calib_samples,
        "seq_len": options.calib_seq_len,
    }
    return dataclasses.replace(recipe.calibration, **{k: v for k, v in changes.items() if v is not None})


def _memory(quant: Checkpoint, options: TuneOptions) -> MemoryPlan:
    """Where QUANT's main model goes while the search measures on it (dequantized in the compute dtype): in memory
    when it fits, else under ``--max-memory`` with the rest read from QUANT's files (convert's memory plan)."""
    from mtpquant.errors import ValidateLoadError
    from mtpquant.measure.memory import plan_target_memory
    from mtpquant.measure.weights import CheckpointWeights  # torch: once QUANT and SRC are open and checked
    from mtpquant.runtime.machine import DTYPE_BYTES, compute_dtype, resolve_device

    device = resolve_device(options.device, probe=False)
    try:
        weights = CheckpointWeights(quant)
    except ValidateLoadError as exc:
        raise TuneRefusedError(str(exc)) from None
    shapes = [(name, weights.shape(name)) for name in weights.names()]
    return plan_target_memory(shapes, quant.classify, DTYPE_BYTES[compute_dtype(device, None)], device,
                              max_memory=options.max_memory, shard_bytes=options.max_shard_bytes, who="tune-mtp")


def plan_tune(options: TuneOptions) -> tuple[TunePlan, Checkpoint, Checkpoint]:
    """Open QUANT and SRC header-first and refuse early; the plan, QUANT and SRC."""
    from mtpquant.search.mode import SearchMode
    from mtpquant.surgery.lineage import check_lineage

    options.check_fields(UsageError)
    if (options.out is None) == (not options.in_place):
        raise UsageError("give exactly one of --out OUT and --in-place")
    quant = Checkpoint.open(options.quant, strict=True, name_errors=True)
    if quant.source.local_root is None:
        raise TuneRefusedError(
            f"{quant.label}: tune-mtp measures QUANT's main model and writes beside it: give a local directory "
            "(download it first)"
        )
    out = options.out_path
    if out is not None and out.exists():
        raise OutputExistsError(f"{out}: output already exists")
    src = Checkpoint.open(options.source, revision=options.source_revision, strict=True, name_errors=True)
    check_lineage(quant, src)
    meta = quant.quant_metadata
    main_algo = _main_algo(quant, meta)
    if meta is not None and meta.is_compressed_tensors:
        raise TuneRefusedError(f"{quant.label}: a compressed-tensors quant; tune-mtp writes the ModelOpt format")
    checked = SearchMode().check(src, "nvfp4")  # SRC's MTP complete, calibratable, of a family with groups
    activations = main_algo == "NVFP4"
    recipe, where = _recipe(quant, options)
    exclude = tuple(recipe.quantization.exclude)
    space = search_space(src, options.search, main_algo=main_algo, activations=activations, exclude=exclude)
    configurations = space.configurations()
    if len(configurations) < 2:
        raise TuneRefusedError(
            f"{src.label}: {options.search.engine} loads no quantized configuration of this MTP with the precisions "
            f"{', '.join(options.search.precisions)}; nothing to choose from"
        )
    cal = _calibration(recipe, options)
    memory = _memory(quant, options)
    plan = TunePlan(
        quant=quant.label,
        source=src.label,
        destination=str(out if out is not None else quant.source.local_root),
        family=quant.spec.family.key,
        main_algo=main_algo,
        activations=activations,
        calibration=cal,
        calibration_from=where,
        exclude=exclude,
        fixed=space.fixed_groups(),
        settings=options.search,
        groups=space.group_keys,
        configurations=len(configurations),
        bf16_bytes=space.nbytes(space.bf16),
        smallest_bytes=space.nbytes(configurations[0]),
        mtp_bytes=sum(e.nbytes for e in quant.mtp_tensors()),
        memory=memory,
        notes=checked.notes[1:],
    )
    return plan, quant, src


def tune_mtp(options: TuneOptions) -> TuneResult:
    """Re-quantize QUANT's MTP from SRC as the precision search chooses; see the module docstring."""
    t0 = time.perf_counter()
    plan, quant, src = plan_tune(options)
    timings = {"plan": time.perf_counter() - t0}
    if options.dry_run:
        message = f"would choose the MTP precision of {plan.quant} among {plan.configurations} configurations"
        return TuneResult(plan=plan, action="planned", message=message, timings=timings)
    import torch

    from mtpquant.measure.weights import CheckpointWeights
    from mtpquant.runtime.libraries import library_output
    from mtpquant.runtime.machine import compute_dtype, resolve_device
    from mtpquant.search.measure import calibration_rows
    from mtpquant.search.run import search_mtp
    from mtpquant.search.write import chosen_mtp
    from mtpquant.surgery import inplace
    from mtpquant.surgery.write import open_destination
    from mtpquant.text.calibration import load_tokenizer

    cal = plan.calibration
    root = quant.source.local_root
    assert root is not None
    with library_output(options.progress):
        # QUANT locked (in place) and snapshotted before anything is measured: a change to it during the search is
        # refused before the result is put in place; every scratch byte lives in the destination's partial directory
        dest = open_destination(quant, options.out_path, replaces=True)
        before = dest.before if dest.mode == "in-place" else inplace.snapshot(root.resolve())
        with dest.od:
            t1 = time.perf_counter()
            tokenizer = load_tokenizer(root)
            rows = calibration_rows(tokenizer, cal.data, cal.samples, cal.seq_len, chat_template=cal.chat_template)
            device = torch.device(resolve_device(options.device))
            dtype = getattr(torch, compute_dtype(device.type, None))
            found = search_mtp(
                CheckpointWeights(quant), src, quant.source, rows, options.search, main_algo=plan.main_algo,
                activations=plan.activations, target_name=public_checkpoint(quant.label), device=device, dtype=dtype,
                progress=options.progress, healer=options.healer, exclude=plan.exclude,
                scratch=dest.od.path / ".search-scratch",
                max_memory=plan.memory.caps.for_accelerate() if plan.memory.caps else None,
            )  # fmt: skip
            timings["search"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            chosen = chosen_mtp(src, found.space, found.result.choice.assignment, found.amax, found.weights)
            built, metadata = _build(options, plan, quant, src, found, chosen, dest)
            if dest.mode == "out" and inplace.snapshot(root.resolve()) != before:
                raise GraftError(f"{root}: QUANT changed while tuning the MTP; nothing was written, rerun it")
            from mtpquant.surgery.write import commit

            written = commit(dest, built, what="tuning the MTP")
        timings["write"] = time.perf_counter() - t2
    after = sum(t.nbytes for t in chosen.tensors)
    result = found.result
    message = (
        f"tuned the MTP of {plan.quant} into {dest.path}: {result.choice.assignment.label} "
        f"({format_bytes(after)}, was {format_bytes(plan.mtp_bytes)})"
    )
    log.info("%s", message)
    fields = {f.name: getattr(written, f.name) for f in dataclasses.fields(WriteLog)}
    return TuneResult(
        **fields,
        plan=plan,
        action="tuned",
        message=message,
        destination=str(dest.path),
        search=result,
        mtp_bytes_before=plan.mtp_bytes,
        mtp_bytes_after=after,
        metadata_changes=list(metadata.changes),
        timings={**timings, "total": time.perf_counter() - t0},
    )


def _metadata(quant: Checkpoint, plan: TunePlan, chosen: ChosenMtp, table: dict[str, Any], layers: int) -> MetadataPlan:
    """QUANT's config.json and hf_quant_config.json with the MTP declared as chosen: QUANT's MTP exclusions and
    ``quantized_layers`` entries removed, MIXED_PRECISION where the choice lists the MTP (the main model's modules in
    its algo, as convert writes it), then the exclusions the new MTP needs (the one planner, ``plan_metadata``)."""
    config = dict(quant.config)
    hfq = dict(quant.hf_quant_config) if quant.hf_quant_config is not None else None
    ours = set(sum(quant.spec.mtp_exclusion_patterns(), ()))  # mtp* / an appended layer's model.layers.N*, and CT's
    mtp_patterns = sorted({p for _, _, pats in exclusion_lists(config, hfq) for p in pats
                           if p.startswith("mtp") or p in ours})  # fmt: skip
    config, hfq = without_exclusions(config, hfq, mtp_patterns, mtp_patterns)
    meta = quant.quant_metadata
    mixed = meta is not None and meta.algo.upper() == "MIXED_PRECISION"
    if hfq is not None and (chosen.quantized_layers or mixed):
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

        precision = linear_precisions(quant.tensors)
        main = sorted(m for m, p in precision.items() if is_quantized(p) and not quant.is_mtp(m))
        hfq = mixed_precision_config(hfq, main, plan.main_algo, chosen.quantized_layers, quant.is_mtp)
        config["quantization_config"] = convert_hf_quant_config_format(hfq)
    changes = []
    if hfq != quant.hf_quant_config or config != quant.config:
        changes.append(f"{HF_QUANT_CONFIG} / config.json: QUANT's MTP entries replaced")
    from mtpquant.families import resolve

    planned = plan_metadata(resolve(config), hfq, table, mtp_layers=layers)
    config = planned.config if planned.config is not None else config
    hfq = planned.hf_quant_config if planned.hf_quant_config is not None else hfq
    for warning in planned.warnings:
        raise OutputVerificationError(f"the tuned MTP's metadata: {warning}")
    return MetadataPlan(
        config if config != quant.config else None,
        hfq if hfq != quant.hf_quant_config else None,
        (*changes, *planned.changes),
    )


def _build(
    options: TuneOptions,
    plan: TunePlan,
    quant: Checkpoint,
    src: Checkpoint,
    found: SearchOutcome,
    chosen: ChosenMtp,
    dest: Any,
) -> tuple[Any, MetadataPlan]:
    """Build the tuned quant in ``dest``'s temporary directory and verify it."""
    from mtpquant.checkpoint.header import TensorEntry
    from mtpquant.checkpoint.source import read_text
    from mtpquant.recipes.recipe import tuned_recipe
    from mtpquant.search.report import search_documents
    from mtpquant.surgery.plan import plan_change
    from mtpquant.surgery.shards import write_planned_mtp
    from mtpquant.surgery.write import NewMtp, build

    names = tuple(sorted(t.name for t in chosen.tensors))
    layers = quant.spec.mtp_depth(names) or quant.spec.mtp.layers
    table: dict[str, Any] = {n: e for n, e in quant.tensors.items() if not quant.is_mtp(n)}
    table |= {t.name: TensorEntry(t.name, t.dtype, tuple(t.shape), "", 0, 0) for t in chosen.tensors}
    metadata = _metadata(quant, plan, chosen, table, layers)
    removed = [e.name for e in quant.mtp_tensors()]
    change = plan_change(quant, metadata, add=names, removed=removed, mtp_layers=layers)
    new_mtp = NewMtp(names, lambda od: write_planned_mtp(od, chosen.tensors, options.max_shard_bytes))
    ref = src.source.ref()
    step = Step("tune-mtp", public_args(options.command, ref), source=public_ref(ref), mode="search")
    result = found.result
    assignment = result.choice.assignment
    texts = {}
    if RECIPE_FILE in quant.source.list_files():
        healed = found.weights is not None
        what = (f"MTP re-quantized from {public_name(src.label, ref)} by tune-mtp ({assignment.label}"
                f"{', healed' if healed else ''})")
        texts[RECIPE_FILE] = tuned_recipe(read_text(quant.source, RECIPE_FILE, what="recipe"), RECIPE_FILE,
                                          dict(zip(assignment.groups, assignment.precisions)), what,
                                          healed=healed)  # fmt: skip
    blobs = search_documents(result, found.chosen.acceptance, checkpoint=public_checkpoint(quant.label))
    planned = {t.name: (t.dtype, tuple(t.shape)) for t in chosen.tensors}
    verify = _verifier(quant, planned, layers, options.search.engines)
    built = build(dest, change, new_mtp, step, verify, link=options.link, texts=texts, blobs=blobs)
    return built, metadata


def _verifier(
    quant: Checkpoint, planned: dict[str, tuple[str, tuple[int, ...]]], layers: int, engines: tuple[str, ...]
) -> Any:
    """The result's checks: graft's (headers, index, exclusions, inspect), the MTP exactly as planned (names, dtypes,
    shapes), every other tensor QUANT's own bytes, and every chosen engine's verdict: the MTP loads."""
    from mtpquant.diagnose.report import inspect_checkpoint
    from mtpquant.diagnose.verify import verify_result

    def verify(path: Path) -> Verified:
        def fail(reason: str) -> OutputVerificationError:
            return OutputVerificationError(f"the tuned result failed verification and was not put in place: {reason}")

        verified = verify_result(path, {n: s for n, (_, s) in planned.items()}, None, layers, quant)
        out = Checkpoint.open(path, strict=True, reuse=quant)
        odd = sorted(n for n, (d, s) in planned.items() if (out.tensors[n].dtype, out.tensors[n].shape) != (d, s))
        if odd:
            raise fail(f"{odd[0]} is not as planned")
        others = sorted(n for n in quant.tensors if not quant.is_mtp(n))
        if sorted(n for n in out.tensors if not quant.is_mtp(n)) != others:
            raise fail("the tensors outside the MTP are not QUANT's")
        for name in others:
            a, b = out.tensors[name], quant.tensors[name]
            if (a.dtype, a.shape) != (b.dtype, b.shape) or out.read_raw(a) != quant.read_raw(b):
                raise fail(f"{name} is not byte-identical to QUANT's")
        report = inspect_checkpoint(path, checkpoint=out)
        refused = [e for e in engines if "MTP loads" not in report.verdicts.get(e, "")]
        if refused:
            raise fail(f"{refused[0]}: {report.verdicts.get(refused[0])}")
        return Verified((*verified.checks, "planned-mtp", "rest-bytes", "engines-load"), verified.warnings)

    return verify
