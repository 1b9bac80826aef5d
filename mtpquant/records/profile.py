"""``speculation_profile.json``: the measured acceptance shipped beside ``report.json``, in the shape NVIDIA
Model-Optimizer's open PRs propose for speculation profiles (NVIDIA/Model-Optimizer#2313 export, #2247
specdec_bench, #2315 ar_validate, #2316 docs), so serving simulators and adaptive-speculation schedulers read one
acceptance vector per checkpoint instead of a guessed one.

The top-level fields are ModelOpt's (``schema_version`` "1.0"), for the headline measurement: the subject (the
candidate, or the one checkpoint) at the largest k and the first sampling setting. Conventions, as those PRs fix
them (#2247): ``marginal_accept_rates[i]`` = P(the first i + 1 drafts all accepted) per verification step;
``conditional_accept_rates[i]`` = marginal[i] / marginal[i - 1]; ``acceptance_length_histogram`` counts steps by
tokens emitted (accepted drafts + the target's bonus token, 1..K+1), so position i maps to length i + 2 and
``1 + sum(marginal) == mean_accept_length``. A bucket (or k) without a verification step measured nothing: its rates
and AL are null, never 0 (which a serving simulator would read as no acceptance), and so is a conditional rate after
a position nothing passed. ``acceptance_length_histogram_counts`` says what the histogram counts: ``observed`` steps
(an engine's counters, greedy built-in chains), or ``expected`` steps, fractional (the built-in prediction under
sampling sums acceptance probabilities). mtpquant adds ``by_k`` (measured at every k, ``accept_length_model``
``measured_per_k``), ``by_sampling`` (every temperature), ``by_context`` (context-length buckets) and ``mtpquant``
(producer, report schema). docs/validate.md relates every field to the PRs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mtpquant import __version__
from mtpquant.records.acceptance import Acceptance, AcceptanceRow, ContextBucket
from mtpquant.records.record import Record
from mtpquant.records.validation import REPORT_SCHEMA, Report, Side

__all__ = [
    "PROFILE_FILE",
    "PROFILE_SCHEMA_VERSION",
    "ProfileHeadline",
    "SpeculationProfile",
    "profile_headline",
    "speculation_profile",
]

PROFILE_FILE = "speculation_profile.json"
PROFILE_SCHEMA_VERSION = "1.0"  # ModelOpt's schema_version (NVIDIA/Model-Optimizer#2247)


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else round(float(v), 6)


@dataclass(frozen=True)
class Vectors(Record):
    """Marginal and conditional rates, AL and the length histogram of some verification steps; null where nothing
    was measured (no step; a conditional rate after a position no step passed)."""

    conditional_accept_rates: tuple[float | None, ...] | None
    marginal_accept_rates: tuple[float, ...] | None
    mean_accept_length: float | None
    acceptance_length_histogram: Mapping[str, int | float]
    acceptance_length_histogram_counts: str  # "observed" steps | "expected" steps (fractional)

    @classmethod
    def of(cls, steps: float, accepted_per_position: Sequence[float], counts: str) -> Vectors:
        """The vectors of ``steps`` steps with these per-position counts (survival)."""
        if steps <= 0:
            return cls(None, None, None, {}, counts)
        marginal = [a / steps for a in accepted_per_position]
        conditional: list[float | None] = []
        before = 1.0
        for m in marginal:
            conditional.append(round(m / before, 6) if before > 0 else None)
            before = m
        survival = [steps, *accepted_per_position, 0.0]  # steps emitting at least 1, 2, ..., K+1 tokens; then none
        histogram = {str(n): _num(survival[n - 1] - survival[n]) for n in range(1, len(survival))}
        return cls(
            tuple(conditional),
            tuple(round(m, 6) for m in marginal),
            round(1.0 + sum(accepted_per_position) / steps, 6),
            histogram,
            counts,
        )


_VECTORS = ("conditional_accept_rates", "marginal_accept_rates", "mean_accept_length", "acceptance_length_histogram",
            "acceptance_length_histogram_counts")


@dataclass(frozen=True)
class ProfileRow(Record):
    """One k: its steps, vectors, the mean AL per request and AL's interval (where measured)."""

    k: int
    steps: int
    vectors: Vectors
    mean_accept_length_per_request: float | None = None
    per_request: bool = False  # whether the per-request mean was measured (its key then present, null or not)
    mean_accept_length_interval: tuple[float, float] | None = None

    @classmethod
    def of(cls, row: AcceptanceRow, counts: str) -> ProfileRow:
        """The row of ``row``."""
        per_request: float | None = None
        if row.units is not None:
            als = [1.0 + a / s for a, s in zip(row.units.accepted, row.units.steps) if s > 0]
            per_request = round(sum(als) / len(als), 6) if als else None
        interval = row.al_interval
        bounds = (round(interval.low, 6), round(interval.high, 6)) if interval and interval.defined else None
        vectors = Vectors.of(row.num_steps, row.accepted_per_position, counts)
        return cls(row.k, row.num_steps, vectors, per_request, row.units is not None, bounds)

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """``{"k", "steps", <the vectors>, ["mean_accept_length_per_request"], ["mean_accept_length_interval"]}``."""
        out = {"k": self.k, "steps": self.steps, **data["vectors"]}
        if self.per_request:
            out["mean_accept_length_per_request"] = data["mean_accept_length_per_request"]
        if self.mean_accept_length_interval is not None:
            out["mean_accept_length_interval"] = data["mean_accept_length_interval"]
        return out

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The vectors read from the row's own keys."""
        return {**data, "vectors": {k: data[k] for k in _VECTORS if k in data},
                "per_request": "mean_accept_length_per_request" in data}


