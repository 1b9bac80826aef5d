"""What the engines will do with a checkpoint's MTP: each module as vLLM builds it (``ModuleReport``), the one-line
verdict per engine of the table (``engine/table.py``) and the serve command of each engine that loads it.

``diagnose/report.py`` gathers the facts (tensors, metadata, index) into ``VerdictFacts``; the verdicts that do not
depend on the engine (no MTP, an incomplete one) are drawn here, the rest by each engine's own module
(``mtp_verdict``, ``late_verdict``, ``format_refusal``, ``serve_command``), which applies that engine's loader rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpquant.engine.table import ENGINES
from mtpquant.families import QWEN_MTP_NAMES, EngineRules
from mtpquant.formats.quant_config import QuantMetadata

if TYPE_CHECKING:
    from mtpquant.checkpoint.table import Checkpoint

__all__ = [
    "MISSING",
    "NUM_SPECULATIVE_TOKENS",
    "EngineVerdict",
    "ModuleReport",
    "VerdictFacts",
    "engine_verdicts",
    "label_refusal",
    "serve_command",
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


@dataclass(frozen=True)
class VerdictFacts:
    """What every engine's verdict is drawn from: the MTP facts inspect gathered (``report``: its ``mtp_*`` keys),
    the reference a serve command names, the quantization metadata, the family's rules and MTP name test, and (from
    inspect) the checkpoint and the main model's findings."""

    report: dict[str, Any]
    ref: str
    meta: QuantMetadata | None = None
    rules: EngineRules | None = None
    is_mtp: Callable[[str], bool] = QWEN_MTP_NAMES.is_mtp
    ckpt: Checkpoint | None = None
    main_findings: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineVerdict:
    """One engine's verdict line, whether it serves the MTP (a serve command follows), and warnings for inspect."""

    line: str
    serves: bool
    notes: tuple[str, ...] = field(default=())


def _shared_verdict(report: dict[str, Any]) -> str | None:
    """The verdict every engine shares when there is no MTP to build (none declared, none present, incomplete)."""
    present = report["mtp_present_tensors"] > 0
    if report["mtp_declared"] and not present:
        if report["mtp_removed"] is not None:
            return (
                f"no MTP (removed on purpose: convert --mtp {report['mtp_removed']}); the config cannot un-declare it, "
                "so serve without MTP speculative decoding"
            )
        return MISSING
    if not report["mtp_declared"]:
        if present:
            return "MTP tensors present but not declared: engines will not use them"
        return "no MTP declared: speculative decoding with MTP is not available"
    if report["mtp_missing"]:
        return f"MTP incomplete ({len(report['mtp_missing'])} tensors missing): engines will fail or accept nothing"
    return None


def engine_verdicts(facts: VerdictFacts) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """The verdict line per engine, the serve command per engine that loads the MTP, and the exclusion warnings
    (``notes``), each engine's drawn by its own module (``mtp_verdict``)."""
    shared = _shared_verdict(facts.report)
    if shared is not None:
        return dict.fromkeys((e.key for e in ENGINES), shared), {}, []
    verdicts: dict[str, str] = {}
    serve: dict[str, str] = {}
    notes: list[str] = []
    for row in ENGINES:
        v: EngineVerdict = row.adapter.mtp_verdict(facts)
        verdicts[row.key] = v.line
        if v.serves:
            serve[row.key] = serve_command(row.key, facts.ref)
        notes += v.notes
    return verdicts, serve, notes


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


def serve_command(engine: str, ref: str, k: int = NUM_SPECULATIVE_TOKENS) -> str:
    """The command that serves ``ref`` with ``engine`` (a key of ``engine.table``), drafting ``k`` tokens per step with
    its MTP."""
    from mtpquant.engine.table import engine as engine_row

    return str(engine_row(engine).adapter.serve_command(ref, k))
