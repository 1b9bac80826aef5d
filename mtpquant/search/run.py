"""The precision search: the smallest MTP whose predicted AL stays within the budget of the BF16 MTP's.

``search_mtp``: the quantized target run once (``measure.prepare``), the BF16 MTP measured, every precision group
alone in every precision (the sensitivity; measured even where the engines load the group only beside others), then
the smallest combinations the sensitivity predicts within the budget confirmed (``decide.next_candidates``); the
smallest measured configuration within the budget at every k and sampling setting is chosen (``decide``). convert
``--mtp auto`` runs it on the main model it just exported, ``tune-mtp`` on an existing quant: the same inputs (the
main model's bytes, the source's MTP, the calibration rows, the prompts) give the same choice. With a healer
(``--heal``, ``search.finalists``) the finalists are healed and measured before the choice, and the chosen one is
written healed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.decide import Judged, finalists, judge, next_candidates, pareto_front
from mtpquant.search.finalists import HealedFinalist, Healer, HealSettings
from mtpquant.search.settings import SearchSettings
from mtpquant.search.space import Assignment, MtpSpace
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from torch import Tensor

    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.measure.weights import CheckpointWeights
    from mtpquant.search.measure import Candidates, Evaluation

__all__ = ["GroupInfo", "SearchOutcome", "SearchResult", "search_mtp", "search_space"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupInfo(Record):
    """One precision group: its key and label, how many Linears, its bytes in each precision searched."""

    key: str
    label: str
    linears: int
    bytes: Mapping[str, int]


@dataclass(frozen=True)
class SearchResult(Record):
    """What the search measured and chose (``mtp_search/report.json``)."""

    family: str
    target: str  # the quantized model whose hidden states the MTP drafted on (public name)
    groups: tuple[GroupInfo, ...]
    settings: SearchSettings
    sampling: tuple[SamplingSettings, ...]
    prompts: int
    calibration_rows: int
    bf16_bytes: int
    evaluated: tuple[Judged, ...]
    chosen: int  # index into ``evaluated``
    front: tuple[int, ...]  # indices of the Pareto front (bytes vs worst AL loss)
    reason: str
    not_taken: str | None = None  # the smallest configuration left out for want of evidence, and what would settle it
    configurations: int = 0  # how many configurations the engines load
    seconds: Mapping[str, float] = field(default_factory=dict)
    heal: HealSettings | None = None  # --heal: how each finalist was healed before the choice
    healed: tuple[HealedFinalist, ...] = ()  # --heal: the finalists, their rows before and after heal
    fixed: tuple[str, ...] = ()  # the groups the recipe's quantization.exclude keeps BF16 (never searched)

    @property
    def choice(self) -> Judged:
        """The chosen configuration."""
        return self.evaluated[self.chosen]


@dataclass(frozen=True)
class SearchOutcome:
    """The result, and what writing the chosen MTP needs: the calibrated input amax, its measurement, its weights
    (``--heal``: the healed MTP in the source's form; None: the source's)."""

    result: SearchResult
    amax: dict[str, Tensor]
    chosen: Evaluation
    space: MtpSpace
    weights: dict[str, Tensor] | None = None


def search_space(
    ckpt: Checkpoint, settings: SearchSettings, *, main_algo: str, activations: bool, exclude: Sequence[str] = ()
) -> MtpSpace:
    """The configurations of ``ckpt``'s MTP (SRC's, headers only) the chosen engines load; a group holding a Linear
    the recipe's ``quantization.exclude`` matches stays BF16 (as ``--mtp quantize`` keeps it)."""
    return MtpSpace(
        ckpt.spec.family,
        {e.name: e for e in ckpt.mtp_tensors()},
        main_algo=main_algo,
        activations=activations,
        engines=settings.engines,
        precisions=settings.precisions,
        exclude=exclude,
    )


