"""How tokens are sampled: the settings every engine request carries, typed once and spelled per engine.

``SamplingSettings`` (temperature, top-p, top-k, seed; greedy by default) is what a measurement sends; each engine
client asks it for its own request fields: vLLM's OpenAI ``/v1/completions`` (``vllm_fields``: ``temperature``,
``seed``, and ``top_p`` / ``top_k`` when sampling) and SGLang's native ``/generate`` ``sampling_params``
(``sglang_fields``: ``temperature``, ``max_new_tokens``, ``ignore_eos``, and ``top_p``, ``top_k``,
``sampling_seed`` when sampling: the names of the requests recorded from SGLang 0.5.23 in
``tests/fixtures/sglang-cpu``). A temperature below 1e-5 is greedy (vLLM's ``_SAMPLING_EPS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GREEDY", "GREEDY_EPS", "SamplingSettings"]

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


@dataclass(frozen=True)
class SamplingSettings:
    """One request's sampling: temperature (0: greedy), top-p (1: off), top-k (0: off), the request's seed."""

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

    def to_json(self) -> dict[str, Any]:
        """``{"temperature", "top_p", "top_k", "seed"}``."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SamplingSettings:
        """Read ``to_json``'s object (missing keys: the defaults)."""
        return cls(
            float(d.get("temperature", 0.0)), float(d.get("top_p", 1.0)), int(d.get("top_k", 0)), int(d.get("seed", 0))
        )


GREEDY = SamplingSettings()
