"""The precision search: the smallest MTP whose predicted AL stays within the budget of the BF16 MTP's.

``search_mtp``: the quantized target run once (``measure.prepare``), the BF16 MTP measured, every precision group
alone in every precision (the sensitivity; measured even where the engines load the group only beside others), then
the smallest combinations the sensitivity predicts within the budget confirmed (``decide.next_candidates``); the
smallest measured configuration within the budget at every k and sampling setting is chosen (``decide``). convert
``--mtp auto`` runs it on the main model it just exported, ``tune-mtp`` on an existing quant: the same inputs (the
main model's bytes, the source's MTP, the calibration rows, the prompts) give the same choice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.decide import Judged, judge, next_candidates, pareto_front
from mtpquant.search.settings import SearchSettings
from mtpquant.search.space import Assignment, MtpSpace
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from torch import Tensor

    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.measure.weights import CheckpointWeights
    from mtpquant.search.measure import Evaluation

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

    @property
    def choice(self) -> Judged:
        """The chosen configuration."""
        return self.evaluated[self.chosen]


@dataclass(frozen=True)
class SearchOutcome:
    """The result, and what writing the chosen MTP needs: the calibrated input amax, its measurement."""

    result: SearchResult
    amax: dict[str, Tensor]
    chosen: Evaluation
    space: MtpSpace


def search_space(ckpt: Checkpoint, settings: SearchSettings, *, main_algo: str, activations: bool) -> MtpSpace:
    """The configurations of ``ckpt``'s MTP (SRC's, headers only) the chosen engines load."""
    return MtpSpace(
        ckpt.spec.family,
        {e.name: e for e in ckpt.mtp_tensors()},
        main_algo=main_algo,
        activations=activations,
        engines=settings.engines,
        precisions=settings.precisions,
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
) -> SearchOutcome:
    """Choose the MTP's precision per group for ``target`` (the quantized main model) from ``source``'s BF16 MTP."""
    from mtpquant.search.measure import Candidates, prepare

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    space = search_space(source, settings, main_algo=main_algo, activations=activations)
    source_mtp = {e.name: source.read_tensor(e.name) for e in source.mtp_tensors()}
    sampling = settings.sampling
    inputs = prepare(
        target, source_mtp, source.config, tokenizer, calibration, settings=sampling,
        num_prompts=settings.num_prompts, max_len=settings.max_len, activations=settings.activations,
        device=device, dtype=dtype, batch_size=settings.batch_size, progress=progress,
    )  # fmt: skip
    seconds["target"] = time.perf_counter() - t0
    candidates = Candidates(space, source_mtp, source.config, inputs, dtype=dtype, device=device,
                            emulate=settings.activations == "emulate")
    judged: list[Judged] = []
    evaluations: dict[Assignment, Evaluation] = {}
    base_units: tuple[Any, ...] = ()

    def measure(a: Assignment, role: Any) -> Judged:
        nonlocal base_units
        ev = candidates.evaluate(a, settings.k)
        evaluations[a] = ev
        if role == "baseline":
            base_units = ev.units
        j = judge(a, base_units, ev.units, sampling, space=space, role=role, budget=settings.budget,
                  level=settings.confidence, seed=settings.seed)
        judged.append(j)
        log.info("search: %s: %s, %s", a.label, format_bytes(j.nbytes), j.verdict)
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
    chosen = judged.index(best)
    reason, not_taken = _why(judged, best, settings, space)
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
    )
    return SearchOutcome(result, inputs.amax, evaluations[best.assignment], space)


def _why(judged: list[Judged], best: Judged, settings: SearchSettings, space: MtpSpace) -> tuple[str, str | None]:
    """Why ``best`` was chosen, and the smallest configuration left out for want of evidence (with the prompts that
    would settle it)."""
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
    smaller = sorted((j for j in judged if j.nbytes < best.nbytes and j.loads and j.verdict == "inconclusive"),
                     key=lambda j: j.nbytes)
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
