"""``convert``: a BF16 Qwen checkpoint to NVFP4 through nvidia-modelopt, keeping (or quantizing,
extracting, dropping) its MTP layer, with every output verified before it appears.

Steps: plan from headers (``plan.py``, with the memory plan of ``memory.py``; ``--dry-run`` stops
there) -> OUT's lock and temporary directory -> calibration data in the model's own tokenizer ->
the main model through transformers, in memory or placed by accelerate under the memory caps
(the rest read from SRC's files) -> ``mtq.quantize`` with the recipe's config, in one pass or layer
by layer (offloaded models, ``--layerwise``; resumable, ``resume.py``) -> quantize mode: the MTP
calibrated on the post-final-norm hidden states and next-token embeddings of the same rows ->
``export_hf_checkpoint`` (streaming for offloaded models) into a scratch directory inside OUT's
temporary directory -> the exported shards moved into place (rewritten only where a tensor must
change), MTP per mode, configs, carried files, resolved recipe, provenance, index -> inspect
verdict -> rename into place -> the resume state removed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant import __version__
from mtpquant.checkpoint.lock import OutputLock
from mtpquant.checkpoint.source import SourceRef
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.convert.plan import ConvertOptions, ConvertPlan, plan_convert
from mtpquant.convert.result import ConvertResult, count_output
from mtpquant.convert.resume import ResumeState
from mtpquant.errors import CalibrationDataError, OutputVerificationError
from mtpquant.families import TensorClass
from mtpquant.formats.quant_config import HF_QUANT_CONFIG, with_exclusions, without_exclusions
from mtpquant.public import public_args, public_file, public_name, public_ref
from mtpquant.recipes.recipe import RECIPE_FILE
from mtpquant.records.provenance import PROVENANCE_FILE, Provenance, Step, check_replaceable, source_license
from mtpquant.runtime.meter import Timer, bytes_written_so_far, peak_rss_bytes
from mtpquant.surgery.modes import MtpOutcome, WriteContext, load_mtp_layer, same_bytes
from mtpquant.text.calibration import CalibrationData
from mtpquant.units import format_bytes

__all__ = ["ConvertOptions", "ConvertPlan", "convert", "plan_convert"]

if TYPE_CHECKING:
    from mtpquant.diagnose.report import InspectReport

log = logging.getLogger(__name__)
# The end-of-run summary; the CLI prints it itself and quiets this logger.
summary_log = logging.getLogger(__name__ + ".summary")

SCRATCH = ".modelopt-export"
OFFLOAD = ".offload"


def _tqdm(progress: bool, **kwargs: Any) -> Any:
    from tqdm.auto import tqdm

    return tqdm(disable=not progress or None, **kwargs)


def _local_source(ckpt: Checkpoint) -> tuple[Path, Checkpoint]:
    """A local directory for SRC (transformers loads from one): itself, or a snapshot in the HF cache."""
    from mtpquant.checkpoint.table import PICKLE_SUFFIXES

    path = ckpt.source.local_dir([f"*{s}" for s in PICKLE_SUFFIXES])
    return path, (ckpt if ckpt.source.local_root is not None else Checkpoint.open(path, strict=True))


def _output_metadata(
    ckpt: Checkpoint, exported: Checkpoint, tensors: dict[str, Any], declared_layers: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """OUT's config.json and hf_quant_config.json: the source config with the MTP declared per mode (the one rule,
    ``declare_mtp``) and modelopt's quantization metadata less any MTP entry, packed groups listed member by member
    (Qwen4-Exp's qkv_proj + indexer), then the exclusions the MTP in ``tensors`` (OUT's tensor table) needs, planned
    by the one planner graft uses (``surgery.metadata.plan_metadata``)."""
    from mtpquant.convert.assemble import packed_exclusions
    from mtpquant.families import resolve
    from mtpquant.surgery.metadata import declare_mtp, plan_metadata

    config = declare_mtp(ckpt.spec, declared_layers)
    qc = exported.config.get("quantization_config")
    if qc is not None:
        config["quantization_config"] = copy.deepcopy(qc)
    config, hfq = without_exclusions(config, exported.hf_quant_config, *ckpt.spec.mtp_exclusion_patterns())
    if hfq is not None:
        listed = hfq.get("quantization", {}).get("exclude_modules", [])
        packed = packed_exclusions(exported.tensors, listed, ckpt.spec.family.engine.packed)
        if packed:
            config, hfq = with_exclusions(config, hfq, packed, [])
    plan = plan_metadata(resolve(config), hfq, tensors, mtp_layers=declared_layers)
    for warning in plan.warnings:
        log.warning("%s", warning)
    return plan.config if plan.config is not None else config, plan.hf_quant_config or hfq


def _verify(plan: ConvertPlan, src: Checkpoint, outcome: MtpOutcome, path: Path) -> InspectReport:
    """The finalize check of the output at ``path``: exact MTP and vision tensor sets, the mode's own checks, a clean
    inspect verdict (the inspect that gates publish); returns that inspect report."""
    from mtpquant.diagnose.report import inspect_checkpoint

    mode = plan.mtp_mode
    out = Checkpoint.open(path, strict=True)
    where = f"{plan.out}: verification failed"
    mtp = {e.name for e in out.mtp_tensors()}
    expect_mtp = set(outcome.names)
    if mtp != expect_mtp:
        extra = sorted(mtp - expect_mtp) or sorted(expect_mtp - mtp)
        raise OutputVerificationError(f"{where}: MTP tensor set differs from the plan (first: {extra[0]})")
    mode.verify(out, src, outcome, where)
    vision_src = {e.name for e in src.by_class().get(TensorClass.VISION, [])}
    vision_out = {e.name for e in out.by_class().get(TensorClass.VISION, [])}
    if vision_src != vision_out:
        raise OutputVerificationError(f"{where}: vision tensors differ from the source")
    same_bytes(out, src, sorted(vision_src), where)
    report = inspect_checkpoint(path)  # the inspect that gates publish
    if report.failures:
        raise OutputVerificationError(f"{where}: {report.failures[0].message}")
    if mode.declares and not report.mtp_declared:
        raise OutputVerificationError(f"{where}: the output does not declare its MTP")
    return report


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert SRC to an NVFP4 checkpoint at OUT; see the module docstring. Raises MtpquantError."""
    timer = Timer()
    t_start = time.perf_counter()
    with timer("plan"):  # torch-free: a bad option, SRC or OUT is refused before the libraries load
        plan, ckpt = plan_convert(options)
    log.debug("plan: %s", plan.to_json())
    if options.dry_run:
        return ConvertResult(plan, dry_run=True, timings=timer.timings, notes=list(plan.notes))
    with timer("imports"):  # seconds of torch, transformers and modelopt: a step of their own, not the plan's
        _import_libraries()
    progress = options.progress and os.environ.get("TQDM_DISABLE", "") in {"", "0"}
    result = ConvertResult(plan, notes=[*plan.notes, *plan.memory.notes])
    from mtpquant.runtime.memory import return_freed_memory

    return_freed_memory()
    written_before = bytes_written_so_far()
    from mtpquant.runtime.libraries import library_output

    with contextlib.ExitStack() as stack:
        # OUT's lock first, before any download or long work: a second run on the same OUT is refused at once
        lock = stack.enter_context(OutputLock.acquire(plan.out))
        mtp_lock = stack.enter_context(OutputLock.acquire(plan.mtp_out)) if plan.mtp_out else None
        source = ckpt.source
        if source.local_root is None:
            with timer("download"), library_output(progress):
                src_dir, ckpt = _local_source(ckpt)
        else:
            src_dir, ckpt = _local_source(ckpt)
        ref = source.ref()  # a Hub source: the repo, the revision asked for and the commit downloaded
        step = Step(
            "convert",
            public_args(plan.command, ref),  # the file goes public with OUT: local directories by base name
            source=public_ref(ref),
            mode=plan.mode,
            recipe=plan.recipe.name,
            recipe_file=RECIPE_FILE,
            base_model=plan.base_model,
            base_model_revision=plan.base_model_revision,
            license=source_license(source),
        )
        stack.enter_context(library_output(progress))
        od = stack.enter_context(
            OutputDir(plan.out, overwrite=plan.overwrite, replace_check=check_replaceable, lock=lock)
        )
        mtp_od = (
            stack.enter_context(
                OutputDir(plan.mtp_out, overwrite=plan.overwrite, replace_check=check_replaceable, lock=mtp_lock)
            )
            if plan.mtp_out
            else None
        )
        run = _run(plan, ckpt, src_dir, od, mtp_od, timer, progress, healer=options.healer)
        outcome, resume = run.outcome, run.resume
        result = dataclasses.replace(result, **run.facts())
        od.write_text(PROVENANCE_FILE, Provenance((step,)).to_bytes().decode("utf-8"))
        if mtp_od is not None:
            sidecar = dataclasses.replace(step, recipe_file=None)
            mtp_od.write_text(PROVENANCE_FILE, Provenance((sidecar,)).to_bytes().decode("utf-8"))
        with timer("verify"):
            report = _verify(plan, ckpt, outcome, od.path)  # both outputs verified before either is put in place
            if mtp_od is not None:
                where = f"{plan.mtp_out}: verification failed"
                result.mtp_output = plan.mtp_mode.finish_side_output(mtp_od, ckpt, where)
            try:
                out_path = od.finalize(opened=True)  # ``verify`` opened it strictly, and nothing was written since
            except BaseException:
                if mtp_od is not None and result.mtp_output is not None:
                    shutil.rmtree(result.mtp_output, ignore_errors=True)
                raise
        result.output = out_path
        if resume is not None:
            result.resume_bytes = resume.bytes_written()
            resume.remove()  # the output is in place: nothing to resume
        result.verdicts = dict(report.verdicts)
        result.search = outcome.search.result if outcome.search is not None else None
        result.mtp_precision = str(report.mtp_precision)
    counts, quantized, unquantized, size = count_output(out_path)
    result.tensor_counts = counts
    result.quantized_linears = quantized
    result.unquantized_linears = unquantized
    result.output_bytes = size
    result.mtp_tensors = counts.get(TensorClass.MTP, 0)
    if result.mtp_output is not None:
        result.mtp_output_bytes = sum(p.stat().st_size for p in result.mtp_output.rglob("*") if p.is_file())
    total = time.perf_counter() - t_start
    # what no step measured (the result's counts, the output's size): named, so the parts add up to the total
    result.timings = {**timer.timings, "other": max(0.0, total - sum(timer.timings.values())), "total": total}
    result.peak_rss_bytes = peak_rss_bytes()
    result.bytes_written = max(0, bytes_written_so_far() - written_before)
    summary_log.info("wrote %s (%s, MTP %s) in %.1f s", result.output, format_bytes(result.output_bytes), plan.mode,
                     result.timings["total"])
    return result


