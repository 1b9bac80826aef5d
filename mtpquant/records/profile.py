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
from mtpquant.records.validation import REPORT_SCHEMA, Report, Side

__all__ = ["PROFILE_FILE", "PROFILE_SCHEMA_VERSION", "ProfileHeadline", "profile_headline", "speculation_profile"]

PROFILE_FILE = "speculation_profile.json"
PROFILE_SCHEMA_VERSION = "1.0"  # ModelOpt's schema_version (NVIDIA/Model-Optimizer#2247)


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else round(float(v), 6)


def _vectors(steps: float, accepted_per_position: Sequence[float], counts: str) -> dict[str, Any]:
    """Marginal and conditional rates and the length histogram from steps and per-position counts (survival); null
    where nothing was measured (no step; a conditional rate after a position no step passed)."""
    if steps <= 0:
        return {
            "conditional_accept_rates": None,
            "marginal_accept_rates": None,
            "mean_accept_length": None,
            "acceptance_length_histogram": {},
            "acceptance_length_histogram_counts": counts,
        }
    marginal = [a / steps for a in accepted_per_position]
    conditional: list[float | None] = []
    before = 1.0
    for m in marginal:
        conditional.append(round(m / before, 6) if before > 0 else None)
        before = m
    survival = [steps, *accepted_per_position, 0.0]  # steps emitting at least 1, 2, ..., K+1 tokens; then none
    histogram = {str(length): _num(survival[length - 1] - survival[length]) for length in range(1, len(survival))}
    return {
        "conditional_accept_rates": conditional,
        "marginal_accept_rates": [round(m, 6) for m in marginal],
        "mean_accept_length": round(1.0 + sum(accepted_per_position) / steps, 6),
        "acceptance_length_histogram": histogram,
        "acceptance_length_histogram_counts": counts,
    }


def _counts(report: Report, acc: Acceptance) -> str:
    """What the histograms of ``acc`` count: ``expected`` steps (fractional) when the built-in path predicted them
    under sampling, else ``observed`` ones."""
    return "expected" if not report.engine and not acc.sampling.greedy else "observed"


def _row(row: AcceptanceRow, counts: str) -> dict[str, Any]:
    out = {"k": row.k, "steps": row.num_steps, **_vectors(row.num_steps, row.accepted_per_position, counts)}
    if row.units is not None:
        per_request = [1.0 + a / s for a, s in zip(row.units.accepted, row.units.steps) if s > 0]
        out["mean_accept_length_per_request"] = round(sum(per_request) / len(per_request), 6) if per_request else None
    if row.al_interval is not None and row.al_interval.defined:
        out["mean_accept_length_interval"] = [round(row.al_interval.low, 6), round(row.al_interval.high, 6)]
    return out


def _context(bucket: ContextBucket, counts: str) -> dict[str, Any]:
    vectors = _vectors(bucket.steps, bucket.accepted_per_position, counts)
    return {"context": [bucket.low, bucket.high], "steps": bucket.steps, **vectors}


def _sampling(acc: Acceptance) -> dict[str, Any]:
    return {**acc.sampling.to_json(), "rule": acc.rule}


def speculation_profile(report: Report) -> dict[str, Any] | None:
    """The profile of ``report``'s subject (None when it has no usable MTP)."""
    side: Side = report.subject
    if side.acceptance is None or not side.acceptance.by_k:
        return None
    head = side.acceptance
    top = head.by_k[-1]
    s = report.settings
    engine = report.engine[0] if report.engine else None
    generated = side.generated_tokens / side.sequences if side.sequences else 0.0
    conditions = {
        "dataset": s.prompts,
        "num_samples": side.sequences,
        "isl": round((side.tokens - side.generated_tokens) / side.sequences, 1) if side.sequences else None,
        "osl": round(generated, 1),
        "validation": (
            f"engine counters ({engine.name} {engine.version})"
            if engine is not None
            else "built-in prediction (mtpquant: target sequences sampled with transformers, drafts by the MTP "
            "chain, the rule's acceptance probabilities)"
        ),
        "engine": f"{engine.name} {engine.version}" if engine is not None else "built-in",
        **_sampling(head),
        "context_buckets": [[b.low, b.high] for b in top.by_context],
        "device": s.device,
        "dtype": s.dtype,
        "activations": s.activations,
        "versions": {"mtpquant": report.mtpquant_version or __version__},
    }
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "measured": True,
        "method": "mtp",
        "num_speculative_tokens": top.k,
        **{k: v for k, v in _row(top, _counts(report, head)).items() if k not in ("k", "steps")},
        "verification_method": "longest_prefix",
        "accept_length_model": "measured_per_k",
        "draft_checkpoint": {
            "checkpoint": side.checkpoint,
            "mtp_precision": dict(side.mtp.precision) if side.mtp.precision is not None else None,
        },
        "target_model": {"checkpoint": side.checkpoint, "family": side.family, "precision": dict(side.precision)},
        "measurement_conditions": conditions,
        "by_k": [_row(r, _counts(report, head)) for r in head.by_k],
        "by_sampling": [
            {"sampling": _sampling(acc), "by_k": [_row(r, _counts(report, acc)) for r in acc.by_k]}
            for acc in (side.acceptance_by_sampling or (head,))
        ],
        "by_context": [_context(b, _counts(report, head)) for b in top.by_context],
        "mtpquant": {"report": "report.json", "report_schema": REPORT_SCHEMA, "verdict": report.verdict.status},
    }


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
        if not data.get("measured") or data.get("mean_accept_length") is None:
            return None
        c = data.get("measurement_conditions") or {}
        how = f"{c.get('validation', '')}, T={c.get('temperature', 0):g}, rule {c.get('rule', 'vllm')}"
        return ProfileHeadline(
            int(data["num_speculative_tokens"]),
            float(data["mean_accept_length"]),
            tuple(None if x is None else float(x) for x in data["conditional_accept_rates"]),
            how,
        )
    except (KeyError, TypeError, ValueError):
        return None
