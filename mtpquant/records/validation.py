"""The validation report as typed data: what ``validate`` builds, ``report.py`` writes and the model card reads.

``Report.to_json()`` is ``report.json`` (``schema: mtpquant.validate/1``, documented in docs/validate.md);
``Report.from_json()`` reads one back, refusing a document of another shape with ``ValueError``. This module
imports nothing heavy (no torch): publishing reads reports without loading models. The acceptance records a side
holds live in ``acceptance.py``; the JSON reading they all share in ``jsonrecord.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpquant.errors import ExitCode
from mtpquant.records.acceptance import Acceptance, AcceptanceRow
from mtpquant.records.evidence import CONFIDENCE, Interval
from mtpquant.records.jsonrecord import JsonRecord, as_floats, as_object, require
from mtpquant.records.sampling import SamplingSettings

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "READABLE_SCHEMAS",
    "REPORT_SCHEMA",
    "VERDICT_STATUSES",
    "Agreement",
    "ChangeEvidence",
    "Comparison",
    "EngineInfo",
    "KlSummary",
    "MtpInfo",
    "Predicted",
    "PredictedRow",
    "Report",
    "Settings",
    "Side",
    "ValidationReport",
    "Verdict",
    "sides",
]

# The report directory inside a checkpoint (``validate ... --report-dir OUT/validation``): the card reads it and
# publish uploads it, except its ``logs/`` (the engine's server logs name local paths and ports). It describes the
# checkpoint it was measured on, so graft and heal do not carry it into the checkpoint they change.
REPORT_DIR = "validation"
LOGS_DIR = "logs"
REPORT_FILE = "report.json"
MARKDOWN_FILE = "report.md"

REPORT_SCHEMA = "mtpquant.validate/2"
# Earlier schemas this module still reads (their missing keys take their defaults): a report written by an older
# mtpquant inside OUT/validation still gives the model card its figures.
READABLE_SCHEMAS = ("mtpquant.validate/1", REPORT_SCHEMA)


@dataclass(frozen=True)
class MtpInfo(JsonRecord):
    """The MTP of one side: present, why unusable, its precision (Linear count per storage kind)."""

    present: bool
    error: str | None = None
    precision: Mapping[str, int] | None = None
    emulated_activations: tuple[str, ...] = ()


@dataclass(frozen=True)
class Side:
    """One evaluated (target, MTP) pair: the single checkpoint, the reference or the candidate."""

    checkpoint: str
    family: str
    precision: Mapping[str, Any]
    target_source: str
    sequences: int
    tokens: int
    generated_tokens: int
    mtp: MtpInfo
    acceptance: Acceptance | None
    non_finite_target: int = 0  # positions whose target hidden states (so logits) were not finite
    non_finite_mtp: int = 0  # MTP rows (teacher-forced) whose output was not finite
    acceptance_by_sampling: tuple[Acceptance, ...] = ()  # every sampling setting measured (the first: ``acceptance``)

    def to_json(self) -> dict[str, Any]:
        """The ``reference`` / ``candidate`` object."""
        return {
            "checkpoint": self.checkpoint,
            "family": self.family,
            "precision": dict(self.precision),
            "target_source": self.target_source,
            "sequences": self.sequences,
            "tokens": self.tokens,
            "generated_tokens": self.generated_tokens,
            "mtp": self.mtp.to_json(),
            "acceptance": self.acceptance.to_json() if self.acceptance is not None else None,
            "non_finite": {"target": self.non_finite_target, "mtp": self.non_finite_mtp},
            "acceptance_by_sampling": [a.to_json() for a in self.acceptance_by_sampling],
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> Side:
        """Read a side."""
        d = as_object(d, where)
        acc = d.get("acceptance")
        non_finite = d.get("non_finite") if isinstance(d.get("non_finite"), Mapping) else {}
        return cls(
            str(require(d, "checkpoint", str, where)),
            str(d.get("family") or ""),
            dict(d.get("precision") or {}),
            str(d.get("target_source") or ""),
            int(d.get("sequences") or 0),
            int(d.get("tokens") or 0),
            int(d.get("generated_tokens") or 0),
            MtpInfo.from_json(d.get("mtp"), f"{where}.mtp"),
            None if acc is None else Acceptance.from_json(acc, f"{where}.acceptance"),
            int(non_finite.get("target") or 0),
            int(non_finite.get("mtp") or 0),
            tuple(
                Acceptance.from_json(a, f"{where}.acceptance_by_sampling[{i}]")
                for i, a in enumerate(d.get("acceptance_by_sampling") or ())
            ),
        )


@dataclass(frozen=True)
class KlSummary:
    """KL(ref || cand) per position, in nats."""

    mean: float
    median: float
    p99: float
    max: float


@dataclass(frozen=True)
class Agreement(JsonRecord):
    """Candidate vs reference logits at identical positions."""

    positions: int
    top1_agreement: float
    kl: KlSummary | None  # over the positions where both logits are finite (None: there are none)
    non_finite: int = 0  # positions where either side's logits were not finite (their KL is undefined)


@dataclass(frozen=True)
class Comparison:
    """Pair mode: the two sides on identical inputs and the AL change split into MTP and target parts."""

    mtp: Agreement | None = None
    candidate_mtp_on_reference_target: Acceptance | None = None
    al_delta_by_k: tuple[float, ...] = ()
    al_delta_from_mtp_by_k: tuple[float, ...] = ()
    al_delta_from_target_by_k: tuple[float, ...] = ()
    acceptance_delta_per_position: tuple[float, ...] = ()
    main: Agreement | None = None
    main_compared: bool = True  # False: both sides share the reference target (``main`` is null)

    def to_json(self) -> dict[str, Any]:
        """The ``comparison`` object (MTP keys only when both MTPs were usable)."""
        out: dict[str, Any] = {}
        if self.mtp is not None and self.candidate_mtp_on_reference_target is not None:
            out["mtp"] = self.mtp.to_json()
            out["candidate_mtp_on_reference_target"] = self.candidate_mtp_on_reference_target.to_json()
        if self.al_delta_by_k:  # the built-in path (with both MTPs) and the engine path (two servers)
            out["al_delta_by_k"] = list(self.al_delta_by_k)
        if self.al_delta_from_mtp_by_k:  # the built-in path's split of the change
            out["al_delta_from_mtp_by_k"] = list(self.al_delta_from_mtp_by_k)
            out["al_delta_from_target_by_k"] = list(self.al_delta_from_target_by_k)
        if self.acceptance_delta_per_position:
            out["acceptance_delta_per_position"] = list(self.acceptance_delta_per_position)
        if self.main is not None:
            out["main"] = self.main.to_json()
        elif not self.main_compared:
            out["main"] = None
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> Comparison:
        """Read a ``comparison`` object."""
        d = as_object(d, where)
        mtp = d.get("mtp")
        cross = d.get("candidate_mtp_on_reference_target")
        main = d.get("main")
        return cls(
            None if mtp is None else Agreement.from_json(mtp, f"{where}.mtp"),
            None if cross is None else Acceptance.from_json(cross, f"{where}.candidate_mtp_on_reference_target"),
            as_floats(d.get("al_delta_by_k", []), f"{where}.al_delta_by_k"),
            as_floats(d.get("al_delta_from_mtp_by_k", []), f"{where}.al_delta_from_mtp_by_k"),
            as_floats(d.get("al_delta_from_target_by_k", []), f"{where}.al_delta_from_target_by_k"),
            as_floats(d.get("acceptance_delta_per_position", []), f"{where}.acceptance_delta_per_position"),
            None if main is None else Agreement.from_json(main, f"{where}.main"),
            not ("main" in d and main is None),
        )


@dataclass(frozen=True)
class Settings(JsonRecord):
    """How the evaluation ran."""

    k: int
    num_prompts: int
    max_len: int
    prompts: str
    device: str
    dtype: str
    activations: str
    hidden_file: str | None
    warn_al_drop: float
    broken_al: float
    min_main_agreement: float = 0.5
    confidence: float = CONFIDENCE
    sampling: tuple[SamplingSettings, ...] = (SamplingSettings(),)  # every setting measured; the first is the headline
    rule: str = "vllm"  # how drafts are verified (``mtpquant.records.sampling.RULES``)


@dataclass(frozen=True)
class EngineInfo(JsonRecord):
    """The serving engine that measured the acceptance (engine path only)."""

    name: str  # "vllm" | "sglang"
    version: str
    url: str
    model: str
    k: int
    k_source: str  # "server" (its counters or its stated settings) | "--k"
    sampling: Mapping[str, Any] = field(default_factory=dict)
    server_args: tuple[str, ...] = ()
    other_requests: int = 0  # requests other clients completed meanwhile
    side: str = ""  # "reference" | "candidate"
    speculative: Mapping[str, Any] = field(default_factory=dict)  # the settings the server states (or was started with)
    counters: str = "server-wide"  # "server-wide" (vLLM: other requests counted in) | "per-request" (SGLang: exact)
    memory: str = ""  # the memory a server validate started was given (engine/sizing.py); "" for a running server


@dataclass(frozen=True)
class PredictedRow(JsonRecord):
    """``--compare-reference``: what the engine measured beside the built-in prediction, for one sampling setting
    and k of one side (``label``: the setting's; ``difference``: engine AL minus predicted AL)."""

    sampling: SamplingSettings
    label: str  # the sampling setting's (``T=0.8, top-p 0.9``)
    k: int
    predicted_al: float  # mean acceptance length, built-in prediction
    engine_al: float  # ... as the engine measured it
    difference: float  # engine minus predicted
    predicted_acceptance_rate: float
    engine_acceptance_rate: float
    predicted_per_position: tuple[float, ...]
    engine_per_position: tuple[float, ...]
    engine_steps: int  # verification steps the engine counted

    @classmethod
    def of(cls, sampling: SamplingSettings, *, engine: AcceptanceRow, predicted: AcceptanceRow) -> PredictedRow:
        """The row of one k: the engine's measurement beside the prediction."""
        e_al, p_al = engine.mean_acceptance_length, predicted.mean_acceptance_length
        rates = (predicted.acceptance_rate, engine.acceptance_rate)
        positions = (tuple(predicted.acceptance_per_position), tuple(engine.acceptance_per_position))
        return cls(sampling, sampling.label, engine.k, p_al, e_al, e_al - p_al, *rates, *positions, engine.num_steps)


@dataclass(frozen=True)
class Predicted(JsonRecord):
    """``--compare-reference``: the built-in prediction beside the engine's measurement, per side (None: the side
    was not compared, and its key is left out)."""

    method: str
    reference: tuple[PredictedRow, ...] | None = None
    candidate: tuple[PredictedRow, ...] | None = None

    def sides(self) -> list[tuple[str, tuple[PredictedRow, ...]]]:
        """(label, rows) of the compared sides, reference first."""
        return [(label, rows) for label, rows in (("reference", self.reference), ("candidate", self.candidate)) if rows]

    def to_json(self) -> dict[str, Any]:
        """The ``predicted_vs_engine`` object (a side not compared left out)."""
        return {key: value for key, value in super().to_json().items() if value is not None}


@dataclass(frozen=True)
class ChangeEvidence:
    """The AL change at one k, candidate minus reference, with its interval and what it was decided to be."""

    k: int
    change: Interval
    mtp: Interval | None = None  # the MTP's part: candidate MTP on the reference target minus the reference
    target: Interval | None = None  # the target's part: the rest
    decision: str = "inconclusive"  # "within" (the allowed drop) | "drop" (beyond it) | "inconclusive"
    label: str = ""  # the measurement it belongs to, when there are several (e.g. "T=0.8")

    def to_json(self) -> dict[str, Any]:
        """One ``verdict.evidence`` entry."""
        return {
            "k": self.k,
            **({"label": self.label} if self.label else {}),
            "change": self.change.to_json(),
            "mtp": None if self.mtp is None else self.mtp.to_json(),
            "target": None if self.target is None else self.target.to_json(),
            "decision": self.decision,
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> ChangeEvidence:
        """Read a ``verdict.evidence`` entry."""
        d = as_object(d, where)
        mtp, target = d.get("mtp"), d.get("target")
        return cls(
            int(require(d, "k", int, where)),
            Interval.from_json(d.get("change"), f"{where}.change"),
            None if mtp is None else Interval.from_json(mtp, f"{where}.mtp"),
            None if target is None else Interval.from_json(target, f"{where}.target"),
            str(d.get("decision") or "inconclusive"),
            str(d.get("label") or ""),
        )


VERDICT_STATUSES = ("pass", "warn", "fail", "inconclusive")


@dataclass(frozen=True)
class Verdict:
    """``pass`` | ``warn`` | ``fail`` | ``inconclusive``, and why.

    ``broken``: a ``fail`` because the candidate itself is broken (non-finite logits, main-model agreement below
    the floor, AL above the reference beyond noise), not only its MTP. ``thresholds``: what the decision compared
    with. ``evidence``: the AL change per k with its interval (pair mode). ``prompts_needed``: for
    ``inconclusive``, about how many prompts would settle it (None: more than 100x the sample would be needed).
    """

    status: str
    reasons: tuple[str, ...]
    broken: bool = False
    thresholds: Mapping[str, float] = field(default_factory=dict)
    evidence: tuple[ChangeEvidence, ...] = ()
    prompts_needed: int | None = None

    @property
    def exit_code(self) -> int:
        """The process exit status of this verdict (one code per outcome)."""
        if self.status == "fail":
            return int(ExitCode.VALIDATE_BROKEN if self.broken else ExitCode.VALIDATE_FAIL)
        return int(
            {
                "pass": ExitCode.OK,
                "warn": ExitCode.VALIDATE_WARN,
                "inconclusive": ExitCode.VALIDATE_INCONCLUSIVE,
            }.get(self.status, ExitCode.INTERNAL)
        )

    def to_json(self) -> dict[str, Any]:
        """The ``verdict`` object."""
        return {
            "status": self.status,
            "reasons": list(self.reasons),
            "broken": self.broken,
            "thresholds": dict(self.thresholds),
            "evidence": [e.to_json() for e in self.evidence],
            "prompts_needed": self.prompts_needed,
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> Verdict:
        """Read ``verdict``."""
        d = as_object(d, where)
        status = str(require(d, "status", str, where))
        thresholds = d.get("thresholds")
        needed = d.get("prompts_needed")
        return cls(
            status,
            tuple(str(r) for r in d.get("reasons") or ()),
            bool(d.get("broken")),
            {str(k): float(v) for k, v in thresholds.items()} if isinstance(thresholds, Mapping) else {},
            tuple(ChangeEvidence.from_json(e, f"{where}.evidence[{i}]") for i, e in enumerate(d.get("evidence") or ())),
            int(needed) if isinstance(needed, int) and not isinstance(needed, bool) else None,
        )


@dataclass(frozen=True)
class Report:
    """A whole validation report."""

    mtpquant_version: str
    created: str
    mode: str  # "single" | "pair"
    settings: Settings
    reference: Side  # the single checkpoint in single mode
    verdict: Verdict
    candidate: Side | None = None
    comparison: Comparison | None = None
    timing: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    engine: tuple[EngineInfo, ...] = ()  # engine path: the server(s) that measured, one per side and K
    predicted: Predicted | None = None  # --compare-reference: built-in prediction vs engine, per k

    @property
    def pair(self) -> bool:
        """Reference vs candidate."""
        return self.mode == "pair"

    @property
    def subject(self) -> Side:
        """The side the verdict is about: the candidate (pair) or the one checkpoint."""
        return self.candidate if self.pair and self.candidate is not None else self.reference

    def to_json(self) -> dict[str, Any]:
        """``report.json``."""
        out: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "mtpquant_version": self.mtpquant_version,
            "created": self.created,
            "mode": self.mode,
            "settings": self.settings.to_json(),
            "reference": self.reference.to_json(),
        }
        if self.candidate is not None:
            out["candidate"] = self.candidate.to_json()
            out["comparison"] = (self.comparison or Comparison()).to_json()
        if self.engine:
            out["engine"] = [e.to_json() for e in self.engine]
        if self.predicted is not None:
            out["predicted_vs_engine"] = self.predicted.to_json()
        out["timing"] = dict(self.timing)
        out["notes"] = list(self.notes)
        out["verdict"] = self.verdict.to_json()
        return out

    @classmethod
    def from_json(cls, d: Any) -> Report:
        """Read ``report.json``; ``ValueError`` for another schema or shape."""
        d = as_object(d, "report")
        if d.get("schema") not in READABLE_SCHEMAS:
            raise ValueError(f"report: schema {d.get('schema')!r} is not one of {', '.join(READABLE_SCHEMAS)}")
        mode = d.get("mode")
        if mode not in ("single", "pair"):
            raise ValueError(f"report.mode: {mode!r} is neither single nor pair")
        candidate = d.get("candidate")
        comparison = d.get("comparison")
        timing = d.get("timing")
        engine = d.get("engine") or []
        predicted = d.get("predicted_vs_engine")
        return cls(
            str(d.get("mtpquant_version") or ""),
            str(d.get("created") or ""),
            str(mode),
            Settings.from_json(d.get("settings"), "report.settings"),
            Side.from_json(d.get("reference"), "report.reference"),
            Verdict.from_json(d.get("verdict"), "report.verdict"),
            None if candidate is None else Side.from_json(candidate, "report.candidate"),
            None if comparison is None else Comparison.from_json(comparison, "report.comparison"),
            {str(k): float(v) for k, v in timing.items()} if isinstance(timing, Mapping) else {},
            tuple(str(n) for n in d.get("notes") or ()),
            tuple(EngineInfo.from_json(e, f"report.engine[{i}]") for i, e in enumerate(engine)),
            None if predicted is None else Predicted.from_json(predicted, "report.predicted_vs_engine"),
        )


def sides(report: Report) -> Sequence[tuple[str, Side]]:
    """(label, side) in display order: ``checkpoint`` alone, or ``reference`` then ``candidate``."""
    if report.pair and report.candidate is not None:
        return [("reference", report.reference), ("candidate", report.candidate)]
    return [("checkpoint", report.reference)]


@dataclass
class ValidationReport:
    """What ``validate`` returns: the typed report (``report.json``) plus per-position KL for the plots."""

    report: Report
    mtp_kl: Tensor | None = None
    main_kl: Tensor | None = None

    @property
    def status(self) -> str:
        """``pass``, ``warn``, ``fail`` or ``inconclusive``."""
        return self.report.verdict.status

    def to_json(self) -> dict[str, Any]:
        """The report as written to report.json."""
        return self.report.to_json()