def _import_libraries() -> None:
    """Import what the conversion runs on (torch, transformers, modelopt's quantization and export)."""
    from mtpquant.runtime.libraries import import_libraries

    import_libraries("torch", "transformers", "modelopt.torch.quantization", "modelopt.torch.export")


def _resume_inputs(plan: ConvertPlan, src_dir: Path, data: CalibrationData) -> dict[str, Any]:
    """What layer-wise calibration depends on: a resume state is reused only when all of it is the same. The
    calibration enters by its content: a digest of the very token rows it feeds the model, which covers the text
    (a file edited at the same path, a dataset at another revision), the tokenizer and its chat template."""
    import hashlib

    import modelopt
    import torch
    import transformers

    from mtpquant.convert.resume import source_stamp

    rows = data.input_ids.contiguous()
    return {
        "source": str(src_dir.resolve()),
        "files": source_stamp(src_dir),
        "recipe": plan.recipe.to_yaml(""),
        "mode": plan.mode,
        "calibration": {"rows": list(rows.shape), "sha256": hashlib.sha256(rows.numpy().tobytes()).hexdigest()},
        "device": plan.device,
        "resume_every": plan.resume_every,  # modelopt refuses a state committed at another interval
        "versions": [__version__, modelopt.__version__, torch.__version__, transformers.__version__],
    }


