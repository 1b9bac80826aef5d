"""What the precision search measures with: the quantized target run once, and every candidate MTP built in memory.

``prepare``: the quantized target (dequantized as validate loads it, its activations emulated as the engines run
them) calibrates the BF16 MTP's input scales on its own hidden states over the calibration rows (the inputs the MTP
sees when it drafts for this target), continues two disjoint sets of held-out prompts (the selection's and the
confirmation's) at every sampling setting once and keeps its hidden states, embedding and head; then it is released.
``Candidates``: each precision group quantized once per precision (``mtp.quantize.quantize_mtp``: the bytes the
output would hold) and dequantized, so a configuration's MTP is the source's weights with its groups replaced, built
and measured by ``measure.replay.evaluate_acceptance`` on the captured runs of either set.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from mtpquant.formats.kinds import WRITTEN, quantizes
from mtpquant.measure.drafter import MtpBundle, mtp_bundle
from mtpquant.measure.replay import TargetRun, evaluate_acceptance
from mtpquant.measure.weights import LinearFormat
from mtpquant.mtp.build import reference_mtp
from mtpquant.mtp.quantize import MtpCalibrator, fuse_mtp_experts, per_expert_weights, quantize_mtp
from mtpquant.records.evidence import UnitCounts
from mtpquant.records.sampling import SamplingSettings
from mtpquant.search.space import Assignment, MtpSpace

if TYPE_CHECKING:
    from mtpquant.checkpoint.source import CheckpointSource
    from mtpquant.measure.weights import CheckpointWeights
    from mtpquant.records.acceptance import Acceptance

__all__ = [
    "Candidates",
    "Evaluation",
    "SearchInputs",
    "calibration_rows",
    "prepare",
    "search_prompts",
    "source_form",
]

log = logging.getLogger(__name__)

PROMPT_CHARS = 300  # held-out prompts in pieces this long: many different ones, each filling half a sequence


def search_prompts(n: int) -> list[str]:
    """``n`` held-out prompts, all different (validate's default prompts in pieces of ``PROMPT_CHARS``)."""
    from mtpquant.text.prompts import default_prompts

    return list(dict.fromkeys(default_prompts(n, chars=PROMPT_CHARS)))


@dataclass
class SearchInputs:
    """What the target gave, once: its runs per set of prompts (``selection``, ``confirmation``) and sampling setting,
    the prompt ids of each set (indices into ``search_prompts``), its embedding and head, the MTP's input amax."""

    runs: dict[str, dict[SamplingSettings, TargetRun]]
    prompt_ids: dict[str, tuple[int, ...]]
    embed: Tensor
    head: Tensor
    amax: dict[str, Tensor]
    calibration_rows: int
    calibration_tokens: int

    @property
    def tokens(self) -> int:
        """Tokens over every run."""
        return sum(r.num_tokens for runs in self.runs.values() for r in runs.values())


def prepare(
    target: CheckpointWeights,
    source_mtp: Mapping[str, Tensor],
    mtp_config: Mapping[str, object],
    tokenizer: CheckpointSource,
    calibration: Tensor,
    *,
    settings: Sequence[SamplingSettings],
    num_prompts: int,
    confirm_prompts: int,
    max_len: int,
    activations: str,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int = 16,
    progress: bool = False,
    on_target: Callable[[Any, CheckpointSource, int], None] | None = None,
    max_memory: Mapping[int | str, int] | None = None,
) -> SearchInputs:
    """Run the quantized ``target`` once: the BF16 MTP (``source_mtp``, its family's ``mtp_config``) calibrated on
    its hidden states over the ``calibration`` rows ``[N, L]``, and its continuations of ``num_prompts`` held-out
    prompts (the selection's; 0: none) and of ``confirm_prompts`` others (the confirmation's) (``tokenizer``'s) to
    ``max_len`` tokens at every sampling setting; ``on_target(model, tokenizer, vocab)`` then uses the target too
    before it is released (``--heal``: the healer's training data). ``max_memory`` (accelerate's caps, from the
    memory plan: ``measure.memory.plan_target_memory``) caps where the target is placed; the rest is read from its
    files as it runs."""
    from mtpquant.errors import ConfigError
    from mtpquant.measure.target import capture, load_target
    from mtpquant.text.prompts import plan_sequences, tokenize_prompts

    model = load_target(target, device=device, dtype=dtype, activations=activations, max_memory=max_memory)
    embed, head = model.embed_weight.detach(), model.lm_head_weight.detach()
    calibrator = MtpCalibrator(cast(nn.Module, reference_mtp(mtp_config, dict(source_mtp), dtype=dtype, device=device)))
    with torch.no_grad():
        for batch in calibration.split(max(1, batch_size)):
            last, mtp_input = model.hidden_states(batch)
            hidden = (mtp_input if mtp_input is not None else last)[:, :-1]
            calibrator.observe(hidden, torch.nn.functional.embedding(batch[:, 1:].to(embed.device), embed))
    vocab = int(embed.shape[0])
    prompts = search_prompts(num_prompts + confirm_prompts)
    ids = tokenize_prompts(tokenizer, prompts, vocab)
    if len(ids) != num_prompts + confirm_prompts:  # ids are positions in the list: none may drop out
        raise ConfigError(f"{tokenizer.label}: the held-out text gives {len(ids)} prompts of two tokens or more, not "
                          f"the {num_prompts + confirm_prompts} the search asks (--search-prompts, --confirm-prompts)")
    sets = {"selection": tuple(range(num_prompts)),
            "confirmation": tuple(range(num_prompts, num_prompts + confirm_prompts))}  # fmt: skip
    runs: dict[str, dict[SamplingSettings, TargetRun]] = {}
    for name, which in sets.items():
        plan = plan_sequences([ids[i] for i in which], max_len)
        runs[name] = {
            s: capture(model, plan, label=f"search {name} ({s.label})", progress=progress, batch_size=batch_size,
                       sampling=s)
            for s in settings
        } if plan else {}  # fmt: skip
    if on_target is not None:
        on_target(model, tokenizer, vocab)
    model.release()
    calibrator.release()
    gc.collect()
    rows = int(calibration.shape[0])
    return SearchInputs(runs, sets, embed, head, dict(calibrator.amax), rows, rows * int(calibration.shape[1]))


@dataclass(frozen=True)
class Evaluation:
    """One configuration measured: per sampling setting, the counts per k (``units[s][k - 1]``, one unit per prompt)
    and the report's acceptance record."""

    assignment: Assignment
    units: tuple[tuple[UnitCounts, ...], ...]
    acceptance: tuple[Acceptance, ...]


class Candidates:
    """Every configuration of ``space`` as an MTP in memory, from the source's weights and the calibrated amax: each
    group quantized once per precision, dequantized, and put in the source's place."""

    def __init__(
        self,
        space: MtpSpace,
        source_mtp: Mapping[str, Tensor],
        mtp_config: Mapping[str, object],
        inputs: SearchInputs,
        *,
        dtype: torch.dtype,
        device: torch.device,
        emulate: bool,
    ) -> None:
        self.space = space
        self.source = per_expert_weights(source_mtp)
        self.config = mtp_config
        self.inputs = inputs
        self.dtype = dtype
        self.device = device
        self.emulate = emulate
        self._groups: dict[tuple[str, str], tuple[dict[str, Tensor], dict[str, LinearFormat]]] = {}

    def group(self, key: str, precision: str) -> tuple[dict[str, Tensor], dict[str, LinearFormat]]:
        """Group ``key`` in ``precision``: its dequantized weights and (activations quantized) their formats."""
        if (key, precision) not in self._groups:
            self._groups[(key, precision)] = self._quantized(self.source, key, precision)
        return self._groups[(key, precision)]

    def _quantized(
        self, source: Mapping[str, Tensor], key: str, precision: str
    ) -> tuple[dict[str, Tensor], dict[str, LinearFormat]]:
        """Group ``key`` of the MTP weights ``source`` (per expert) quantized in ``precision`` and dequantized."""
        members = self.space.members[key]
        result = quantize_mtp(
            source,
            self.inputs.amax,
            activations=self.space.activations,
            layout=self.space.family.mtp,
            precision=dict.fromkeys(members, precision),
        )
        t = result.tensors
        weights: dict[str, Tensor] = {}
        formats: dict[str, LinearFormat] = {}
        kind = WRITTEN[precision]
        for m in members:
            weights[m + ".weight"] = kind.dequantize(t.__getitem__, m).to(self.dtype)
            scale = t.get(m + ".input_scale")
            formats[m] = LinearFormat(m, kind, None if scale is None else float(scale.float().max()))
        return weights, formats

    def formats(self, assignment: Assignment) -> dict[str, LinearFormat]:
        """Every quantized Linear of ``assignment`` -> its format and input scale (what ``--heal`` trains with)."""
        out: dict[str, LinearFormat] = {}
        for key, precision in zip(assignment.groups, assignment.precisions):
            if quantizes(precision):
                out.update(self.group(key, precision)[1])
        return out

    def bundle(self, assignment: Assignment, weights: Mapping[str, Tensor] | None = None) -> MtpBundle:
        """The MTP of ``assignment``: the source's weights (or ``weights``, a healed MTP in the source's form:
        ``source_form``), each quantized group's dequantized ones in their place, those groups' activations
        fake-quantized when the search emulates them."""
        source = self.source if weights is None else per_expert_weights(weights)
        tensors = {n: t.to(self.dtype) for n, t in source.items()}
        formats: dict[str, LinearFormat] = {}
        for key, precision in zip(assignment.groups, assignment.precisions):
            if not quantizes(precision):
                continue
            quantized, fmts = self.group(key, precision) if weights is None else self._quantized(source, key, precision)
            tensors.update(quantized)
            formats.update(fmts)
        return mtp_bundle(
            self.config,
            tensors,
            shared=(self.inputs.embed, self.inputs.head),
            dtype=self.dtype,
            device=self.device,
            emulate=formats if self.emulate else None,
        )

    def evaluate(
        self, assignment: Assignment, k: int, phase: str, weights: Mapping[str, Tensor] | None = None
    ) -> Evaluation:
        """``assignment``'s MTP (of the source's weights, or of ``weights``: ``bundle``) measured on every run of the
        ``phase``'s prompts (``selection`` or ``confirmation``) for k = 1..``k``."""
        bundle = self.bundle(assignment, weights)
        units, acceptance = [], []
        for s, run in self.inputs.runs[phase].items():
            result = evaluate_acceptance(bundle, run, k, progress=False, sampling=s, target_head=self.inputs.head)
            units.append(tuple(result.units))
            acceptance.append(result.typed())
        del bundle
        return Evaluation(assignment, tuple(units), tuple(acceptance))


def source_form(weights: Mapping[str, Tensor], source: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Trained MTP ``weights`` (float32, per expert or fused) in the form of the ``source`` MTP: its names (fused
    expert banks fused where it stores them so), its dtypes (the healed weights rounded as convert quantizes the
    source) and shapes."""
    per = per_expert_weights(weights)
    fused = [t for n, t in source.items() if n not in per and t.dim() == 3]
    if fused:
        per = {**per, **fuse_mtp_experts(per, int(fused[0].shape[0]))}
    missing = sorted(set(source) - set(per))
    if missing:
        raise ValueError(f"internal: the trained MTP has no {missing[0]}")
    out = {n: per[n].to(t.dtype).contiguous() for n, t in source.items()}
    odd = [n for n, t in out.items() if t.shape != source[n].shape]
    if odd:
        raise ValueError(f"internal: the trained {odd[0]} is {tuple(out[odd[0]].shape)}, not the source's shape")
    return out


def calibration_rows(tokenizer: Any, data: str, samples: int, seq_len: int, *, chat_template: bool) -> Tensor:
    """``[samples, seq_len]`` calibration tokens for the MTP's input scales: the recipe's calibration text in the
    model's tokenizer, without the held-out documents the search's prompts come from."""
    from mtpquant.text.calibration import build_calibration_data
    from mtpquant.text.prompts import held_out_documents

    held_out = frozenset(name for name, _ in held_out_documents())
    rows = build_calibration_data(tokenizer, data, samples, seq_len, chat_template=chat_template, exclude=held_out)
    return rows.input_ids
