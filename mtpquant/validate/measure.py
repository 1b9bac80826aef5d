"""Acceptance as a running engine measures it: completions of the built-in path's prompts, then the engine's
own speculative-decoding counts turned into the report's ``AcceptanceStats``, per group of requests too.

The same prompts as the built-in path (token ids, ``ignore_eos``, the same lengths, the same sampling settings,
prompt i with seed ``seed + i``) are sent in consecutive groups of at most ``concurrency`` requests, the requests
of a group in flight together. Each engine counts in its own way (``mtpquant.engine``): vLLM's server-wide
counters read before and after each group (other traffic meanwhile is counted in, and reported), SGLang's
per-request counters summed (exactly these requests), TensorRT-LLM's cumulative counters read around the run
(AL and the acceptance rate only: it counts nothing per draft position). Either way: AL = 1 + accepted / verify
steps, acceptance rate = accepted / drafted tokens, and per draft position i, accepted_i / verify steps (every step
drafts all k). Each group is a sampling unit of the confidence intervals (``evidence.UnitCounts``; one prompt per
unit at ``concurrency`` 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtpquant.engine.server import Completion, DraftCounts, EngineRun, EngineServer, RunRequest, ServerInfo
from mtpquant.records.acceptance import AcceptanceStats
from mtpquant.records.evidence import UnitCounts
from mtpquant.records.sampling import SamplingSettings

__all__ = ["EngineMeasurement", "engine_stats", "measure"]


@dataclass(frozen=True)
class EngineMeasurement:
    """What the engine's counters say about one batch of requests at one sampling setting."""

    model: str
    k: int  # draft positions the server counted (its num_speculative_tokens / speculative_num_steps)
    stats: AcceptanceStats
    run: EngineRun  # all the groups together
    units: UnitCounts  # the counts of each group
    sampling: SamplingSettings
    groups: tuple[tuple[int, ...], ...]  # the prompt indices of each unit

    @property
    def completions(self) -> tuple[Completion, ...]:
        """The requests' prompts and generated tokens."""
        return self.run.completions

    @property
    def other_requests(self) -> int:
        """Requests other clients completed on the server meanwhile."""
        return self.run.other_requests


def engine_stats(counts: DraftCounts) -> AcceptanceStats:
    """AcceptanceStats from an engine's counts (every verify step drafts its full k)."""
    steps = counts.steps
    return AcceptanceStats(
        num_steps=steps,
        num_drafted=counts.drafted,
        num_accepted=counts.accepted,
        acceptance_rate=counts.accepted / counts.drafted,
        mean_acceptance_length=1.0 + counts.accepted / steps,
        drafted_per_position=(steps,) * len(counts.accepted_per_position),  # none where none is counted
        accepted_per_position=counts.accepted_per_position,
        acceptance_per_position=tuple(a / steps for a in counts.accepted_per_position),
    )


def _chunks(first: int, count: int, size: int) -> list[tuple[int, ...]]:
    return [tuple(range(i, min(i + size, first + count))) for i in range(first, first + count, size)]


def measure(
    server: EngineServer,
    info: ServerInfo,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    sampling: SamplingSettings,
    *,
    concurrency: int = 1,
    runs: Sequence[int] | None = None,
) -> EngineMeasurement:
    """Send the prompts and read what the engine accepted, group by group; a server that does not draft is exit 43.

    ``runs``: lengths of consecutive stretches of prompts that must not share a group (e.g. the prompts of one
    context bucket); default: all prompts one stretch."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    groups: list[tuple[int, ...]] = []
    first = 0
    for count in runs or (len(prompts),):
        groups += _chunks(first, count, concurrency)
        first += count
    run = server.run(RunRequest(model, prompts, max_tokens, sampling, concurrency, groups), info)
    parts = run.group_counts or (run.counts,)
    k = run.counts.k
    width = len(run.counts.accepted_per_position)  # positions counted: k, or none (TensorRT-LLM counts AL only)

    def per_position(counts: DraftCounts) -> tuple[float, ...]:
        counted = counts.accepted_per_position
        return tuple(float(a) for a in counted) + (0.0,) * (width - len(counted))

    units = UnitCounts(
        tuple(float(p.steps) for p in parts),
        tuple(float(p.accepted) for p in parts),
        tuple(per_position(p) for p in parts),
        tuple((float(p.steps),) * width for p in parts),
    )
    unit_groups = tuple(groups) if run.group_counts else (tuple(range(len(prompts))),)
    return EngineMeasurement(model, k, engine_stats(run.counts), run, units, sampling, unit_groups)
