"""validate's verdict, decided only where the evidence supports it (both paths).

Outcomes, checked in this order (the first that applies decides; exit codes in ``mtpquant.errors``):

1. ``fail`` (exit 18): the MTP (the reference's in pair mode, or the subject's) is missing, incomplete or
   misshapen.
2. ``fail`` + ``broken`` (exit 25): the candidate itself is broken, whatever its MTP does: non-finite logits
   (its target or its MTP), main-model top-1 agreement with the reference below ``min_main_agreement`` (0.5),
   or AL *above* the reference by more than the threshold beyond noise (the interval of the target's part of
   the change, or of the whole change where it cannot be split, lies above ``+warn_al_drop``): a quantized
   target does not become more predictable unless it collapsed (e.g. to one constant token).
3. ``fail`` (exit 18): the MTP drafts for nothing: AL at the smallest k below ``broken_al`` (1.02, about 0 %
   acceptance) with its whole interval below it.
4. ``warn`` (exit 17): at some k the AL drop exceeds ``warn_al_drop`` (0.1) beyond noise: the whole interval of
   the change lies below ``-warn_al_drop``.
5. ``inconclusive`` (exit 23): at some k the interval straddles ``-warn_al_drop`` (or the sample has fewer than
   ``evidence.MIN_UNITS`` prompts): the sample is too small to tell; the verdict says about how many prompts
   would settle it.
6. ``pass`` (exit 0): at every k the interval lies at or above ``-warn_al_drop``.

Intervals are ``evidence.Bootstrap`` percentile intervals over prompts, paired between the sides (the same
resamples), at ``opts.confidence``. Every reason names the threshold, and every change is split into the
MTP's part and the target's part where the built-in path measured both (the candidate MTP on the reference
target's sequences gives the MTP's part; the rest is the target's).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtpquant.records.acceptance import Acceptance, AcceptanceRow
from mtpquant.records.evidence import Interval, UnitCounts, split_change, units_to_decide
from mtpquant.records.validation import ChangeEvidence, Comparison, Side, Verdict
from mtpquant.validate.options import ValidateOptions

__all__ = ["change_evidence", "verdict"]


def _units(acc: Acceptance | None) -> dict[int, UnitCounts]:
    return {r.k: r.units for r in acc.by_k if r.units is not None} if acc is not None else {}


def change_evidence(
    reference: Acceptance,
    candidate: Acceptance,
    cross: Acceptance | None,
    threshold: float,
    *,
    level: float,
    label: str = "",
) -> tuple[ChangeEvidence, ...]:
    """The AL change per k (candidate minus reference) with its paired interval, split into the MTP's part (``cross``:
    the candidate MTP on the reference target) and the target's part, each decided against ``-threshold``."""
    ref_u, cand_u, cross_u = _units(reference), _units(candidate), _units(cross)
    ref_al = {r.k: r.mean_acceptance_length for r in reference.by_k}
    out = []
    for row in candidate.by_k:
        k = row.k
        if k not in ref_al:
            continue
        if k in ref_u and k in cand_u and ref_u[k].units == cand_u[k].units:
            change, mtp, target, side = split_change(ref_u[k], cand_u[k], cross_u.get(k), -threshold, level=level)
        else:  # no per-prompt counts (an older report): a point estimate, which decides nothing
            delta = row.mean_acceptance_length - ref_al[k]
            change, mtp, target = Interval(delta, float("nan"), float("nan"), level, 0), None, None
            side = "inconclusive"
        decision = {"above": "within", "below": "drop"}.get(side, "inconclusive")
        out.append(ChangeEvidence(k, change, mtp, target, decision, label))
    return tuple(out)


def _split(e: ChangeEvidence) -> str:
    if e.mtp is None or e.target is None:
        return "MTP and target parts not separable here"
    return f"MTP {e.mtp.text(signed=True)}, target {e.target.text(signed=True)}"


def _at(e: ChangeEvidence) -> str:
    return f"k={e.k}" + (f" ({e.label})" if e.label else "")


def _non_finite(name: str, side: Side, comparison: Comparison | None) -> list[str]:
    reasons = []
    main = comparison.main if comparison is not None else None
    mtp = comparison.mtp if comparison is not None else None
    if side.non_finite_target:
        reasons.append(f"{name}'s main model gives non-finite logits at {side.non_finite_target} positions")
    elif main is not None and main.non_finite:
        reasons.append(f"{name}'s main model gives non-finite logits at {main.non_finite} positions")
    if side.non_finite_mtp:
        reasons.append(f"{name}'s MTP gives non-finite outputs at {side.non_finite_mtp} rows")
    elif mtp is not None and mtp.non_finite:
        reasons.append(f"{name}'s MTP gives non-finite logits at {mtp.non_finite} positions")
    return reasons


