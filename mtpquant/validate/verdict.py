"""validate's verdict: pass, warn or fail, from the acceptance of one checkpoint or of a pair (both paths)."""

from __future__ import annotations

from mtpquant.validate.options import ValidateOptions
from mtpquant.validate.schema import Side, Verdict

__all__ = ["verdict"]


def verdict(opts: ValidateOptions, reference: Side, candidate: Side | None) -> Verdict:
    """pass / warn / fail: a missing or broken MTP fails; an AL drop beyond ``warn_al_drop`` warns."""
    reasons: list[str] = []
    status = "pass"
    pair = candidate is not None
    subject = candidate if candidate is not None else reference
    name = "candidate" if pair else "checkpoint"
    if pair and reference.mtp.error:
        return Verdict("fail", (f"reference: {reference.mtp.error}",))
    if subject.mtp.error or subject.acceptance is None:
        return Verdict("fail", (f"{name}: {subject.mtp.error}",))
    rows = subject.acceptance.by_k
    al = [r.mean_acceptance_length for r in rows]
    first = rows[0]  # k = 1 on the built-in path; the smallest k a server ran on the engine path
    if first.mean_acceptance_length < opts.broken_al:
        status = "fail"
        reasons.append(
            f"{name} MTP is broken: AL {first.mean_acceptance_length:.3f} at k={first.k} (acceptance "
            f"{100 * first.acceptance_rate:.1f} %); engines will draft for nothing and decode slower"
        )
    if pair and reference.acceptance is not None:
        ref_by_k = {r.k: r.mean_acceptance_length for r in reference.acceptance.by_k}
        drops = [(r.k, ref_by_k[r.k], r.mean_acceptance_length) for r in rows if r.k in ref_by_k]
        k, ref_al, cand_al = max(drops, key=lambda d: d[1] - d[2])
        if ref_al - cand_al > opts.warn_al_drop:
            status = "fail" if status == "fail" else "warn"
            reasons.append(
                f"AL drops by {ref_al - cand_al:.3f} at k={k} ({ref_al:.3f} -> {cand_al:.3f}), more than "
                f"{opts.warn_al_drop}"
            )
    if not reasons:
        ks = [r.k for r in rows]
        span = f"k = 1..{len(ks)}" if ks == list(range(1, len(ks) + 1)) else f"k = {', '.join(map(str, ks))}"
        reasons.append(
            f"AL {' / '.join(f'{a:.2f}' for a in al)} for {span}" + ("; within the allowed drop" if pair else "")
        )
    return Verdict(status, tuple(reasons))
