"""How tokens are sampled and drafts verified: the settings every engine request carries, typed once and spelled
per engine, and the verification rules the built-in prediction follows.

``SamplingSettings`` (temperature, top-p, top-k, seed; greedy by default) is what a measurement sends; each engine
client asks it for its own request fields: vLLM's OpenAI ``/v1/completions`` (``vllm_fields``: ``temperature``,
``seed``, and ``top_p`` / ``top_k`` when sampling) and SGLang's native ``/generate`` ``sampling_params``
(``sglang_fields``: ``temperature``, ``max_new_tokens``, ``ignore_eos``, and ``top_p``, ``top_k``,
``sampling_seed`` when sampling: the names of the requests recorded from SGLang 0.5.23 in
``tests/fixtures/sglang-cpu``). A temperature below 1e-5 is greedy (vLLM's ``_SAMPLING_EPS``).

``SpecRule`` is how the server verifies drafts, which is server configuration, not a request field. The three
rules, as vLLM 0.32.0 implements the first two (``vllm/config/speculative.py``: ``rejection_sample_method =
"standard"`` and ``draft_sample_method = "greedy"`` by default; ``vllm/v1/sample/rejection_sampler.py``:
``rejection_random_sample_kernel``, ``sample_recovered_tokens_kernel``; ``vllm/v1/spec_decode/llm_base_proposer.py``:
``compute_probs_and_sample_next_token``):

- ``argmax-draft`` (vLLM's default, spelled ``--rule vllm``): the MTP proposes its argmax; the draft is accepted
  with probability p(d), p the target's distribution after temperature, top-k and top-p; otherwise a token is sampled
  from p with d removed.
- ``probabilistic`` (``draft_sample_method: probabilistic``): the MTP samples its draft from q = softmax(logits /
  temperature) (vLLM applies only the temperature to the draft); accepted with probability min(1, p(d) / q(d)),
  so sum(min(p, q)) on average; otherwise a token is sampled from max(p - q, 0).
- ``strict`` (exact match, as local runtimes verify; vLLM 0.32 has no such mode): the draft is sampled from q as
  above and kept only when it equals the token the target samples from p: sum(p * q) on average. (With an argmax
  draft, exact match accepts with p(d) and emits exactly what ``argmax-draft`` emits.)

A greedy request is greedy under every rule: the draft is accepted when it equals the target's argmax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mtpquant.records.record import Record

__all__ = ["ARGMAX_DRAFT", "GREEDY", "GREEDY_EPS", "PROBABILISTIC", "RULES", "STRICT", "SamplingSettings", "SpecRule",
           "check_sampling", "rule", "sampling_settings"]

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


@dataclass(frozen=True)
class SamplingSettings(Record):
    """One request's sampling: temperature (0: greedy), top-p (1: off), top-k (0: off), the request's seed; its JSON
    object ``{"temperature", "top_p", "top_k", "seed"}`` (missing keys: the defaults)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0: off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Whether the request samples greedily (temperature below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    @property
    def label(self) -> str:
        """``T=0.8, top-p 0.9, top-k 20`` (the settings that are on)."""
        parts = [f"T={self.temperature:g}"]
        if not self.greedy:
            if self.top_p < 1:
                parts.append(f"top-p {self.top_p:g}")
            if self.top_k:
                parts.append(f"top-k {self.top_k}")
        return ", ".join(parts)

    def for_prompt(self, index: int) -> SamplingSettings:
        """The settings of the ``index``-th prompt: its own seed (``seed + index``), so every prompt's draws are
        reproducible whatever else is in flight (greedy requests draw nothing: unchanged)."""
        if self.greedy:
            return self
        return SamplingSettings(self.temperature, self.top_p, self.top_k, self.seed + index)

    def vllm_fields(self) -> dict[str, Any]:
        """The OpenAI-completions request fields vLLM reads (``top_k: 0`` is vLLM's "off")."""
        fields: dict[str, Any] = {"temperature": self.temperature, "seed": self.seed}
        if not self.greedy:
            fields["top_p"] = self.top_p
            fields["top_k"] = self.top_k
        return fields

    def sglang_fields(self, max_new_tokens: int) -> dict[str, Any]:
        """SGLang ``/generate`` ``sampling_params`` for ``max_new_tokens`` tokens past the prompt (``ignore_eos``).
        SGLang has no top-k 0 ("off" is -1, its default), so an unset top-k is left out."""
        fields: dict[str, Any] = {"temperature": self.temperature, "max_new_tokens": int(max_new_tokens)}
        fields["ignore_eos"] = True
        if not self.greedy:
            fields["top_p"] = self.top_p
            if self.top_k:
                fields["top_k"] = self.top_k
            fields["sampling_seed"] = self.seed
        return fields


GREEDY = SamplingSettings()


@dataclass(frozen=True)
class SpecRule:
    """A verification rule: what it is (``name``), the spelling ``--rule`` takes and records store (``flag``), whether
    the draft is sampled from the MTP (``sampled_draft``; else it is the MTP's argmax), whether a sampled draft is kept
    only when it equals the target's own sample (``exact_match``; else it is accepted with probability
    min(1, p/q)), and the vLLM speculative-config keys that select it (None: vLLM 0.32 does not implement it)."""

    name: str
    flag: str
    sampled_draft: bool
    exact_match: bool
    vllm_config: Mapping[str, str] | None
    description: str


# vLLM's default verification, spelled ``--rule vllm`` (and so recorded): the MTP's argmax is the draft, accepted
# with probability p(draft). A rule, not the engine: engines that verify this way (SGLang's NEXTN chain,
# TensorRT-LLM's MTPSampler) say so through ``sampled_draft``.
ARGMAX_DRAFT = SpecRule(
    "argmax-draft",
    "vllm",
    False,
    False,
    {},  # the defaults: rejection_sample_method "standard", draft_sample_method "greedy"
    "argmax draft, accepted with probability p(draft) (vLLM's default)",
)
PROBABILISTIC = SpecRule(
    "probabilistic",
    "probabilistic",
    True,
    False,
    {"rejection_sample_method": "standard", "draft_sample_method": "probabilistic"},
    "draft sampled from the MTP, accepted with probability min(1, p/q)",
)
STRICT = SpecRule(
    "strict", "strict", True, True, None, "draft sampled from the MTP, kept only when it equals the target's own sample"
)
# The rules by the spelling ``--rule`` takes and records store (``rule``: one of them -> its record).
RULES: dict[str, SpecRule] = {r.flag: r for r in (ARGMAX_DRAFT, PROBABILISTIC, STRICT)}


def rule(name: str) -> SpecRule:
    """The rule ``--rule name`` selects (``SpecRule.flag``); ``ValueError`` naming the choices otherwise."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown rule {name!r}; choose one of {', '.join(RULES)}") from None


def sampling_settings(
    temperatures: Sequence[float], top_p: Sequence[float], top_k: Sequence[int], seed: int
) -> tuple[SamplingSettings, ...]:
    """The settings of ``--temperature T... --top-p P... --top-k K...`` (validate's and heal's flags): one per
    temperature, in the order given; a single top-p / top-k applies to every temperature, else one per temperature.
    ``ValueError`` names what does not fit."""
    n = len(temperatures)

    def each(values: Sequence[Any], flag: str) -> tuple[Any, ...]:
        if len(values) == 1:
            return tuple(values) * n
        if len(values) != n:
            raise ValueError(f"{flag} takes one value or one per temperature ({n}), got {len(values)}")
        return tuple(values)

    return tuple(
        SamplingSettings(t, p, k, seed) for t, p, k in zip(temperatures, each(top_p, "--top-p"), each(top_k, "--top-k"))
    )


def check_sampling(
    temperatures: Sequence[float], top_p: Sequence[float], top_k: Sequence[int], seed: int, rule_name: str
) -> tuple[tuple[SamplingSettings, ...], SpecRule]:
    """The settings and the verification rule of the sampling flags, or a one-line ``ValueError`` in the flags'
    words (no temperature, a value out of range, a setting listed twice, an unknown rule)."""
    if not temperatures:
        raise ValueError("--temperature needs at least one value")
    try:
        settings = sampling_settings(temperatures, top_p, top_k, seed)
        spec_rule = rule(rule_name)
    except ValueError as exc:
        raise ValueError(f"--temperature/--top-p/--top-k/--rule: {exc}") from None
    if len(set(settings)) != len(settings):
        raise ValueError("--temperature/--top-p/--top-k: a sampling setting is listed twice")
    return settings, spec_rule