def verdict(
    opts: ValidateOptions,
    reference: Side,
    candidate: Side | None,
    comparison: Comparison | None = None,
    *,
    extra: Sequence[tuple[str, Acceptance, Acceptance, Acceptance | None]] = (),
) -> Verdict:
    """The verdict on ``candidate`` against ``reference`` (pair) or on ``reference`` alone (see the module doc).

    ``extra``: further measurements of the same pair (label, reference, candidate, cross), e.g. other sampling
    settings; each is decided like the headline one and the worst outcome wins.
    """
    tau = opts.warn_al_drop
    level = opts.confidence
    thresholds = {
        "warn_al_drop": tau,
        "broken_al": opts.broken_al,
        "min_main_agreement": opts.min_main_agreement,
        "confidence": level,
    }
    pair = candidate is not None
    subject = candidate if candidate is not None else reference
    name = "candidate" if pair else "checkpoint"

    def done(status: str, reasons: Sequence[str], **kw: object) -> Verdict:
        return Verdict(status, tuple(reasons), thresholds=thresholds, **kw)  # type: ignore[arg-type]

    # 1. a missing or unusable MTP
    if pair and reference.mtp.error:
        return done("fail", [f"reference: {reference.mtp.error}"])
    if subject.mtp.error or subject.acceptance is None:
        return done("fail", [f"{name}: {subject.mtp.error}"])

    # 2. a broken candidate (or checkpoint): non-finite numbers, a main model that no longer agrees
    broken = _non_finite(name, subject, comparison if pair else None)
    main = comparison.main if comparison is not None else None
    if pair and main is not None and main.top1_agreement < opts.min_main_agreement:
        broken.append(
            f"{name}'s main model agrees with the reference's top-1 token at {100 * main.top1_agreement:.1f} % of "
            f"{main.positions} positions, below the floor of {100 * opts.min_main_agreement:.0f} %"
        )

    # evidence: the AL change per k (pair), for the headline measurement and any others
    evidence: list[ChangeEvidence] = []
    if pair and reference.acceptance is not None:
        cross = comparison.candidate_mtp_on_reference_target if comparison is not None else None
        evidence += change_evidence(reference.acceptance, subject.acceptance, cross, tau, level=level)
    for label, ref_acc, cand_acc, cross_acc in extra:
        evidence += change_evidence(ref_acc, cand_acc, cross_acc, tau, level=level, label=label)
    for e in evidence:
        rise = e.target if e.target is not None else e.change
        if rise.defined and rise.low > tau:
            part = "its target's part of the change" if e.target is not None else "the change"
            broken.append(
                f"AL rises by {rise.text(signed=True)} at {_at(e)} ({part}), more than {tau:g} beyond noise: a "
                "quantized target does not become more predictable unless it collapsed"
            )
    if broken:
        return done("fail", [f"{name} is broken: " + "; ".join(broken)], broken=True, evidence=tuple(evidence))

    # 3. an MTP that drafts for nothing
    first = subject.acceptance.by_k[0]
    first_al = first.al_interval or Interval(first.mean_acceptance_length, first.mean_acceptance_length,
                                              first.mean_acceptance_length, level, 0)  # fmt: skip
    if first_al.high < opts.broken_al or (not first_al.defined and first.mean_acceptance_length < opts.broken_al):
        return done(
            "fail",
            [
                f"{name} MTP is broken: AL {first_al.text()} at k={first.k} (acceptance "
                f"{100 * first.acceptance_rate:.1f} %), below {opts.broken_al:g}; engines will draft for nothing and "
                "decode slower"
            ],
            evidence=tuple(evidence),
        )

    if not pair:
        rows = subject.acceptance.by_k
        return done("pass", [f"AL {' / '.join(f'{r.mean_acceptance_length:.2f}' for r in rows)} for {_span(rows)}"])

    # 4-6. the AL change per k against the allowed drop
    drops = [e for e in evidence if e.decision == "drop"]
    unsure = [e for e in evidence if e.decision == "inconclusive"]
    rule = f"allowed drop {tau:g} AL, {100 * level:.0f} % intervals over {_units_text(evidence)}"
    if drops:
        worst = min(drops, key=lambda e: e.change.estimate)
        return done(
            "warn",
            [
                f"AL drops by {-worst.change.estimate:.3f} at {_at(worst)} (change {worst.change.text(signed=True)}; "
                f"{_split(worst)}), beyond the {rule}",
                *(f"also at {_at(e)}: {e.change.text(signed=True)} ({_split(e)})" for e in drops if e is not worst),
            ],
            evidence=tuple(evidence),
        )
    if unsure:
        needed = units_to_decide([e.change for e in unsure], -tau)
        settle = (
            f"about {needed} prompts would settle it"
            if needed is not None
            else "no practical number of prompts settles it (the change sits too close to the threshold)"
        )
        worst = min(unsure, key=lambda e: e.change.low if e.change.defined else float("-inf"))
        return done(
            "inconclusive",
            [
                f"sample too small: the AL change at {_at(worst)} is {worst.change.text(signed=True)} "
                f"({_split(worst)}), which cannot be told apart from the {rule}; {settle}",
            ],
            evidence=tuple(evidence),
            prompts_needed=needed,
        )
    rows = subject.acceptance.by_k
    return done(
        "pass",
        [
            f"AL {' / '.join(f'{r.mean_acceptance_length:.2f}' for r in rows)} for {_span(rows)}; within the {rule}: "
            + ", ".join(f"{_at(e)} {e.change.text(signed=True)} ({_split(e)})" for e in evidence)
        ],
        evidence=tuple(evidence),
    )


def _units_text(evidence: Sequence[ChangeEvidence]) -> str:
    n = max((e.change.units for e in evidence), default=0)
    return f"{n} prompts" if n else "no per-prompt counts"


def _span(rows: Sequence[AcceptanceRow]) -> str:
    ks = [r.k for r in rows]
    if len(ks) > 1 and ks == list(range(1, len(ks) + 1)):
        return f"k = 1..{len(ks)}"
    return f"k = {', '.join(map(str, ks))}"