@dataclass
class _Run:
    """What the work between planning and finalize did: what the MTP mode wrote, the resume state, and the facts
    measured on the way (``ConvertResult`` fields of the same names)."""

    outcome: MtpOutcome
    resume: ResumeState | None
    calibration_rows: int
    calibration_tokens: int
    placement: dict[str, int]
    layerwise: bool
    resumed_from_layer: int | None = None
    peak_gpu_bytes: int = 0
    shards_moved: int = 0
    shards_rewritten: int = 0
    offload_bytes: int = 0

    def facts(self) -> dict[str, Any]:
        """The measured facts, by their ``ConvertResult`` field names."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("outcome", "resume")}


def _run(
    plan: ConvertPlan,
    ckpt: Checkpoint,
    src_dir: Path,
    od: OutputDir,
    mtp_od: OutputDir | None,
    timer: Timer,
    progress: bool,
    healer: Any = None,
) -> _Run:
    """Everything between planning and finalize (``healer``: ``--mtp auto --heal``'s, ``search.finalists``)."""
    import torch

    from mtpquant.convert.assemble import carry_files, place_main_shards, quantized_modules_of
    from mtpquant.convert.model import (
        calibration_loop,
        export_quantized,
        final_hidden_states,
        input_device,
        is_offloaded,
        load_main_model,
        placement,
        quantize_main_model,
        source_dtype,
    )
    from mtpquant.formats.quant_config import mixed_precision_config
    from mtpquant.text.calibration import build_calibration_data, load_tokenizer

    recipe = plan.recipe
    cal = recipe.calibration
    family = ckpt.spec.family
    with timer("tokenize"):
        tokenizer = load_tokenizer(src_dir)
        with _tqdm(progress, total=cal.samples * cal.seq_len, desc="tokenize", unit="tok") as bar:
            data = build_calibration_data(
                tokenizer, cal.data, cal.samples, cal.seq_len, chat_template=cal.chat_template, bar=bar
            )
        vocab = ckpt.spec.text.get("vocab_size")
        if isinstance(vocab, int) and int(data.input_ids.max()) >= vocab:
            raise CalibrationDataError(
                f"the tokenizer produced id {int(data.input_ids.max())} but the model's vocabulary has {vocab} entries"
            )

    with timer("load"):
        model = load_main_model(src_dir, ckpt, plan.memory, plan.device, od.path / OFFLOAD)
    placed = placement(model)
    device = input_device(model)
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    layerwise = plan.memory.layerwise or is_offloaded(model)
    resume: ResumeState | None = None
    resumed_from: int | None = None
    if layerwise:
        log.info(
            "layer-wise calibration commits its resume state every %d of %d layers (~%s of layer inputs a commit)",
            plan.resume_every, ckpt.spec.dim("num_hidden_layers"), format_bytes(plan.resume_activation_bytes),
        )
        resume = ResumeState.open(plan.out, _resume_inputs(plan, src_dir, data))
        if resume.start_layer:
            resumed_from = resume.start_layer
            log.info(
                "resuming layer-wise calibration from layer %d of %d (layers 1-%d were finished by an earlier run; "
                "state in %s)", resume.start_layer + 1, resume.num_layers, resume.start_layer, resume.path,
            )

    def batches() -> Iterator[Any]:
        return data.batches(cal.batch_size)

    od.doing = "calibrating (writing the layer-wise resume state)" if layerwise else ""
    with timer("calibrate"):
        bar = None if layerwise else _tqdm(progress, total=data.samples, desc="calibrate", unit="row")
        loop = calibration_loop(batches, device, bar=bar, before_pass=resume.prune if resume else None)
        quantize_main_model(
            model,
            recipe.to_modelopt_config(family),
            loop,
            layerwise_dir=resume.checkpoint_dir if resume else None,
            save_every=plan.resume_every,
            progress=progress,
        )
        if bar is not None:
            bar.close()

    mode = plan.mtp_mode
    calibrator = None
    if mode.needs_calibration:
        from mtpquant.mtp.quantize import MtpCalibrator

        with timer("mtp"), _tqdm(progress, total=data.samples, desc="calibrate MTP", unit="row") as bar:
            calibrator = MtpCalibrator(load_mtp_layer(ckpt, device=device if device.type != "meta" else None))
            for hidden, embeds in final_hidden_states(model, batches, device, family.mtp.hidden_source):
                calibrator.observe(hidden, embeds)
                bar.update(int(hidden.shape[0]))
            calibrator.release()  # the amax is kept; the layer (a whole MoE layer for GLM) is read again to write it
            gc.collect()

    scratch = od.path / SCRATCH
    od.doing = "exporting the quantized model"
    with timer("export"):
        layers = int(ckpt.spec.text.get("num_hidden_layers") or 0)
        bar = _tqdm(progress, total=layers or None, desc="export", unit="layer")
        export_quantized(model, scratch, source_dtype(ckpt.spec), ckpt, plan.max_shard_bytes, bar)
        bar.close()
    od.doing = ""
    peak_gpu = int(torch.cuda.max_memory_allocated()) if plan.device == "cuda" else 0
    del model
    gc.collect()

    exported = Checkpoint.open(scratch, strict=True)
    with timer("write"):
        main = place_main_shards(exported, ckpt, od, scratch)

    measured = None
    if mode.needs_target:  # --mtp auto: the search measures on the main model as OUT now holds it
        from mtpquant.surgery.modes import MeasureContext

        # the source's config with the export's quantization: transformers' own save writes an infinity as
        # {"__float__": "Infinity"} (Nemotron-H's time_step_limit), which its from_dict then refuses
        view_config = {**ckpt.config, "quantization_config": exported.config.get("quantization_config")}
        with timer("search"), _main_view(od, view_config) as target:
            od.doing = "measuring the MTP's precision configurations"
            q = recipe.quantization
            context = MeasureContext(ckpt, target, tokenizer, cal, plan.search, q.quant_algo, q.activations,
                                     plan.device, progress, healer=healer, exclude=tuple(q.exclude),
                                     scratch=od.path / ".search-scratch",
                                     max_memory=_caps(plan.search_memory))  # fmt: skip
            measured = mode.measure(context)
            od.doing = ""

    with timer("mtp"):
        ctx = WriteContext(
            od,
            ckpt,
            plan.max_shard_bytes,
            mtp_od=mtp_od,
            out_name=plan.out.name,
            calibrator=calibrator,
            fmt=plan.mtp_format,
            activations=recipe.quantization.activations,
            targets=recipe.quantization.targets,
            exclude=tuple(recipe.quantization.exclude),
            main_algo=recipe.quantization.quant_algo,
            measured=measured,
        )
        outcome = mode.write(ctx)
        if outcome.search is not None:
            recipe = _record_search(od, recipe, outcome.search, ckpt)

    with timer("write"):
        table = {name: entry for header in od.shard_headers().values() for name, entry in header.tensors.items()}
        config, hfq = _output_metadata(ckpt, exported, table, mode.declared_layers(ckpt))
        if outcome.quantized_layers and hfq is not None:
            from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

            main_modules = quantized_modules_of(exported.tensors)
            hfq = mixed_precision_config(
                hfq, main_modules, recipe.quantization.quant_algo, outcome.quantized_layers, ckpt.is_mtp
            )
            config["quantization_config"] = convert_hf_quant_config_format(hfq)
        od.write_json("config.json", config)
        ct_format = plan.output_format == "compressed-tensors"
        if hfq is not None and not ct_format:  # compressed-tensors keeps its metadata in config.json only
            od.write_json(HF_QUANT_CONFIG, hfq)
        carry_files(od, src_dir, plan.carried_files)
        # the file goes public with OUT: the calibration file by its base name
        public = dataclasses.replace(recipe, calibration=dataclasses.replace(cal, data=public_file(cal.data)))
        od.write_text(RECIPE_FILE, public.to_yaml(_recipe_header(plan, ckpt.source.ref())))
        shutil.rmtree(scratch, ignore_errors=True)
        offload = od.path / OFFLOAD
        offload_bytes = sum(p.stat().st_size for p in offload.rglob("*") if p.is_file())
        shutil.rmtree(offload, ignore_errors=True)
        od.write_index()
    if ct_format:
        from mtpquant.convert.ct_format import ct_tensor_names, to_compressed_tensors

        assert hfq is not None, "an NVFP4 recipe always exports quantization metadata"
        with timer("format"):
            exclude = hfq["quantization"].get("exclude_modules") or []
            mtp_patterns = ckpt.spec.mtp_exclusion_patterns()
            config["quantization_config"] = to_compressed_tensors(od, exclude, plan.device, mtp_patterns)
            od.write_json("config.json", config)
        outcome.names = ct_tensor_names(outcome.names)
    return _Run(
        outcome,
        resume,
        calibration_rows=data.samples,
        calibration_tokens=data.samples * data.seq_len,
        placement=placed,
        layerwise=layerwise,
        resumed_from_layer=resumed_from,
        peak_gpu_bytes=peak_gpu,
        shards_moved=len(main.moved),
        shards_rewritten=len(main.rewritten),
        offload_bytes=offload_bytes,
    )


def _caps(memory: Any) -> Any:
    """accelerate's caps of a memory plan (None: no plan, or everything on the one device)."""
    return memory.caps.for_accelerate() if memory is not None and memory.caps is not None else None


@contextlib.contextmanager
def _main_view(od: OutputDir, config: dict[str, Any]) -> Iterator[Checkpoint]:
    """OUT's main-model shards as written so far, opened as a checkpoint (hard links beside them, the exported
    config, an index of those shards): the quantized target ``tune-mtp`` would read from the finished OUT."""
    import json

    from mtpquant.checkpoint.index import INDEX_NAME, build_index

    view = od.path / ".search-target"
    view.mkdir()
    try:
        headers = od.shard_headers()
        for shard in headers:
            os.link(od.path / shard, view / shard)
        (view / "config.json").write_text(json.dumps(config))
        (view / INDEX_NAME).write_text(json.dumps(build_index(headers)))
        yield Checkpoint.open(view, strict=True)
    finally:
        shutil.rmtree(view, ignore_errors=True)


def _record_search(od: OutputDir, recipe: Any, found: Any, ckpt: Checkpoint) -> Any:
    """The search's report into ``mtp_search/``, and the recipe with the precision it chose per group (and whether
    the chosen MTP was healed, ``--heal``)."""
    from mtpquant.public import public_checkpoint
    from mtpquant.search.report import search_documents

    result = found.result
    name = public_checkpoint(ckpt.label)
    for rel, data in search_documents(result, found.chosen.acceptance, checkpoint=name).items():
        od.write_bytes(rel, data)
    chosen = dict(zip(result.choice.assignment.groups, result.choice.assignment.precisions))
    healed = found.weights is not None
    return dataclasses.replace(recipe, mtp=dataclasses.replace(recipe.mtp, precision=chosen, healed=healed))


def _recipe_header(plan: ConvertPlan, ref: SourceRef) -> str:
    """The comment header above the resolved recipe, for a person reading it (the card reads the provenance file).
    It goes public with OUT: local directories by their base name."""
    import shlex

    lines = [f"Resolved recipe written by mtpquant {__version__} convert.", f"source: {public_name(plan.src, ref)}"]
    if plan.command:
        lines.append(f"command: {shlex.join(public_args(plan.command, ref))}")
    lines.append(f"Reuse with: mtpquant convert SRC OUT --recipe {RECIPE_FILE}")
    return "\n".join(lines)
