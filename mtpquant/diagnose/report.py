"""``inspect``: is the MTP in the checkpoint, in what precision, and will vLLM / SGLang load it?

Reads only config.json, hf_quant_config.json, the index and the safetensors headers, from a
directory or a Hub repo (through the checkpoint layer, which counts the bytes it fetched). What each engine
does with the MTP (verdict lines, serve commands) is drawn in ``verdicts.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpquant.checkpoint.header import bulk_parse
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.modules import linear_modules, module_of
from mtpquant.checkpoint.precision import is_quantized, module_precision, table_precision
from mtpquant.checkpoint.source import CheckpointSource
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.fixes import fix_commands
from mtpquant.engine.loading import (
    EngineModule,
    Expectation,
    FusedShardsError,
    engine_modules,
    unmatched_exclusions,
)
from mtpquant.engine.table import ENGINES, display
from mtpquant.engine.verdicts import MISSING, ModuleReport, VerdictFacts, engine_verdicts, label_refusal
from mtpquant.engine.vllm import unquantized_why, vllm_expectation
from mtpquant.errors import ExitCode
from mtpquant.families import (
    NEVER_SHIPPED,
    NOT_MTP,
    RECOGNISED,
    SEPARATE,
    UNKNOWN,
    EngineRules,
    TensorClass,
    matches,
)
from mtpquant.formats.quant_config import QuantMetadata

__all__ = [
    "EXIT_DECLARED_MISSING",
    "EXIT_EXCLUSIONS",
    "EXIT_FORMAT",
    "EXIT_INDEX",
    "SCHEMA_VERSION",
    "IndexInfo",
    "InspectReport",
    "MainModelInfo",
    "QuantizationInfo",
    "VisionInfo",
    "inspect_checkpoint",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Exit codes by finding category (documented in docs/inspect.md and the CLI help), most severe first.
EXIT_INDEX = int(ExitCode.INSPECT_INDEX)
EXIT_FORMAT = int(ExitCode.INSPECT_FORMAT)
EXIT_DECLARED_MISSING = int(ExitCode.INSPECT_MTP)
EXIT_EXCLUSIONS = int(ExitCode.INSPECT_EXCLUSIONS)
# Families whose MTP mtpquant does not repair say so first: there is no MTP question to answer after that.
_SEVERITY = (
    (NEVER_SHIPPED, int(ExitCode.MTP_NEVER_SHIPPED)),
    (NOT_MTP, int(ExitCode.NOT_AN_MTP)),
    ("index", EXIT_INDEX),
    ("format", EXIT_FORMAT),
    ("declared_missing", EXIT_DECLARED_MISSING),
    ("exclusions", EXIT_EXCLUSIONS),
)


@dataclass
class Finding:
    """A failure or warning with the category that decides its --strict exit code."""

    category: str  # "declared_missing" | "exclusions" | "index" | "format" | "never_shipped" | "not_mtp" | "note"
    message: str


@dataclass
class QuantizationInfo:
    """The checkpoint's quantization metadata as inspect read it (all None / empty: not quantized)."""

    method: str | None  # "modelopt" | "compressed-tensors" | ...
    vllm_method: str | None  # the method vLLM loads it as
    algorithm: str | None
    group_size: int | None
    kv_cache: str | None
    exclude: list[str]
    declared_in: list[str]  # the files that declare it


@dataclass
class MainModelInfo:
    """The main model's Linear modules: how many, how many quantized, by precision."""

    linear_modules: int
    quantized: int
    unquantized: int
    precisions: dict[str, int]  # Linear count per on-disk precision
    inconsistent_modules: list[str]  # whose metadata disagrees with their tensors


@dataclass
class VisionInfo:
    """The vision tower (``model.visual.*``): present, its tensors, its Linears by precision, expected here."""

    present: bool
    tensors: int
    precisions: dict[str, int]
    expected: bool


@dataclass
class IndexInfo:
    """The shard index: shards, tensors, what is wrong (``problems``: fatal) or only advisory (``warnings``)."""

    shards: int
    tensors: int
    problems: list[str]
    warnings: list[str]
    intact: bool


