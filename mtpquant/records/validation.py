"""The validation report as typed data: what ``validate`` builds, ``report.py`` writes and the model card reads.

``Report.to_json()`` is ``report.json`` (``schema: mtpquant.validate/2``, documented in docs/validate.md);
``Report.from_json()`` reads one back, refusing a document of another shape with ``ValueError`` naming the place.
Every record here is a ``records.record.Record``. This module imports nothing heavy (no torch): publishing reads
reports without loading models. The acceptance records a side holds live in ``acceptance.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mtpquant.errors import ExitCode
from mtpquant.records.acceptance import Acceptance, AcceptanceRow
from mtpquant.records.evidence import CONFIDENCE, Interval
from mtpquant.records.record import Record
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
    "activations_label",
    "sides",
]

# The report directory inside a checkpoint (``validate ... --report-dir OUT/validation``): the card reads it and
# publish uploads it, except its ``logs/`` (the engine's server logs name local paths and ports). It describes the
# checkpoint it was measured on, so graft and heal do not carry it into the checkpoint they change.
REPORT_DIR = "validation"
LOGS_DIR = "logs"
REPORT_FILE = "report.json"
MARKDOWN_FILE = "report.md"

_ACTIVATIONS = {"emulate": "emulated as the engines run them", "off": "NOT quantized (--activations off)"}


def activations_label(mode: str) -> str:
    """How a report's ``settings.activations`` reads in prose (the report, the card): an opt-out stands out."""
    return _ACTIVATIONS.get(mode, mode)


REPORT_SCHEMA: Literal["mtpquant.validate/2"] = "mtpquant.validate/2"
# Earlier schemas this module still reads (their missing keys take their defaults): a report written by an older
# mtpquant inside OUT/validation still gives the model card its figures.
READABLE_SCHEMAS = ("mtpquant.validate/1", REPORT_SCHEMA)


@dataclass(frozen=True)
class MtpInfo(Record):
    """The MTP of one side: present, why unusable, its precision (Linear count per storage kind)."""

    present: bool
    error: str | None = None
    precision: Mapping[str, int] | None = None
    emulated_activations: tuple[str, ...] = ()


@dataclass(frozen=True)
class Side(Record):
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

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The ``reference`` / ``candidate`` object (the non-finite counts as one ``non_finite`` object)."""
        out = {k: v for k, v in data.items() if not k.startswith("non_finite_") and k != "acceptance_by_sampling"}
        out["non_finite"] = {"target": data["non_finite_target"], "mtp": data["non_finite_mtp"]}
        return out | {"acceptance_by_sampling": data["acceptance_by_sampling"]}

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``non_finite`` read into its two fields."""
        nf = data.get("non_finite")
        if not isinstance(nf, dict):
            return data
        return {**data, "non_finite_target": nf.get("target", 0), "non_finite_mtp": nf.get("mtp", 0)}


@dataclass(frozen=True)
class KlSummary(Record):
    """KL(ref || cand) per position, in nats."""

    mean: float
    median: float
    p99: float
    max: float


@dataclass(frozen=True)
class Agreement(Record):
    """Candidate vs reference logits at identical positions."""

    positions: int
    top1_agreement: float
    kl: KlSummary | None  # over the positions where both logits are finite (None: there are none)
    non_finite: int = 0  # positions where either side's logits were not finite (their KL is undefined)


@dataclass(frozen=True)
class Comparison(Record):
    """Pair mode: the two sides on identical inputs and the AL change split into MTP and target parts."""

    mtp: Agreement | None = None
    candidate_mtp_on_reference_target: Acceptance | None = None
    al_delta_by_k: tuple[float, ...] = ()
    al_delta_from_mtp_by_k: tuple[float, ...] = ()
    al_delta_from_target_by_k: tuple[float, ...] = ()
    acceptance_delta_per_position: tuple[float, ...] = ()
    main: Agreement | None = None
    main_compared: bool = True  # False: both sides share the reference target (``main`` is null)

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The ``comparison`` object (MTP keys only when both MTPs were usable; ``main`` null when not compared)."""
        out: dict[str, Any] = {}
        if self.mtp is not None and self.candidate_mtp_on_reference_target is not None:
            out["mtp"] = data["mtp"]
            out["candidate_mtp_on_reference_target"] = data["candidate_mtp_on_reference_target"]
        if self.al_delta_by_k:  # the built-in path (with both MTPs) and the engine path (two servers)
            out["al_delta_by_k"] = data["al_delta_by_k"]
        if self.al_delta_from_mtp_by_k:  # the built-in path's split of the change
            out["al_delta_from_mtp_by_k"] = data["al_delta_from_mtp_by_k"]
            out["al_delta_from_target_by_k"] = data["al_delta_from_target_by_k"]
        if self.acceptance_delta_per_position:
            out["acceptance_delta_per_position"] = data["acceptance_delta_per_position"]
        if self.main is not None or not self.main_compared:
            out["main"] = data["main"]
        return out

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``main: null`` (not absent) says the main models were not compared."""
        return {**data, "main_compared": not ("main" in data and data["main"] is None)}


