"""What one MTP forward step gives the drafting loop, whatever the family's MTP.

Every reference MTP (``module.MtpLayer``: Qwen3.5 / Qwen3-Next; ``qwen4_exp.Qwen4ExpMtp``: Qwen3.8-Flash-Next) has a
``step`` method with the signature of ``MtpForward.step`` and returns an ``MtpStep``: the stream the LM head reads,
the stream the next draft step reads (the same tensor for Qwen3.5; the multi-stream state for Qwen4-Exp), the cache
extended by the new rows, and (Qwen4-Exp) the QSA indexer's token selection. Caches implement ``MtpCache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from torch import Tensor

__all__ = ["MtpCache", "MtpForward", "MtpStep"]

C = TypeVar("C", bound="MtpCache")


class MtpCache(Protocol):
    """An MTP layer's immutable cache of earlier rows (batch first)."""

    @property
    def length(self) -> int:
        """Number of cached rows."""
        ...

    def expand(self: C, batch: int) -> C:
        """The batch-1 cache repeated ``batch`` times."""
        ...

    def last(self: C, rows: int) -> C:
        """The last ``rows`` rows."""
        ...

    def cat(self: C, parts: Sequence[C]) -> C:
        """This cache followed by the rows of ``parts`` (same batch)."""
        ...


@dataclass(frozen=True)
class MtpStep:
    """One MTP step over T rows: ``out`` ``[B, T, H]`` for the LM head (row t's logits predict the token two after
    its hidden state), ``next_hidden`` for the next draft step, ``cache`` extended by the T rows, and ``selection``
    (bool ``[B, 1, T, L + T]``: the keys the QSA indexer chose for each row; None without an indexer), and ``head``
    where the step's layer drafts with a head of its own."""

    out: Tensor
    next_hidden: Tensor
    cache: Any
    selection: Tensor | None = None
    # The LM head this step drafts with where it is the MTP layer's own ``[V, H]`` (Step-3.5's per-layer
    # ``shared_head.output``); None: the target's
    head: Tensor | None = None


class MtpForward(Protocol):
    """The drafting loop's view of an MTP (``MtpLayer``, ``Qwen4ExpMtp``)."""

    @property
    def index_share(self) -> bool:
        """Whether draft steps after the first reuse the first step's token selection
        (``index_share_for_mtp_iteration``)."""
        ...

    def step(
        self,
        hidden: Tensor,
        next_tokens_embeds: Tensor,
        positions: Tensor | None = None,
        past: Any = None,
        attn_mask: Tensor | None = None,
        *,
        step: int = 0,
        selection: Tensor | None = None,
    ) -> MtpStep:
        """One causal pass of draft step ``step`` over T new rows (see ``MtpStep``)."""
        ...