@dataclass(frozen=True)
class ContextRow(Record):
    """One context-length bucket: ``[low, high)``, its steps and vectors."""

    context: tuple[int, int]
    steps: int
    vectors: Vectors

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """``{"context", "steps", <the vectors>}``."""
        return {"context": data["context"], "steps": self.steps, **data["vectors"]}

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The vectors read from the row's own keys."""
        return {**data, "vectors": {k: data[k] for k in _VECTORS if k in data}}


@dataclass(frozen=True)
class SamplingRule(Record):
    """A sampling setting and the verification rule it was measured under."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    rule: str

    @classmethod
    def of(cls, acc: Acceptance) -> SamplingRule:
        """``acc``'s setting and rule."""
        s = acc.sampling
        return cls(s.temperature, s.top_p, s.top_k, s.seed, acc.rule)


@dataclass(frozen=True)
class SamplingProfile(Record):
    """Every k measured under one sampling setting."""

    sampling: SamplingRule
    by_k: tuple[ProfileRow, ...]


@dataclass(frozen=True)
class DraftCheckpoint(Record):
    """The checkpoint whose MTP drafted, and its MTP's precision."""

    checkpoint: str
    mtp_precision: Mapping[str, int] | None


@dataclass(frozen=True)
class TargetModel(Record):
    """The checkpoint whose main model verified."""

    checkpoint: str
    family: str
    precision: Mapping[str, Any]


@dataclass(frozen=True)
class Conditions(SamplingRule):
    """How it was measured: the prompts, their lengths, the engine, the headline sampling, the machine."""

    dataset: str = ""
    num_samples: int = 0
    isl: float | None = None  # mean prompt tokens
    osl: float = 0.0  # mean generated tokens
    validation: str = ""
    engine: str = ""
    context_buckets: tuple[tuple[int, int], ...] = ()
    device: str = ""
    dtype: str = ""
    activations: str = ""
    versions: Mapping[str, str] | None = None

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """The prompts and the engine first, then the sampling, then the machine."""
        first = ("dataset", "num_samples", "isl", "osl", "validation", "engine")
        rest = ("temperature", "top_p", "top_k", "seed", "rule", "context_buckets", "device", "dtype", "activations",
                "versions")
        return {key: data[key] for key in (*first, *rest)}


@dataclass(frozen=True)
class ProfileSource(Record):
    """Where the profile comes from: mtpquant's report, its schema and verdict."""

    report: str
    report_schema: str
    verdict: str


