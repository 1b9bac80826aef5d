"""Acceptance as a running engine measures it: greedy completions, then the counter deltas.

The same prompts as the built-in path (token ids, greedy, ``ignore_eos``, the same lengths) are sent one
request at a time; the speculative-decoding counters are read before and after, and their difference gives
vLLM's own numbers: AL = 1 + accepted / drafts, acceptance rate = accepted / draft tokens, and per draft
position i, accepted_per_pos[i] / drafts. The counters are server-wide: when the request counter moved by
more than the requests sent, other traffic interleaved and the numbers include it (the measurement says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtpquant.engine.client import Completion, EngineClient
from mtpquant.engine.counters import CounterSnapshot
from mtpquant.errors import EngineSpecDecodeError
from mtpquant.validate.metrics import AcceptanceStats

__all__ = ["EngineMeasurement", "engine_stats", "measure"]


@dataclass(frozen=True)
class EngineMeasurement:
    """What the engine's counters say about one batch of greedy requests."""

    model: str
    k: int  # draft positions the server reported (its num_speculative_tokens)
    stats: AcceptanceStats
    delta: CounterSnapshot
    requests_sent: int
    completions: tuple[Completion, ...]

    @property
    def other_requests(self) -> int:
        """Requests other clients completed on the server meanwhile (counted into the numbers)."""
        return max(0, round(self.delta.requests) - self.requests_sent)


def engine_stats(delta: CounterSnapshot) -> AcceptanceStats:
    """AcceptanceStats from counter deltas (vLLM drafts its full K at every step)."""
    drafts = round(delta.drafts)
    per_pos = tuple(round(a) for a in delta.accepted_per_position)
    return AcceptanceStats(
        num_steps=drafts,
        num_drafted=round(delta.draft_tokens),
        num_accepted=round(delta.accepted),
        acceptance_rate=delta.accepted / delta.draft_tokens,
        mean_acceptance_length=1.0 + delta.accepted / delta.drafts,
        drafted_per_position=(drafts,) * len(per_pos),
        accepted_per_position=per_pos,
        acceptance_per_position=tuple(a / drafts for a in per_pos),
    )


def measure(
    client: EngineClient, model: str, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> EngineMeasurement:
    """Send the prompts greedily and read what the engine accepted; refuses a server that does not draft."""
    before = client.counters(model)
    completions = client.complete(model, prompts, max_tokens)
    delta = client.counters(model).minus(before)
    if delta.drafts <= 0 or delta.draft_tokens <= 0:
        what = "exports no speculative-decoding counters" if not delta.spec_decode else "did not draft"
        raise EngineSpecDecodeError(
            f"{client.url}: {model} {what} during {len(completions)} requests: speculative decoding with MTP is not "
            'configured (start it with --speculative-config \'{"method":"mtp","num_speculative_tokens":K}\')'
        )
    return EngineMeasurement(model, delta.positions, engine_stats(delta), delta, len(completions), tuple(completions))
