"""What vLLM and SGLang will do with a checkpoint's MTP: each module as the engine builds it (``ModuleReport``),
the one-line verdict per engine and the serve command where it loads.

``report.py`` gathers the facts (tensors, metadata, index) and builds the ``InspectReport`` from these verdicts;
the engines' own loader rules they apply are in ``engines.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.precision import is_quantized, module_precision
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.loading import (
    EngineModule,
    FusedShardsError,
    engine_modules,
    sglang_builds_quantized,
    sglang_mtp_build,
    vllm_expectation,
)
from mtpquant.families import QWEN_MTP_NAMES, EngineRules, family
from mtpquant.formats.quant_config import QuantMetadata

__all__ = [
    "MISSING",
    "NUM_SPECULATIVE_TOKENS",
    "ModuleReport",
    "engine_verdicts",
    "label_refusal",
    "serve_command",
    "sglang_keeps_quantized_mtp",
    "sglang_mismatch",
    "unquantized_why",
]

NUM_SPECULATIVE_TOKENS = 3
MISSING = "MTP declared but missing: speculative decoding will accept nothing"


@dataclass
class ModuleReport:
    """One MTP module as vLLM builds it: on-disk precision vs the precision vLLM expects."""

    module: str
    members: list[str]
    disk: str  # precision on disk (BF16, NVFP4, FP8, FP8-block, NVFP4-CT, mixed, missing)
    vllm_quantized: bool | None  # None when vLLM refuses the module outright
    reason: str
    consistent: bool
    expects: str | None = None  # the on-disk precision vLLM's method for it loads, where it is checked
    workaround: bool = False  # unquantized only thanks to an engine workaround


# Precisions whose weight is packed (not the BF16 shape): SGLang cannot load them into a module it built in BF16.
_PACKED_PRECISIONS = ("NVFP4", "NVFP4-CT")


def _sglang_verdict(
    mods: list[ModuleReport],
    meta: QuantMetadata | None,
    precision: str,
    rules: EngineRules,
    is_mtp: Callable[[str], bool],
) -> tuple[str, bool]:
    """What SGLang does with this MTP (``engine/loading.py``: its loader's rules), and whether it serves it
    with NEXTN."""
    built = {m.module: _sglang_build(m, meta, rules, is_mtp) for m in mods}
    for m in mods:
        q, reason = built[m.module]
        disk_q = m.disk != "mixed" and is_quantized(m.disk)
        if m.disk == "missing" or (q == disk_q and m.disk != "mixed"):
            continue
        if q is None:
            return f"SGLang will fail to load the MTP (NEXTN): {reason}", False
        if m.disk == "mixed":
            return f"SGLang will fail to load the MTP (NEXTN): {m.module} mixes precisions across its tensors", False
        if q:
            return (
                f"SGLang will fail to load the MTP (NEXTN): it builds {m.module} quantized ({reason}), but it is "
                f"{m.disk} on disk",
                False,
            )
        if m.disk in _PACKED_PRECISIONS:
            return (
                f"SGLang will fail to load the MTP (NEXTN): {reason}, and the packed {m.disk} weight of {m.module} "
                "does not fit a BF16 module; serve without speculative decoding, or with vLLM",
                False,
            )
        return (
            f"SGLang will draft with a wrong MTP (NEXTN): {reason}, and loads the {m.disk} values of {m.module} "
            "without their scales",
            False,
        )
    if any(is_quantized(m.disk) for m in mods):
        _, why = sglang_mtp_build(meta, is_mtp)
        return f"SGLang: MTP loads ({precision}; {why})", True
    return f"SGLang: MTP loads ({precision})", True


def _sglang_build(
    m: ModuleReport, meta: QuantMetadata | None, rules: EngineRules, is_mtp: Callable[[str], bool]
) -> tuple[bool | None, str]:
    module = EngineModule(m.module, tuple(m.members), _module_kind(m, rules))
    try:
        return sglang_builds_quantized(module, meta, rules, is_mtp)
    except FusedShardsError as exc:
        return None, str(exc)


def _module_kind(m: ModuleReport, rules: EngineRules) -> str:
    return next((e.kind for e in engine_modules(m.members, rules) if e.prefix == m.module), "linear")


def label_refusal(ckpt: Checkpoint) -> str | None:
    """A day-0 alias the engines do not know (vLLM 0.32's model registry and SGLang 0.5.23's configs have only the
    qwen4_exp labels)."""
    known = ckpt.spec.family.engine.known_architectures
    unknown = [(where, alias, canon) for where, alias, canon in ckpt.spec.aliases() if known and alias not in known]
    if not unknown:
        return None
    where, alias, canon = unknown[0]
    return (
        f"the day-0 label {alias} ({where}) is unknown to vLLM 0.32 and SGLang 0.5.23 (the weights are "
        f"{canon}'s): relabel with `mtpquant graft QUANT --fix-metadata --out FIXED`"
    )


def sglang_keeps_quantized_mtp(ckpt: Checkpoint, meta: QuantMetadata | None) -> bool:
    """SGLang 0.5.23 ``_mtp_quant_config`` (models/qwen3_5_mtp.py 50-69, used by qwen4_exp_mtp.py 47): a
    MIXED_PRECISION config whose quantized_layers list ``mtp.*`` entries builds the MTP quantized; every other
    ModelOpt NVFP4 checkpoint gets an unquantized MTP. Applied where the registry says so (``sglang_mixed_mtp``)."""
    return (
        ckpt.spec.family.sglang_mixed_mtp
        and meta is not None
        and meta.vllm_method == "modelopt_mixed"
        and any(ckpt.is_mtp(k) for k in meta.quantized_layers)
    )


def sglang_mismatch(ckpt: Checkpoint, meta: QuantMetadata) -> str | None:
    """Where SGLang builds the MTP with the MIXED_PRECISION config, the first MTP module whose disk format its
    resolved quant_algo does not load. SGLang's MTP is one decoder layer under its own index (``mtp.layers.0``,
    qwen4_exp_mtp.py 42-65), so the checkpoint's names are looked up unchanged."""
    rules = ckpt.spec.family.engine
    present = {e.name: e for e in ckpt.mtp_tensors()}
    names = linear_modules(present)
    precision = {m: module_precision(ckpt.tensors, m) for m in names}
    for mod in engine_modules(names, rules):
        precs = {precision[m] for m in mod.members}
        disk = precs.pop() if len(precs) == 1 else "mixed"
        try:
            e = vllm_expectation(mod, meta, rules)
        except FusedShardsError as exc:
            return str(exc)
        if disk in ("mixed", "missing") or (not e.quantized and not is_quantized(disk)):
            continue
        if not e.quantized or (e.expects is not None and disk != e.expects):
            return f"{mod.prefix} is {disk} on disk but SGLang resolves {e.reason}"
    return None


