"""Acceptance as a running engine measures it: completions of the built-in path's prompts, then the engine's
own speculative-decoding counts turned into the report's ``AcceptanceStats``.

The same prompts as the built-in path (token ids, ``ignore_eos``, the same lengths, the same sampling settings)
are sent one request at a time. Each engine counts in its own way (``mtpquant.engine``): vLLM's server-wide
counters read before and after (other traffic meanwhile is counted in, and reported), SGLang's per-request
counters summed (exactly these requests). Either way: AL = 1 + accepted / verify steps, acceptance rate =
accepted / drafted tokens, and per draft position i, accepted_i / verify steps (every step drafts all k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtpquant.engine.sampling import SamplingSettings
from mtpquant.engine.server import Completion, DraftCounts, EngineRun, EngineServer, ServerInfo
from mtpquant.validate.metrics import AcceptanceStats

__all__ = ["EngineMeasurement", "engine_stats", "measure"]


@dataclass(frozen=True)
class EngineMeasurement:
    """What the engine's counters say about one batch of requests."""

    model: str
    k: int  # draft positions the server counted (its num_speculative_tokens / speculative_num_steps)
    stats: AcceptanceStats
    run: EngineRun

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
        drafted_per_position=(steps,) * counts.k,
        accepted_per_position=counts.accepted_per_position,
        acceptance_per_position=tuple(a / steps for a in counts.accepted_per_position),
    )


def measure(
    server: EngineServer,
    info: ServerInfo,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    sampling: SamplingSettings,
) -> EngineMeasurement:
    """Send the prompts and read what the engine accepted; a server that does not draft is exit 43."""
    run = server.run(model, prompts, max_tokens, sampling, info)
    return EngineMeasurement(model, run.counts.k, engine_stats(run.counts), run)
