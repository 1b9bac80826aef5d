"""The precision search: the smallest MTP whose AL is confirmed within the budget of the BF16 MTP's.

``search_mtp``: the quantized target run once (``measure.prepare``: the calibration, and its continuations of two
disjoint sets of held-out prompts), then ``decide.search`` measures on them: on the selection prompts the BF16 MTP,
every precision group alone in every precision (the sensitivity; measured even where the engines load the group only
beside others) and the smallest combinations the sensitivity predicts within the budget; the smallest configurations
within the budget there are the finalists, confirmed with the BF16 MTP on the other prompts (Holm's procedure over
the finalists); the smallest confirmed one is chosen, the BF16 MTP when none is (and always at a budget of 0). convert
``--mtp auto`` runs it on the main model it just exported, ``tune-mtp`` on an existing quant: the same inputs (the
main model's bytes, the source's MTP, the calibration rows, the prompts) give the same choice. With a healer
(``--heal``, ``search.finalists``) the finalists are healed before they are confirmed, and the chosen one is written
healed.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpquant.records.record import Record
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.decide import Confirmation, Judged, Phase, Role, Searched, pareto_front, search
from mtpquant.search.finalists import HealedFinalist, Healer, HealSettings, Training
from mtpquant.search.settings import SearchSettings
from mtpquant.search.space import Assignment, MtpSpace
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from pathlib import Path

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
    prompts: int  # held-out prompts of the confirmation (the chosen MTP's published numbers)
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
    selection_prompts: tuple[int, ...] = ()  # ids (search_prompts positions) of the prompts the selection measured
    confirmation_prompts: tuple[int, ...] = ()  # the disjoint held-out ids the finalists were confirmed on
    confirmation: Confirmation | None = None  # the family-wise method, its level, each finalist's p-value and verdict

    @property
    def choice(self) -> Judged:
        """The chosen configuration (its confirmation row: the numbers published)."""
        return self.evaluated[self.chosen]

    @property
    def baseline(self) -> Judged:
        """The BF16 MTP on the confirmation prompts (what the chosen one is compared with; a report written before
        #44 has one set of prompts: its first row)."""
        return next((j for j in self.evaluated if j.role == "baseline" and j.phase == "confirmation"),
                    self.evaluated[0])  # fmt: skip


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
    scratch: Path | None = None,
    max_memory: Mapping[int | str, int] | None = None,
) -> SearchOutcome:
    """Choose the MTP's precision per group for ``target`` (the quantized main model) from ``source``'s BF16 MTP
    (``decide.search``: selected on one set of held-out prompts, confirmed on another); with a ``healer``
    (``--heal``), the finalists healed before they are confirmed (``search.finalists``), its training data under
    ``scratch`` (a directory inside OUT's partial directory, removed when the search ends); ``max_memory``: the
    target's placement caps from the memory plan (accelerate's; None: all on ``device``)."""
    if healer is not None and scratch is None:
        raise ValueError("internal: a search that heals needs a scratch directory inside OUT's partial directory")
    try:
        return _search_mtp(target, source, tokenizer, calibration, settings, main_algo=main_algo,
                           activations=activations, target_name=target_name, device=device, dtype=dtype,
                           progress=progress, healer=healer, exclude=exclude, scratch=scratch,
                           max_memory=max_memory)  # fmt: skip
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _search_mtp(
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
    progress: bool,
    healer: Healer | None,
    exclude: Sequence[str],
    scratch: Path | None,
    max_memory: Mapping[int | str, int] | None,
) -> SearchOutcome:
    from mtpquant.search.measure import Candidates, prepare

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    space = search_space(source, settings, main_algo=main_algo, activations=activations, exclude=exclude)
    source_mtp = {e.name: source.read_tensor(e.name) for e in source.mtp_tensors()}
    sampling = settings.sampling
    zero = settings.budget == 0  # the BF16 MTP: nothing selected, nothing healed

    def collect(model: Any, tok: CheckpointSource, vocab: int) -> None:
        assert healer is not None and scratch is not None
        healer.collect(model, tok, vocab, scratch / "heal-data")
    inputs = prepare(
        target, source_mtp, source.config, tokenizer, calibration, settings=sampling,
        num_prompts=0 if zero else settings.num_prompts, confirm_prompts=settings.confirm_prompts,
        max_len=settings.max_len, activations=settings.activations, device=device, dtype=dtype,
        batch_size=settings.batch_size, progress=progress, on_target=None if healer is None or zero else collect,
        max_memory=max_memory,
    )  # fmt: skip
    seconds["target"] = time.perf_counter() - t0
    candidates = Candidates(space, source_mtp, source.config, inputs, dtype=dtype, device=device,
                            emulate=settings.activations == "emulate")
    evaluations: dict[tuple[Assignment, str, bool], Evaluation] = {}
    healed_weights: dict[Assignment, dict[str, Tensor]] = {}
    trainings: dict[Assignment, Training] = {}
    marks = {"start": time.perf_counter()}

    def count(a: Assignment, phase: Phase, role: Role) -> Any:
        if phase == "confirmation" and "selection" not in marks:
            marks["selection"] = time.perf_counter()
        healed = role == "healed"
        ev = candidates.evaluate(a, settings.k, phase, healed_weights[a] if healed else None)
        evaluations[(a, phase, healed)] = ev
        return ev.units

    def heal(finals: list[Assignment]) -> None:
        assert healer is not None
        t = time.perf_counter()
        for a in finals:
            healed_weights[a], trainings[a] = _heal(healer, a, candidates, source_mtp, source.config, device=device)
        seconds["heal"] = time.perf_counter() - t

    found = search(space, settings, count, heal=None if healer is None else heal)
    end = time.perf_counter()
    seconds["selection"] = marks.get("selection", end) - marks["start"]
    seconds["confirmation"] = end - marks.get("selection", end) - seconds.get("heal", 0.0)
    judged = list(found.judged)
    best = judged[found.chosen]
    healed = [
        HealedFinalist(c.assignment, _selection_row(judged, c.assignment), c.row, trainings[c.assignment])
        for c in found.confirmation.finalists if c.assignment in trainings
    ]  # fmt: skip
    reason, not_taken = _why(judged, found, settings, space, healed=healer is not None)
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
        prompts=len(inputs.prompt_ids["confirmation"]),
        calibration_rows=inputs.calibration_rows,
        bf16_bytes=space.nbytes(space.bf16),
        evaluated=tuple(judged),
        chosen=found.chosen,
        front=tuple(pareto_front(judged)),
        reason=reason,
        not_taken=not_taken,
        configurations=len(space.configurations()),
        seconds={**seconds, "total": time.perf_counter() - t0},
        heal=None if healer is None else healer.settings,
        healed=tuple(healed),
        fixed=space.fixed_groups(),
        selection_prompts=() if zero else inputs.prompt_ids["selection"],
        confirmation_prompts=inputs.prompt_ids["confirmation"],
        confirmation=found.confirmation,
    )
    chosen = evaluations[(best.assignment, "confirmation", best.role == "healed")]
    weights = healed_weights[best.assignment] if best.role == "healed" else None
    return SearchOutcome(result, inputs.amax, chosen, space, weights)