@dataclass
class InspectReport:
    """Everything inspect found; ``to_json`` gives the documented schema."""

    checkpoint: str
    family: str
    architecture: str
    kind: str  # "model" | "mtp-only" (an MTP sidecar: the MTP alone, to graft into a quant or load beside it)
    mtp_declared: bool
    mtp_declaration: str
    mtp_expected_tensors: int
    mtp_present_tensors: int
    mtp_bytes: int
    mtp_shards: list[str]
    mtp_missing: list[str]
    mtp_unexpected: list[str]
    mtp_modules: list[ModuleReport]
    mtp_precision: str
    quantization: QuantizationInfo
    main_model: MainModelInfo
    vision: VisionInfo
    index: IndexInfo
    verdicts: dict[str, str]
    serve_commands: dict[str, str]
    failures: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)  # the commands that repair the failures, where one does
    # the drafter class each engine builds for this family's MTP ("" where the engine has none)
    drafters: dict[str, str] = field(default_factory=dict)
    # what the MTP inventory enumerates ("exact", "glue": each layer's glue, "none": presence only), the MTP depths
    # present, and what mtpquant does with the family ("supported", "recognised", "not_mtp", "never_shipped")
    mtp_inventory: str = "exact"
    mtp_layers_present: int = 0
    mtp_status: str = "supported"
    mtp_removed: str | None = None  # the MTP mode (drop / extract) an mtpquant run removed the MTP with
    bytes_fetched: int = 0
    requests: int = 0  # network requests (a Hub repo); 0 for a local directory
    checkpoint_bytes: int = 0
    seconds: float = 0.0

    @property
    def healthy(self) -> bool:
        """No failure: the MTP is present when declared, metadata agrees with tensors, index intact."""
        return not self.failures

    @property
    def failure_messages(self) -> list[str]:
        """One-line reasons, failures first."""
        return [f.message for f in self.failures]

    def exit_code(self, *, strict: bool = False) -> int:
        """0, or the code of the most severe category among the failures (with ``strict``: warnings too)."""
        found = [*self.failures, *self.warnings] if strict else self.failures
        cats = {f.category for f in found}
        for cat, code in _SEVERITY:
            if cat in cats:
                return code
        return 0

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form (schema in docs/inspect.md)."""
        data = asdict(self)
        data["schema_version"] = SCHEMA_VERSION
        data["healthy"] = self.healthy
        return data


def _engine_view(ckpt: Checkpoint, meta: QuantMetadata | None) -> tuple[QuantMetadata | None, int]:
    """The MTP's quantization metadata as the engine reads it (Qwen4-Exp: mtp.layers.i renamed in every list), and
    the trunk's layer count the engine's MTP names count from."""
    layout = ckpt.spec.family.mtp
    if meta is None or not layout.engine_layer_offset:
        return meta, 0
    n = ckpt.spec.dim("num_hidden_layers")
    return (
        dataclasses.replace(
            meta,
            exclude=tuple(layout.engine_name(p, n) for p in meta.exclude),
            quantized_layers={layout.engine_name(k, n): v for k, v in meta.quantized_layers.items()},
        ),
        n,
    )


def _missing_param(ckpt: Checkpoint, mod: EngineModule, engine_prefix: str, e: Expectation) -> str:
    """vLLM's load error for routed experts whose tensors its method has no parameter for (routed_experts.py
    1020-1029), for the first such tensor in checkpoint order; "" when none."""
    for member in sorted(mod.members):
        for name in sorted(n for n in ckpt.tensors if n.startswith(member + ".")):
            suffix = name[len(member) + 1 :]
            if suffix not in e.params:
                w = "w2" if member.endswith("down_proj") else "w13"
                return f" (vLLM: Layer {engine_prefix} has no parameter '{w}_{suffix}')"
    return ""


def _module_reports(
    ckpt: Checkpoint,
    names: list[str],
    meta: QuantMetadata | None,
    precision: dict[str, str] | None = None,
    modules: list[EngineModule] | None = None,
) -> tuple[list[ModuleReport], list[Finding]]:
    """``precision``: each name's ``module_precision``, and ``modules``: the names' ``engine_modules``, when the caller
    has them already."""
    if precision is None:
        precision = {m: module_precision(ckpt.tensors, m) for m in names}
    family = ckpt.spec.family
    mtp_meta, _ = _engine_view(ckpt, meta)
    reports: list[ModuleReport] = []
    findings: list[Finding] = []
    one_form: list[tuple[str, str]] = []  # (checkpoint name, engine name) excluded only under the checkpoint's name
    is_mtp = ckpt.spec.mtp_names.matcher
    for mod in engine_modules(names, family.engine) if modules is None else modules:
        if mod.kind == "embedding":  # shards of one table, one table-wide scale
            disk = table_precision(ckpt.tensors, mod.prefix, mod.members)
            precision.update(dict.fromkeys(mod.members, disk))
        precs = {precision[m] for m in mod.members}
        disk = precs.pop() if len(precs) == 1 else "mixed"
        mtp = bool(is_mtp(mod.prefix))
        engine_prefix = ckpt.spec.engine_mtp_name(mod.prefix) if mtp else mod.prefix
        try:
            e = vllm_expectation(mod, mtp_meta if mtp else meta, family.engine, engine_prefix)
        except FusedShardsError as exc:
            reports.append(ModuleReport(mod.prefix, list(mod.members), disk, None, str(exc), False))
            findings.append(Finding("exclusions", f"vLLM will fail to load: {exc}"))
            continue
        if e.refusal is not None:
            reports.append(ModuleReport(mod.prefix, list(mod.members), disk, None, e.refusal, False))
            findings.append(Finding("exclusions", f"vLLM will fail to load: {e.refusal}"))
            continue
        q, reason = e.quantized, e.reason
        disk_q = disk != "mixed" and is_quantized(disk)
        consistent = disk != "mixed" and disk != "missing" and q == disk_q
        wrong_format = consistent and q and e.expects is not None and disk != e.expects
        if wrong_format:
            consistent = False
        if disk == "missing":
            consistent = True  # reported through the missing-tensor check
        if mod.kind == "unquantized" and disk_q:
            reason = "vLLM builds it unquantized, but it is quantized on disk"
            if matches(engine_prefix, family.engine.dequantized_on_load):  # DeepSeek-V3.2's FP8 indexer wk
                consistent, reason = True, "vLLM dequantizes it to BF16 as it loads"
        expects = e.expects if e.quantized else None
        reports.append(ModuleReport(mod.prefix, list(mod.members), disk, q, reason, consistent, expects, e.workaround))
        if not consistent:
            if disk == "mixed":
                msg = f"vLLM will fail to load: {mod.prefix} mixes precisions across its tensors"
            elif wrong_format:
                msg = (
                    f"vLLM will fail to load: {mod.prefix} is {disk} on disk but {reason} selects {e.method}, which "
                    f"loads {e.expects}"
                    + (_missing_param(ckpt, mod, engine_prefix, e) if mod.kind == "experts" else "")
                )
            elif q and engine_prefix != mod.prefix and _excluded_as(mod, meta, family.engine):
                one_form.append((mod.prefix, engine_prefix))
                reports[-1].reason = f"excluded as {mod.prefix}, but vLLM's draft builds it as {engine_prefix}"
                continue
            elif q:
                msg = f"vLLM will fail to load: {mod.prefix} is {disk} on disk but declared quantized"
            elif mod.kind == "unquantized":
                msg = f"vLLM will fail to load: {mod.prefix} is {disk} on disk but {unquantized_why(reason)}"
            else:
                msg = f"vLLM will fail to load: {mod.prefix} is {disk} on disk but excluded from quantization"
                if mod.kind == "experts" and e.method is not None:
                    msg += f" ({reason}){_missing_param(ckpt, mod, engine_prefix, e)}"
            findings.append(Finding("exclusions", msg))
    if one_form:  # one line for them all: the exclusions name the MTP one way, vLLM's draft another
        ckpt_name, engine_name = one_form[0]
        findings.append(
            Finding(
                "exclusions",
                f"vLLM will fail to load: the exclusions cover the unquantized MTP only under the checkpoint's names "
                f"({ckpt_name}), but vLLM's draft builds it as {engine_name}, which they do not match: "
                f"{len(one_form)} module{'s' if len(one_form) > 1 else ''} built quantized over unquantized weights",
            )
        )
    return reports, findings


def _excluded_as(mod: EngineModule, meta: QuantMetadata | None, rules: EngineRules) -> bool:
    """Whether the metadata leaves ``mod`` unquantized under its checkpoint name (what an exporter excludes)."""
    try:
        return not vllm_expectation(mod, meta, rules, mod.prefix).quantized
    except FusedShardsError:
        return False


def _unmatched_exclusions(ckpt: Checkpoint, meta: QuantMetadata | None) -> list[str]:
    """The exclusion entries (every file's) that match no module of the checkpoint, under its own names or any
    engine's (``engine.loading.unmatched_exclusions``); the LM head counts as a module even when tied."""
    if meta is None or not (meta.is_modelopt or meta.is_compressed_tensors):
        return []
    patterns = list(dict.fromkeys(p for ps in (meta.exclude, *meta.exclude_by_file.values()) for p in ps))
    if not patterns:
        return []
    # tensor names stand for their modules (a module's name starts each of its tensors'): already in order, as a
    # checkpoint's index lists them, they sort in one pass
    mtp = list(dict.fromkeys(e.name.rpartition(".")[0] for e in ckpt.mtp_tensors()))
    engines = [n for row in ENGINES for n in row.adapter.module_names(mtp, ckpt.spec)]
    return unmatched_exclusions(patterns, [*ckpt.tensors, "lm_head", *engines])


def _removed_on_purpose(ckpt: Checkpoint) -> str | None:
    """``drop`` / ``extract`` when an mtpquant run removed the MTP of a checkpoint whose family has no config key to
    un-declare it (Qwen3-Next: engines assume one layer), as its provenance file records; else None."""
    if ckpt.spec.family.mtp_key is not None or ckpt.mtp_tensors():
        return None
    from mtpquant.records.provenance import source_provenance

    mode = source_provenance(ckpt.source).mode
    return mode if mode in ("drop", "extract") else None


def _mtp_section(ckpt: Checkpoint, meta: QuantMetadata | None, report: dict[str, Any]) -> list[Finding]:
    findings: list[Finding] = []
    spec = ckpt.spec
    report["mtp_removed"] = _removed_on_purpose(ckpt)
    present = ckpt.mtp_tensors()
    present_names = {e.name for e in present}
    expected = spec.expected_mtp_shapes(present_names)
    missing = []
    for name in expected:
        mod = module_of(name)
        if name in present_names or (name.endswith(".weight") and mod + ".weight_packed" in present_names):
            continue
        missing.append(name)
    unexpected = spec.mtp_unexpected(present_names, expected, module_of)
    report.update(
        mtp_inventory=spec.family.mtp.inventory,
        mtp_layers_present=spec.mtp_depth(present_names),
        mtp_declared=spec.mtp.declared,
        mtp_declaration=spec.mtp.describe(),
        mtp_expected_tensors=len(expected),
        mtp_present_tensors=len(present),
        mtp_bytes=sum(e.nbytes for e in present),
        mtp_shards=sorted({e.shard for e in present}),
        mtp_missing=missing,
        mtp_unexpected=unexpected,
    )
    mods = linear_modules({e.name: e for e in present})
    precision = {m: module_precision(ckpt.tensors, m) for m in mods}
    borrowed = spec.mtp_borrowed_head(ckpt.tensors)
    if borrowed is not None:  # the draft's head, built with the quant config, holds the target's lm_head
        mods.append(borrowed[0])
        precision[borrowed[0]] = module_precision(ckpt.tensors, borrowed[1])
    reports, mod_findings = _module_reports(ckpt, mods, meta, precision) if present else ([], [])
    report["mtp_modules"] = reports
    precs = sorted({r.disk for r in reports})
    report["mtp_precision"] = (
        "absent" if not present else (precs[0] if len(precs) == 1 else "mixed: " + ", ".join(precs))
    )
    forgotten = ckpt.forgotten_mtp() if spec.mtp.declared and (not present or missing) else {}
    for shard, tensors in forgotten.items():  # the MTP is on disk, but no loader opens its file
        findings.append(
            Finding(
                "index",
                f"{shard} holds {len(tensors)} MTP tensors but {INDEX_NAME} does not list it: loaders read only the "
                "shards the index names (vLLM's filter_duplicate_safetensors_files), so engines see no MTP",
            )
        )
    depth = report["mtp_layers_present"]
    if spec.mtp.declared and not present:
        if report["mtp_removed"] is None:
            findings.append(Finding("declared_missing", MISSING))
    elif spec.mtp.declared and missing:
        held = (
            f" ({spec.mtp.describe()}, the checkpoint holds {depth} layer{'' if depth == 1 else 's'})"
            if 0 < depth < spec.mtp.layers
            else ""
        )
        findings.append(
            Finding(
                "declared_missing",
                f"MTP incomplete{held}: {len(missing)} of {len(expected)} expected tensors missing (first: "
                f"{missing[0]})",
            )
        )
    elif spec.mtp.declared and 0 < depth < spec.mtp.layers:  # no inventory to miss: the depth alone says it
        findings.append(
            Finding(
                "declared_missing",
                f"MTP incomplete ({spec.mtp.describe()}, the checkpoint holds {depth} "
                f"layer{'' if depth == 1 else 's'})",
            )
        )
    elif not spec.mtp.declared and present:
        findings.append(
            Finding(
                "declared_missing",
                f"MTP present ({len(present)} tensors) but not declared in config.json: engines will not use it",
            )
        )
    if unexpected and spec.mtp.declared:
        findings.append(
            Finding("declared_missing", f"unexpected MTP tensor {unexpected[0]} ({len(unexpected)} in all)")
        )
    findings += mod_findings
    return findings


@dataclass(frozen=True)
class _MainModules:
    """The main model's Linear modules (the main and lm_head classes' ``TableClasses.linears``) with their precisions,
    sorted, and the modules the engines build of them (``engine_modules``): worked out once for a checkpoint and
    reused for each view of it a fix is checked on (``Checkpoint.amended`` shares the classes of the main model)."""

    linears: tuple[Mapping[str, str], ...]
    rules: EngineRules
    precision: Mapping[str, str]
    modules: list[EngineModule]

    @classmethod
    def of(cls, ckpt: Checkpoint, known: _MainModules | None = None) -> _MainModules:
        """``ckpt``'s main model: ``known`` where it is that of the same classes under the same rules."""
        classes = ckpt.classes()
        linears = tuple(classes.linears.get(c, {}) for c in (TensorClass.MAIN, TensorClass.LM_HEAD))
        rules = ckpt.spec.family.engine
        if known is not None and known.rules == rules and all(map(operator.is_, linears, known.linears)):
            return known
        precision = dict(sorted({m: p for part in linears for m, p in part.items()}.items()))
        return cls(linears, rules, precision, engine_modules(list(precision), rules))


def _main_section(
    ckpt: Checkpoint, meta: QuantMetadata | None, known: _MainModules
) -> tuple[MainModelInfo, VisionInfo, list[Finding]]:
    classes = ckpt.classes()
    precision = dict(known.precision)  # embedding-table shards get their table's precision (_module_reports)
    mods = list(precision)
    reports, findings = _module_reports(ckpt, mods, meta, precision, known.modules)
    precs = Counter(precision.values())
    quantized = sum(n for p, n in precs.items() if is_quantized(p))
    bad = [r for r in reports if not r.consistent]
    main = MainModelInfo(
        linear_modules=len(mods),
        quantized=quantized,
        unquantized=len(mods) - quantized,
        precisions=dict(sorted(precs.items())),
        inconsistent_modules=[r.module for r in bad],
    )
    vision_entries = classes.groups.get(TensorClass.VISION, {})
    vprecs = Counter(classes.linears.get(TensorClass.VISION, {}).values())
    vision = VisionInfo(
        present=bool(vision_entries),
        tensors=len(vision_entries),
        precisions=dict(sorted(vprecs.items())),
        expected=ckpt.spec.family.has_vision and ckpt.spec.wrapped,
    )
    if len(findings) > 3:  # keep the list readable: the first few plus a count
        rest = len(findings) - 3
        findings = [
            *findings[:3],
            Finding("exclusions", f"... and {rest} more main-model modules whose metadata disagrees with the tensors"),
        ]
    return main, vision, findings


def inspect_checkpoint(
    ref: str | os.PathLike[str] | CheckpointSource,
    *,
    revision: str | None = None,
    token: str | None = None,
    checkpoint: Checkpoint | None = None,
) -> InspectReport:
    """Inspect a checkpoint directory or Hub repo from metadata and headers only.

    ``checkpoint``: ``ref`` already opened with ``Checkpoint.open`` (a caller that has just opened
    and validated it, graft's verification say), used instead of opening it again. Its ``problems``
    are what a non-strict open finds: a strict open that succeeded collects the same list.
    """
    t0 = time.perf_counter()
    # the table (up to ~300,000 entries) and the records built from it hold no cycles: the collector stays off from the
    # open to the report, and a table opened here is freed (an argument, not a name) before it is back on, so that it
    # has none of it to pass over then
    with bulk_parse():
        if checkpoint is not None:
            return _report(checkpoint, t0)
        return _report(Checkpoint.open(ref, revision=revision, token=token, strict=False), t0)


def _report(ckpt: Checkpoint, t0: float) -> InspectReport:
    main = _MainModules.of(ckpt)
    report = _inspect(ckpt, t0, main)
    if report.exit_code(strict=True):  # each fix is checked on a view whose main model is ckpt's: reuse it
        report.fixes = fix_commands(
            ckpt, lambda c: not _inspect(c, t0, _MainModules.of(c, main)).exit_code(strict=True)
        )
        report.seconds = round(time.perf_counter() - t0, 3)
    return report


def _inspect(ckpt: Checkpoint, t0: float, main_modules: _MainModules) -> InspectReport:
    meta = ckpt.quant_metadata
    report: dict[str, Any] = {}
    failures: list[Finding] = []
    warnings: list[Finding] = []
    failures += _mtp_section(ckpt, meta, report)
    main, vision, main_findings = _main_section(ckpt, meta, main_modules)
    failures += main_findings
    index_problems = [p for p in ckpt.problems if p.fatal]
    failures += [Finding("index", p.message) for p in index_problems]
    warnings += [Finding("note", p.message) for p in ckpt.problems if not p.fatal]
    label = ckpt.label
    facts = VerdictFacts(
        report,
        label,
        meta,
        ckpt.spec.family.engine,
        ckpt.spec.mtp_names.is_mtp,
        ckpt,
        tuple(f.message for f in main_findings),
    )
    verdicts, serve, notes = engine_verdicts(facts)
    warnings += [Finding("exclusions", n) for n in notes]
    if ckpt.mtp_only and report["mtp_declared"] and not report["mtp_missing"]:
        # nothing to serve on its own: say what it is for instead of what an engine would do with it as a model
        what = f"MTP-only checkpoint ({report['mtp_precision']}), no model to serve"
        use = f"graft it into a quant of its base model: mtpquant graft QUANT --from {label}"
        verdicts = {e.key: f"{e.display}: {what}; {use}" for e in ENGINES}
        serve = {}
    dead = _unmatched_exclusions(ckpt, meta)
    if dead:
        shown = ", ".join(dead[:3]) + (", ..." if len(dead) > 3 else "")
        warnings.append(
            Finding(
                "note",
                f"{len(dead)} exclusion{'s' if len(dead) > 1 else ''} match{'' if len(dead) > 1 else 'es'} no "
                f"module of this checkpoint by any engine's rule ({shown}): "
                "whatever they were written for is quantized (a ModelOpt export's corrupt exclude_modules, "
                "TensorRT-LLM PR #18607)",
            )
        )
    if meta is not None and len(set(meta.exclude_by_file.values())) > 1:
        warnings.append(
            Finding("note", "config.json and hf_quant_config.json list different exclusions; vLLM reads config.json")
        )
    if vision.expected and not vision.present and not ckpt.mtp_only:
        warnings.append(Finding("note", "vision tower (model.visual.*) is missing: image input will not work"))
    family = ckpt.spec.family
    if family.status in (NEVER_SHIPPED, NOT_MTP):  # no MTP question to answer: say what the family's drafter is
        failures = [f for f in failures if f.category not in ("declared_missing", "exclusions")]
        failures.insert(0, Finding(family.status, family.status_note))
        verdicts = {e.key: f"{e.display}: no MTP to draft with: {family.status_note}" for e in ENGINES}
        serve = {}
    elif family.status in (RECOGNISED, UNKNOWN):
        warnings.append(Finding("note", family.status_note))
    elif family.status == SEPARATE:  # the target holds no MTP by design: say where the drafter is instead
        warnings.append(Finding("note", family.status_note))
        verdicts = {e.key: f"{e.display}: {family.status_note}" for e in ENGINES}
        serve = {}
    for row in ENGINES:  # what only the engine's own rules say once the rest is known (engine/<engine>.py)
        late = row.adapter.late_verdict(facts, verdicts[row.key])
        if late is not None:
            verdicts[row.key] = late
            serve.pop(row.key, None)
    unknown_label = label_refusal(ckpt)
    if unknown_label is not None:  # no engine resolves the architecture: nothing else matters until relabelled
        failures.append(Finding("format", f"engines will fail to load: {unknown_label}"))
        verdicts = {e.key: f"{e.display} will fail to load: {unknown_label}" for e in ENGINES}
        serve = {}
    for row in ENGINES:
        refusal = row.adapter.format_refusal(meta)
        if refusal is not None:
            failures.append(Finding("format", f"{row.display} will fail to load: {refusal}"))
            verdicts[row.key] = f"{row.display} will fail to load: {refusal}"
            serve.pop(row.key, None)
    if index_problems:
        verdicts = dict.fromkeys(verdicts, f"index corrupt: {index_problems[0].message}")
        serve = {}
    verdicts = {e: v if v.startswith(display(e)) else f"{display(e)}: {v}" for e, v in verdicts.items()}
    if family.status == UNKNOWN:  # the checks are the engines' generic rules; whether they draft for it is not known
        arch = ckpt.spec.architecture
        verdicts = {e: f"{v} (if {display(e)} has a drafter for {arch}: mtpquant does not know it)"
                    for e, v in verdicts.items()}
    quant = QuantizationInfo(
        method=meta.method if meta else None,
        vllm_method=meta.vllm_method if meta else None,
        algorithm=meta.algo if meta else None,
        group_size=meta.group_size if meta else None,
        kv_cache=meta.kv_cache_algo if meta else None,
        exclude=list(meta.exclude) if meta else [],
        declared_in=list(meta.declared_in) if meta else [],
    )
    index = IndexInfo(
        shards=len(ckpt.shards),
        tensors=len(ckpt.tensors),
        problems=[p.message for p in index_problems],
        warnings=[p.message for p in ckpt.problems if not p.fatal],
        intact=not index_problems,
    )
    return InspectReport(
        checkpoint=label,
        family=family.display,
        architecture=ckpt.spec.architecture,
        drafters=dict(family.engine.drafters),
        mtp_status=family.status,
        kind="mtp-only" if ckpt.mtp_only else "model",
        quantization=quant,
        main_model=main,
        vision=vision,
        index=index,
        verdicts=verdicts,
        serve_commands=serve,
        failures=failures,
        warnings=warnings,
        bytes_fetched=ckpt.source.bytes_read,
        requests=ckpt.source.requests,
        checkpoint_bytes=ckpt.total_bytes,
        seconds=round(time.perf_counter() - t0, 3),
        **report,
    )