@dataclass(frozen=True)
class SpeculationProfile(Record):
    """``speculation_profile.json``: the headline (the subject at the largest k, first sampling setting) in
    ModelOpt's top-level fields, then every k, sampling setting and context bucket."""

    num_speculative_tokens: int
    headline: ProfileRow
    draft_checkpoint: DraftCheckpoint
    target_model: TargetModel
    measurement_conditions: Conditions
    by_k: tuple[ProfileRow, ...]
    by_sampling: tuple[SamplingProfile, ...]
    by_context: tuple[ContextRow, ...]
    mtpquant: ProfileSource
    schema_version: str = PROFILE_SCHEMA_VERSION
    measured: bool = True
    method: str = "mtp"
    verification_method: str = "longest_prefix"
    accept_length_model: str = "measured_per_k"

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """ModelOpt's fields first (the headline row's, less its k and steps), then mtpquant's."""
        head = {k: v for k, v in data["headline"].items() if k not in ("k", "steps")}
        out = {key: data[key] for key in ("schema_version", "measured", "method", "num_speculative_tokens")}
        out |= head
        keys = ("verification_method", "accept_length_model", "draft_checkpoint", "target_model",
                "measurement_conditions", "by_k", "by_sampling", "by_context", "mtpquant")
        return out | {key: data[key] for key in keys}

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The headline read from the top-level keys (at the largest k)."""
        return {**data, "headline": {**data, "k": data.get("num_speculative_tokens"), "steps": 0}}


def _counts(report: Report, acc: Acceptance) -> str:
    """What the histograms of ``acc`` count: ``expected`` steps (fractional) when the built-in path predicted them
    under sampling, else ``observed`` ones."""
    return "expected" if not report.engine and not acc.sampling.greedy else "observed"


def _context(bucket: ContextBucket, counts: str) -> ContextRow:
    return ContextRow((bucket.low, bucket.high), bucket.steps, Vectors.of(bucket.steps, bucket.accepted_per_position,
                                                                          counts))


def profile_of(report: Report) -> SpeculationProfile | None:
    """The profile of ``report``'s subject (None when it has no usable MTP)."""
    side: Side = report.subject
    if side.acceptance is None or not side.acceptance.by_k:
        return None
    head = side.acceptance
    top = head.by_k[-1]
    s = report.settings
    engine = report.engine[0] if report.engine else None
    generated = side.generated_tokens / side.sequences if side.sequences else 0.0
    sampling = SamplingRule.of(head)
    conditions = Conditions(
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        sampling.seed,
        sampling.rule,
        dataset=s.prompts,
        num_samples=side.sequences,
        isl=round((side.tokens - side.generated_tokens) / side.sequences, 1) if side.sequences else None,
        osl=round(generated, 1),
        validation=(
            f"engine counters ({engine.name} {engine.version})"
            if engine is not None
            else "built-in prediction (mtpquant: target sequences sampled with transformers, drafts by the MTP "
            "chain, the rule's acceptance probabilities)"
        ) + ("; activations NOT quantized (--activations off): optimistic for W4A4" if s.activations == "off" else ""),
        engine=f"{engine.name} {engine.version}" if engine is not None else "built-in",
        context_buckets=tuple((b.low, b.high) for b in top.by_context),
        device=s.device,
        dtype=s.dtype,
        activations=s.activations,
        versions={"mtpquant": report.mtpquant_version or __version__},
    )
    counts = _counts(report, head)
    return SpeculationProfile(
        num_speculative_tokens=top.k,
        headline=ProfileRow.of(top, counts),
        draft_checkpoint=DraftCheckpoint(side.checkpoint, side.mtp.precision),
        target_model=TargetModel(side.checkpoint, side.family, side.precision),
        measurement_conditions=conditions,
        by_k=tuple(ProfileRow.of(r, counts) for r in head.by_k),
        by_sampling=tuple(
            SamplingProfile(SamplingRule.of(acc), tuple(ProfileRow.of(r, _counts(report, acc)) for r in acc.by_k))
            for acc in (side.acceptance_by_sampling or (head,))
        ),
        by_context=tuple(_context(b, counts) for b in top.by_context),
        mtpquant=ProfileSource("report.json", REPORT_SCHEMA, report.verdict.status),
    )


def speculation_profile(report: Report) -> dict[str, Any] | None:
    """``speculation_profile.json``'s object for ``report`` (None when its subject has no usable MTP)."""
    profile = profile_of(report)
    return profile.to_json() if profile is not None else None


@dataclass(frozen=True)
class ProfileHeadline:
    """What a model card shows of a profile: K, AL, the conditional vector and how it was measured."""

    k: int
    mean_accept_length: float
    conditional_accept_rates: tuple[float | None, ...]  # None: after a position no step passed
    conditions: str


def profile_headline(data: Mapping[str, Any]) -> ProfileHeadline | None:
    """The headline of a ``speculation_profile.json`` object; None when it is not a measured profile."""
    try:
        profile = SpeculationProfile.from_json(data, PROFILE_FILE)
    except ValueError:
        return None
    head = profile.headline.vectors
    if not profile.measured or head.mean_accept_length is None or head.conditional_accept_rates is None:
        return None
    c = profile.measurement_conditions
    how = f"{c.validation}, T={c.temperature:g}, rule {c.rule}"
    return ProfileHeadline(profile.num_speculative_tokens, head.mean_accept_length, head.conditional_accept_rates, how)
