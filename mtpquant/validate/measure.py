"""Acceptance as a running engine measures it: completions with the built-in path's prompts, lengths and sampling,
then the counter deltas.

The prompts are sent in groups of ``concurrency`` requests in flight at once (one group after another); the
speculative-decoding counters are read before the first group and after each, and the differences give vLLM's
own numbers: AL = 1 + accepted / drafts, acceptance rate = accepted / draft tokens, per draft position i
accepted_per_pos[i] / drafts. Each group is a sampling unit of the confidence intervals (one prompt per unit at
``concurrency`` 1). The counters are server-wide: when the request counter moved by more than the requests sent,
other traffic interleaved and the numbers include it (the measurement says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mtpquant.engine.client import Completion, EngineClient
from mtpquant.engine.counters import CounterSnapshot
from mtpquant.engine.sampling import SamplingSettings
from mtpquant.errors import EngineSpecDecodeError
from mtpquant.validate.evidence import UnitCounts
from mtpquant.validate.metrics import AcceptanceStats

__all__ = ["EngineMeasurement", "engine_stats", "measure"]


@dataclass(frozen=True)
class EngineMeasurement:
    """What the engine's counters say about one batch of requests at one sampling setting."""

    model: str
    k: int  # draft positions the server reported (its num_speculative_tokens)
    stats: AcceptanceStats
    delta: CounterSnapshot
    requests_sent: int
    completions: tuple[Completion, ...]
    units: UnitCounts  # the counter deltas of each group of requests
    sampling: SamplingSettings
    groups: tuple[tuple[int, ...], ...]  # the prompt indices of each unit

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


def _unit(delta: CounterSnapshot, k: int) -> tuple[float, float, tuple[float, ...], tuple[float, ...]]:
    per_pos = tuple(float(round(a)) for a in delta.accepted_per_position) + (0.0,) * (
        k - len(delta.accepted_per_position)
    )
    drafts = float(round(delta.drafts))
    return drafts, float(round(delta.accepted)), per_pos[:k], (drafts,) * k


def measure(
    client: EngineClient,
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    sampling: SamplingSettings | None = None,
    *,
    concurrency: int = 1,
    groups: Sequence[Sequence[int]] | None = None,
) -> EngineMeasurement:
    """Send the prompts (``concurrency`` at a time) and read what the engine accepted; refuses a server that does
    not draft. ``groups``: the prompt indices sent together (each at most ``concurrency``; default: consecutive
    runs), one sampling unit each, in the order given."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if groups is None:
        groups = [range(i, min(i + concurrency, len(prompts))) for i in range(0, len(prompts), concurrency)]
    sampling = sampling or SamplingSettings()
    workers = [client] + [
        EngineClient(client.url, timeout=client.timeout, generate_timeout=client.generate_timeout)
        for _ in range(concurrency - 1)
    ]
    start = before = client.counters(model)
    completions: list[Completion] = []
    deltas: list[CounterSnapshot] = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for group in groups:
            futures = [
                pool.submit(workers[j].complete_one, model, prompts[i], max_tokens[i], sampling.for_prompt(i))
                for j, i in enumerate(group)
            ]
            completions += [f.result() for f in futures]
            after = client.counters(model)
            deltas.append(after.minus(before))
            before = after
    delta = before.minus(start)
    if delta.drafts <= 0 or delta.draft_tokens <= 0:
        what = "exports no speculative-decoding counters" if not delta.spec_decode else "did not draft"
        raise EngineSpecDecodeError(
            f"{client.url}: {model} {what} during {len(completions)} requests: speculative decoding with MTP is not "
            'configured (start it with --speculative-config \'{"method":"mtp","num_speculative_tokens":K}\')'
        )
    k = delta.positions
    parts = [_unit(d, k) for d in deltas]
    units = UnitCounts(
        tuple(p[0] for p in parts), tuple(p[1] for p in parts), tuple(p[2] for p in parts), tuple(p[3] for p in parts)
    )
    return EngineMeasurement(
        model,
        k,
        engine_stats(delta),
        delta,
        len(completions),
        tuple(completions),
        units,
        sampling,
        tuple(tuple(g) for g in groups),
    )