def _selection_row(judged: list[Judged], a: Assignment) -> int:
    return next(i for i, j in enumerate(judged) if j.assignment == a and j.phase == "selection")


def _heal(
    healer: Healer,
    a: Assignment,
    candidates: Candidates,
    source_mtp: Mapping[str, Tensor],
    config: Mapping[str, object],
    *,
    device: Any,
) -> tuple[dict[str, Tensor], Training]:
    """One finalist healed from the BF16 MTP (its quantized Linears fake-quantized in their formats, with the input
    scales the output will carry): its weights in the source's form and how its training went."""
    import torch

    from mtpquant.search.measure import source_form

    shared = (candidates.inputs.embed, candidates.inputs.head)
    formats = candidates.formats(a)
    kinds = {m: f.kind for m, f in formats.items()}
    scales = {m: f.input_scale for m, f in formats.items() if f.input_scale is not None}
    master = {n: t.to(torch.float32, copy=True) for n, t in source_mtp.items()}  # the layer adopts (trains) them
    trained, training = healer.heal(config, master, kinds, scales, shared=shared, device=device)
    return source_form(trained, source_mtp), training


def _why(
    judged: list[Judged], found: Searched, settings: SearchSettings, space: MtpSpace, *, healed: bool = False
) -> tuple[str, str | None]:
    """Why the choice was made, and the smallest finalist left out for want of evidence (with the prompts that would
    settle it); ``healed``: the finalists were healed (``--heal``)."""
    best = judged[found.chosen]
    c = found.confirmation
    budget = f"{settings.budget:g} AL"
    where = f"k = 1..{settings.k}" + ("" if len(settings.sampling) == 1 else ", every sampling setting")
    bf16 = space.nbytes(space.bf16)
    held_out = f"{settings.confirm_prompts} held-out prompts the selection never saw"
    holm = (f"{c.method}'s procedure over {len(c.finalists)} finalist{'s' if len(c.finalists) != 1 else ''}, "
            f"family-wise error {c.alpha:g}")  # fmt: skip
    what = "healed finalist" if healed else "finalist"
    if settings.budget == 0:
        return "a budget of 0 is the BF16 MTP, byte for byte: no quantized configuration was measured", None
    if best.role == "baseline" and not c.finalists:
        why = (f"no quantized configuration kept its AL within {budget} of the BF16 MTP's at {where} beyond noise on "
               "the selection prompts: no finalist, the MTP stays BF16")  # fmt: skip
    elif best.role == "baseline":
        why = (f"no {what} was confirmed within {budget} of the BF16 MTP's AL at {where} on {held_out} ({holm}): "
               "the MTP stays BF16")  # fmt: skip
    else:
        level = next(x.level for x in c.finalists if x.row == found.chosen)
        why = (f"the smallest {what} confirmed within {budget} of the BF16 MTP's AL at {where} on {held_out} ({holm}; "
               f"its interval at the adjusted level {100 * (1 - level):.2f} %): {format_bytes(best.nbytes)}, "
               f"{best.nbytes / bf16:.2f}x the BF16 MTP's {format_bytes(bf16)}")  # fmt: skip
    left = sorted((judged[x.row] for x in c.finalists if not x.accepted and judged[x.row].nbytes < best.nbytes
                   and judged[x.row].verdict != "beyond"), key=lambda j: j.nbytes)  # fmt: skip
    not_taken = None
    if left:
        j = left[0]
        settle = (f"about {j.units_to_settle} prompts would settle it" if j.units_to_settle is not None
                  else "more confirmation prompts may settle it")  # fmt: skip
        not_taken = f"{j.assignment.label} ({format_bytes(j.nbytes)}): not confirmed on {settings.confirm_prompts} "
        not_taken += f"held-out prompts; {settle}"
    return why, not_taken
