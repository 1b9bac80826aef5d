"""What a serving engine is to mtpquant, whichever engine it is: the typed answers every client returns.

- ``ServerInfo``: the engine, its version, the models it serves, and its speculative-decoding settings as far as
  the server states them (``SpecConfig``);
- ``Completion``: one request's prompt and generated token ids;
- ``DraftCounts``: what the engine counted for a batch of requests (verify steps, drafted and accepted tokens,
  accepted per draft position);
- ``RunRequest``: what one measurement sends (the prompts, their lengths and sampling, how they are grouped);
- ``EngineRun``: the completions and the counts of one measurement, and how far other traffic is in them;
- ``EngineServer``: the protocol the vLLM and SGLang clients implement (``engine/vllm.py``, ``engine/sglang.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mtpquant.engine.table import display as engine_display
from mtpquant.errors import EngineModelError
from mtpquant.records.sampling import SamplingSettings

__all__ = [
    "Completion",
    "DraftCounts",
    "EngineRun",
    "EngineServer",
    "RunRequest",
    "ServerInfo",
    "SpecConfig",
    "resolve_model",
    "server_args_of",
    "split_groups",
    "sum_counts",
]


@dataclass(frozen=True)
class SpecConfig:
    """A server's speculative decoding as it states it (an absent field: the server does not say)."""

    algorithm: str | None  # vLLM: the speculative method ("mtp"); SGLang: speculative_algorithm ("EAGLE" for NEXTN)
    k: int | None = None  # draft tokens per step (vLLM num_speculative_tokens, SGLang speculative_num_steps)
    topk: int | None = None  # SGLang speculative_eagle_topk: 1 is a chain, more is a tree
    draft_tokens: int | None = None  # SGLang speculative_num_draft_tokens (a chain verifies k + 1)
    draft_model: str | None = None  # a separate draft model, when the server names one
    adaptive: bool = False  # the server changes k as it runs

    def to_json(self) -> dict[str, Any]:
        """The report's form (only what the server stated)."""
        out: dict[str, Any] = {"algorithm": self.algorithm}
        for name in ("k", "topk", "draft_tokens", "draft_model"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.adaptive:
            out["adaptive"] = True
        return out


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself."""

    url: str
    engine: str  # a key of engine.table
    version: str
    models: tuple[str, ...]
    max_model_len: int | None
    speculative: SpecConfig | None = None  # None: the server does not say (vLLM: known from its counters)
    model_path: str | None = None  # SGLang: the checkpoint it loaded (a directory or a Hub id)

    @property
    def display(self) -> str:
        """``SGLang 0.5.23``."""
        return f"{engine_display(self.engine)} {self.version}"


@dataclass(frozen=True)
class Completion:
    """One completion: the prompt's token ids and the generated ones."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: str | None
    count: int | None = None  # tokens generated, where the server counts them without returning their ids

    @property
    def generated(self) -> int:
        """Tokens generated."""
        return self.count if self.count is not None else len(self.tokens)


@dataclass(frozen=True)
class DraftCounts:
    """Speculative-decoding counts over some requests: ``steps`` verify steps, each drafting ``k`` tokens."""

    steps: int
    drafted: int
    accepted: int
    accepted_per_position: tuple[int, ...]  # position i: steps whose first i+1 drafts were all accepted
    positions: int | None = None  # k, where the engine counts no acceptance per position (TensorRT-LLM)

    @property
    def k(self) -> int:
        """Draft positions per step (those counted, or the k the engine states)."""
        return self.positions if self.positions is not None else len(self.accepted_per_position)


@dataclass(frozen=True)
class RunRequest:
    """What one measurement sends: the token-id prompts to ``model`` (prompt i generates ``max_tokens[i]`` with
    ``sampling.for_prompt(i)``); ``groups``: prompt indices sent together, one group after another
    (``concurrency`` in flight at once within a group; default: all one group)."""

    model: str
    prompts: Sequence[Sequence[int]]
    max_tokens: Sequence[int]
    sampling: SamplingSettings
    concurrency: int = 1
    groups: Sequence[Sequence[int]] | None = None

    def split(self) -> list[list[int]]:
        """The groups, one after another (``split_groups``)."""
        return split_groups(len(self.prompts), self.groups)

    def ordered(self, completions: Mapping[int, Completion]) -> tuple[Completion, ...]:
        """The completions by prompt index, in prompt order."""
        return tuple(completions[i] for i in range(len(self.prompts)))


@dataclass(frozen=True)
class EngineRun:
    """One measurement on a server: the completions, the counts, and the other traffic meanwhile."""

    model: str
    completions: tuple[Completion, ...]
    counts: DraftCounts
    other_requests: int = 0  # requests of other clients that finished on the server during the measurement
    others_counted: bool = True  # whether their drafts are in ``counts`` (server-wide counters) or not (per request)
    group_counts: tuple[DraftCounts, ...] = ()  # the counts of each group of requests asked for (``run(groups=)``)


class EngineServer(Protocol):
    """A running server, measured through its own speculative-decoding counters."""

    url: str

    def info(self) -> ServerInfo:
        """The engine, version, models and speculative settings; refuses a server of another kind (exit 41)."""
        ...

    def tokenize(self, model: str, text: str) -> list[int]:
        """The server's tokenization of ``text`` without special tokens."""
        ...

    def server_args(self) -> tuple[str, ...]:
        """The launch arguments the server states (those that decide what is measured); () when it states none."""
        ...

    def run(self, request: RunRequest, info: ServerInfo) -> EngineRun:
        """Send the request's prompts and count what the engine drafted and accepted for them (exit 43 when the
        server does not draft with an MTP chain), each group's counts kept apart (``EngineRun.group_counts``)."""
        ...


def split_groups(count: int, groups: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """The groups a run sends (default: all ``count`` prompts one group); every prompt exactly once."""
    out = [list(g) for g in groups] if groups is not None else [list(range(count))]
    if sorted(i for g in out for i in g) != list(range(count)):
        raise ValueError(f"groups must cover each of the {count} prompts once")
    return out


def sum_counts(parts: Sequence[DraftCounts]) -> DraftCounts:
    """The counts of several groups together."""
    k = max((p.k for p in parts), default=0)
    return DraftCounts(
        sum(p.steps for p in parts),
        sum(p.drafted for p in parts),
        sum(p.accepted for p in parts),
        tuple(sum(p.accepted_per_position[i] for p in parts if p.k > i) for i in range(k)),
    )


def resolve_model(info: ServerInfo, expected: str | None) -> str:
    """The model to ask for: ``expected`` (which must be served: exit 42 otherwise), or the only one served."""
    if expected is None:
        if len(info.models) != 1:
            served = ", ".join(info.models)
            raise EngineModelError(f"{info.url}: serves {len(info.models)} models ({served}); name one")
        return info.models[0]
    if expected not in info.models:
        raise EngineModelError(f"{info.url}: serves {', '.join(info.models)}, not {expected}")
    return expected


def server_args_of(settings: Mapping[str, Any], names: Sequence[str]) -> tuple[str, ...]:
    """``--name value`` pairs for the named settings a server reports (its launch arguments, as far as stated)."""
    out: list[str] = []
    for name in names:
        value = settings.get(name)
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return tuple(out)