def engine_verdicts(
    report: dict[str, Any],
    ref: str,
    meta: QuantMetadata | None = None,
    rules: EngineRules | None = None,
    sglang_quantized_ok: bool = False,
    is_mtp: Callable[[str], bool] = QWEN_MTP_NAMES.is_mtp,
) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The verdict line per engine, the serve command per engine that loads the MTP, and the exclusion warnings
    (``notes``) from ``report``: the MTP facts the report has gathered (``mtp_*`` keys). ``sglang_quantized_ok``: the
    family's own SGLang resolution keeps this MTP quantized (``sglang_keeps_quantized_mtp``); ``is_mtp``: the family's
    MTP name test."""
    notes: list[str] = []
    present = report["mtp_present_tensors"] > 0
    mods: list[ModuleReport] = report["mtp_modules"]
    # modules vLLM refuses outright (fused shards disagree) come first: that is the load error users see
    broken = sorted((m for m in mods if not m.consistent), key=lambda m: m.vllm_quantized is not None)
    if report["mtp_declared"] and not present:
        msg = MISSING
        if report["mtp_removed"] is not None:
            msg = (
                f"no MTP (removed on purpose: convert --mtp {report['mtp_removed']}); the config cannot un-declare it, "
                "so serve without MTP speculative decoding"
            )
        return {"vllm": msg, "sglang": msg}, {}, notes
    if not report["mtp_declared"]:
        msg = "no MTP declared: speculative decoding with MTP is not available"
        if present:
            msg = "MTP tensors present but not declared: engines will not use them"
        return {"vllm": msg, "sglang": msg}, {}, notes
    if report["mtp_missing"]:
        msg = f"MTP incomplete ({len(report['mtp_missing'])} tensors missing): engines will fail or accept nothing"
        return {"vllm": msg, "sglang": msg}, {}, notes
    if broken:
        vllm = f"vLLM will fail to load: {broken[0].module} is {broken[0].disk} on disk but " + (
            "declared quantized" if broken[0].vllm_quantized else unquantized_why(broken[0].reason)
        )
        if broken[0].vllm_quantized is None:
            vllm = f"vLLM will fail to load: {broken[0].reason}"
        elif broken[0].vllm_quantized and broken[0].reason.startswith("excluded as "):  # one name form excluded
            vllm = f"vLLM will fail to load: {broken[0].module} is {broken[0].disk} on disk and {broken[0].reason}"
        elif broken[0].expects is not None and broken[0].disk not in ("mixed", broken[0].expects):
            vllm = f"vLLM will fail to load: {broken[0].module} is {broken[0].disk} on disk but vLLM loads it as " + (
                f"{broken[0].expects} ({broken[0].reason})"
            )
    else:
        vllm = f"vLLM: MTP loads ({report['mtp_precision']})"
        for m in (m for m in mods if m.workaround):
            vllm += (
                f"; {m.module} is not covered by the exclusions and loads only through vLLM's hard-coded "
                f"{m.module} workaround"
            )
            notes.append(
                f"exclusions do not cover {m.module}: only vLLM's hard-coded modelopt_fp4 workaround keeps it "
                "unquantized (graft --fix-metadata repairs it: the fix line)"
            )
    if sglang_quantized_ok:  # the family's own resolution (qwen4_exp: sglang_mismatch checks it)
        sglang, sglang_serves = f"SGLang: MTP loads ({report['mtp_precision']}; quantized_layers lists the MTP)", True
    else:
        sglang, sglang_serves = _sglang_verdict(
            mods, meta, report["mtp_precision"], rules or family("qwen3_5").engine, is_mtp
        )
    serve: dict[str, str] = {}
    if not broken:
        serve["vllm"] = serve_command("vllm", ref)
    if sglang_serves:
        serve["sglang"] = serve_command("sglang", ref)
    return {"vllm": vllm, "sglang": sglang}, serve, notes


def unquantized_why(reason: str) -> str:
    """Why vLLM builds a module unquantized, as a verdict says it: "excluded from quantization", or that vLLM builds it
    without a quantization config (a plain ``nn.Linear`` such as DeepSeek's ``eh_proj``, a router)."""
    if reason.startswith("vLLM builds it"):
        return "vLLM builds it without a quantization config"
    return "excluded from quantization"


def serve_command(engine: str, ref: str, k: int = NUM_SPECULATIVE_TOKENS) -> str:
    """The command that serves ``ref`` with ``engine`` (``vllm`` | ``sglang``), drafting ``k`` tokens per step with
    its MTP."""
    if engine == "sglang":
        return (
            f"python -m sglang.launch_server --model-path {ref} --speculative-algorithm NEXTN "
            f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        )
    return f'vllm serve {ref} --speculative-config \'{{"method":"mtp","num_speculative_tokens":{k}}}\''