def search_mtp(
    target: CheckpointWeights,
    source: Checkpoint,
    tokenizer: CheckpointSource,
    calibration: Tensor,
    settings: SearchSettings,
    *,
    main_algo: str,
    activations: bool,
    target_name: str,
    device: Any,
    dtype: Any,
    progress: bool = False,
    healer: Healer | None = None,
    exclude: Sequence[str] = (),
) -> SearchOutcome:
    """Choose the MTP's precision per group for ``target`` (the quantized main model) from ``source``'s BF16 MTP;
    with a ``healer`` (``--heal``), among the finalists healed (``search.finalists``)."""
    from mtpquant.search.measure import Candidates, prepare

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    space = search_space(source, settings, main_algo=main_algo, activations=activations, exclude=exclude)
    source_mtp = {e.name: source.read_tensor(e.name) for e in source.mtp_tensors()}
    sampling = settings.sampling
    inputs = prepare(
        target, source_mtp, source.config, tokenizer, calibration, settings=sampling,
        num_prompts=settings.num_prompts, max_len=settings.max_len, activations=settings.activations,
        device=device, dtype=dtype, batch_size=settings.batch_size, progress=progress,
        on_target=None if healer is None else healer.collect,
    )  # fmt: skip
    seconds["target"] = time.perf_counter() - t0
    candidates = Candidates(space, source_mtp, source.config, inputs, dtype=dtype, device=device,
                            emulate=settings.activations == "emulate")
    judged: list[Judged] = []
    evaluations: dict[Assignment, Evaluation] = {}
    base_units: tuple[Any, ...] = ()
    healed_evaluations: dict[Assignment, Evaluation] = {}

    def measure(a: Assignment, role: Any, weights: dict[str, Tensor] | None = None) -> Judged:
        nonlocal base_units
        ev = candidates.evaluate(a, settings.k, weights)
        if weights is None:
            evaluations[a] = ev
        if role == "baseline":
            base_units = ev.units
        j = judge(a, base_units, ev.units, sampling, space=space, role=role, budget=settings.budget,
                  level=settings.confidence, seed=settings.seed)
        judged.append(j)
        log.info("search: %s%s: %s, %s", a.label, " (healed)" if weights is not None else "", format_bytes(j.nbytes),
                 j.verdict)
        if weights is not None:
            healed_evaluations[a] = ev
        return j

    t1 = time.perf_counter()
    measure(space.bf16, "baseline")
    singles: dict[tuple[str, str], Judged] = {}
    for key in space.group_keys:  # every group alone, loadable or not: what quantizing it costs
        for p in space.precisions:
            if p != "bf16" and space.refusal(key, p) is None:
                singles[(key, p)] = measure(space.bf16.with_group(key, p), "sensitivity")
    seconds["sensitivity"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    best = min((j for j in judged if j.accepted), key=lambda j: j.nbytes)
    for _ in range(settings.max_confirm):
        todo = [a for a in next_candidates(space, singles, settings.budget, best.nbytes) if a not in evaluations]
        if not todo:
            break
        j = measure(todo[0], "confirm")
        if j.accepted and j.nbytes < best.nbytes:
            best = j
            break
    seconds["confirm"] = time.perf_counter() - t2
    healed: list[HealedFinalist] = []
    healed_weights: dict[Assignment, dict[str, Tensor]] = {}
    if healer is not None:
        t3 = time.perf_counter()
        best, healed, healed_weights = _heal_finalists(
            healer, finalists(judged, best, settings.max_confirm + 1), judged, measure, candidates, source_mtp,
            source.config, device=device,
        )  # fmt: skip
        seconds["heal"] = time.perf_counter() - t3
    chosen = judged.index(best)
    reason, not_taken = _why(judged, best, settings, space, healed=healer is not None)
    result = SearchResult(
        family=space.family.key,
        target=target_name,
        groups=tuple(
            GroupInfo(g.key, g.label, len(space.members[g.key]),
                      {p: space.group_bytes(g.key, p) for p in space.precisions})
            for g in space.groups
        ),
        settings=settings,
        sampling=sampling,
        prompts=inputs.sequences,
        calibration_rows=inputs.calibration_rows,
        bf16_bytes=space.nbytes(space.bf16),
        evaluated=tuple(judged),
        chosen=chosen,
        front=tuple(pareto_front(judged)),
        reason=reason,
        not_taken=not_taken,
        configurations=len(space.configurations()),
        seconds={**seconds, "total": time.perf_counter() - t0},
        heal=None if healer is None else healer.settings,
        healed=tuple(healed),
        fixed=space.fixed_groups(),
    )
    if best.role == "healed":
        weights = healed_weights[best.assignment]
        return SearchOutcome(result, inputs.amax, healed_evaluations[best.assignment], space, weights)
    return SearchOutcome(result, inputs.amax, evaluations[best.assignment], space)


def _heal_finalists(
    healer: Healer,
    chosen: list[Assignment],
    judged: list[Judged],
    measure: Callable[..., Judged],
    candidates: Candidates,
    source_mtp: Mapping[str, Tensor],
    config: Mapping[str, object],
    *,
    device: Any,
) -> tuple[Judged, list[HealedFinalist], dict[Assignment, dict[str, Tensor]]]:
    """Heal each finalist from the BF16 MTP (its quantized Linears fake-quantized in their formats, with the input
    scales the output will carry) and measure it; the choice: the smallest healed finalist within the budget, else
    the BF16 MTP (judged[0]). Returns it, the finalists, their healed weights in the source's form."""
    import torch

    from mtpquant.search.measure import source_form

    shared = (candidates.inputs.embed, candidates.inputs.head)
    out: list[HealedFinalist] = []
    weights: dict[Assignment, dict[str, Tensor]] = {}
    for a in chosen:
        formats = candidates.formats(a)
        precision = {m: f.kind for m, f in formats.items()}
        scales = {m: f.input_scale for m, f in formats.items() if f.input_scale is not None}
        master = {n: t.to(torch.float32, copy=True) for n, t in source_mtp.items()}  # the layer adopts (trains) them
        trained, training = healer.heal(config, master, precision, scales, shared=shared, device=device)
        weights[a] = source_form(trained, source_mtp)
        before = next(i for i, j in enumerate(judged) if j.assignment == a and j.role != "healed")
        measure(a, "healed", weights[a])
        out.append(HealedFinalist(a, before, len(judged) - 1, training))
    best = min((j for j in judged if j.role in ("baseline", "healed") and j.accepted), key=lambda j: j.nbytes)
    return best, out, {a: w for a, w in weights.items() if a == best.assignment}


def _why(
    judged: list[Judged], best: Judged, settings: SearchSettings, space: MtpSpace, *, healed: bool = False
) -> tuple[str, str | None]:
    """Why ``best`` was chosen, and the smallest configuration left out for want of evidence (with the prompts that
    would settle it); ``healed``: among the healed finalists (``--heal``)."""
    budget = f"{settings.budget:g} AL"
    where = f"k = 1..{settings.k}" + ("" if len(settings.sampling) == 1 else ", every sampling setting")
    bf16 = space.nbytes(space.bf16)
    if best.role == "baseline":
        why = (
            f"no quantized configuration kept its AL within {budget} of the BF16 MTP's at {where} beyond noise "
            "(the whole 95 % interval of the change above -budget): the MTP stays BF16"
        )
        if settings.budget == 0:
            why = "a budget of 0 lets the MTP lose nothing, which no sample proves of a quantized MTP: it stays BF16"
    else:
        why = (
            f"the smallest measured configuration whose AL stays within {budget} of the BF16 MTP's at {where} beyond "
            f"noise: {format_bytes(best.nbytes)}, {best.nbytes / bf16:.2f}x the BF16 MTP's {format_bytes(bf16)}"
        )
    if healed:
        why = why.replace("no quantized configuration", "no healed finalist").replace(
            "the smallest measured configuration", "the smallest healed finalist")
    smaller = sorted((j for j in judged if j.nbytes < best.nbytes and j.loads and j.verdict == "inconclusive"
                      and (j.role == "healed" or not healed)), key=lambda j: j.nbytes)  # fmt: skip
    not_taken = None
    if smaller:
        j = smaller[0]
        settle = (f"about {j.units_to_settle} prompts would settle it" if j.units_to_settle is not None
                  else "no practical number of prompts would settle it")
        not_taken = f"{j.assignment.label} ({format_bytes(j.nbytes)}): inconclusive on {_prompts(judged)} prompts; "
        not_taken += settle
    return why, not_taken


def _prompts(judged: list[Judged]) -> int:
    first = judged[0].by_sampling[0].by_k[0].al
    return first.units