@dataclass(frozen=True)
class Settings(Record):
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
class EngineInfo(Record):
    """The serving engine that measured the acceptance (engine path only)."""

    name: str  # a key of engine.table ("vllm", ...)
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
class PredictedRow(Record):
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
class Predicted(Record):
    """``--compare-reference``: the built-in prediction beside the engine's measurement, per side (None: the side
    was not compared, and its key is left out)."""

    method: str
    reference: tuple[PredictedRow, ...] | None = None
    candidate: tuple[PredictedRow, ...] | None = None

    def sides(self) -> list[tuple[str, tuple[PredictedRow, ...]]]:
        """(label, rows) of the compared sides, reference first."""
        return [(label, rows) for label, rows in (("reference", self.reference), ("candidate", self.candidate)) if rows]

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The ``predicted_vs_engine`` object (a side not compared left out)."""
        return {key: value for key, value in data.items() if value is not None}


@dataclass(frozen=True)
class ChangeEvidence(Record):
    """The AL change at one k, candidate minus reference, with its interval and what it was decided to be."""

    k: int
    change: Interval
    mtp: Interval | None = None  # the MTP's part: candidate MTP on the reference target minus the reference
    target: Interval | None = None  # the target's part: the rest
    decision: str = "inconclusive"  # "within" (the allowed drop) | "drop" (beyond it) | "inconclusive"
    label: str = ""  # the measurement it belongs to, when there are several (e.g. "T=0.8")

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """One ``verdict.evidence`` entry (its label only when it has one)."""
        label = {"label": self.label} if self.label else {}
        return {"k": self.k, **label, **{key: data[key] for key in ("change", "mtp", "target", "decision")}}


VERDICT_STATUSES = ("pass", "warn", "fail", "inconclusive")


@dataclass(frozen=True)
class Verdict(Record):
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


@dataclass(frozen=True)
class Report(Record):
    """A whole validation report (``report.json``)."""

    mtpquant_version: str
    created: str
    mode: Literal["single", "pair"]
    settings: Settings
    reference: Side  # the single checkpoint in single mode
    verdict: Verdict
    candidate: Side | None = None
    comparison: Comparison | None = None
    timing: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    engine: tuple[EngineInfo, ...] = ()  # engine path: the server(s) that measured, one per side and K
    predicted: Predicted | None = None  # --compare-reference: built-in prediction vs engine, per k
    # the schema it was read in (one of ``READABLE_SCHEMAS``); a report is written in ``REPORT_SCHEMA``
    schema: Literal["mtpquant.validate/1", "mtpquant.validate/2"] = field(default=REPORT_SCHEMA, kw_only=True)

    @property
    def pair(self) -> bool:
        """Reference vs candidate."""
        return self.mode == "pair"

    @property
    def subject(self) -> Side:
        """The side the verdict is about: the candidate (pair) or the one checkpoint."""
        return self.candidate if self.pair and self.candidate is not None else self.reference

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """``report.json``: the schema first; the candidate and the comparison in pair mode, the engines and the
        prediction where there are some; the verdict last."""
        out: dict[str, Any] = {"schema": REPORT_SCHEMA}
        out |= {key: data[key] for key in ("mtpquant_version", "created", "mode", "settings", "reference")}
        if self.candidate is not None:
            out["candidate"] = data["candidate"]
            out["comparison"] = data["comparison"] if self.comparison is not None else Comparison().to_json()
        if self.engine:
            out["engine"] = data["engine"]
        if self.predicted is not None:
            out["predicted_vs_engine"] = data["predicted"]
        return out | {key: data[key] for key in ("timing", "notes", "verdict")}

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``predicted_vs_engine`` read as ``predicted``."""
        if "predicted_vs_engine" not in data:
            return data
        moved = {"predicted": data["predicted_vs_engine"]}
        return {k: v for k, v in data.items() if k != "predicted_vs_engine"} | moved

    @classmethod
    def from_json(cls, d: Any, where: str = "report") -> Report:
        """Read ``report.json``; ``ValueError`` naming the place of the first problem (another schema too)."""
        return super().from_json(d, where)


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
