"""Where a family keeps its MTP tensors (the storage classes), and the one name test built from it per config.

Three storage classes (``shared/reference/mtp-families.md`` §1), each a value of ``MtpStorage``:

- ``NAMESPACE``: an own top-level namespace, ``mtp.`` (Qwen, Nemotron-H ``mtp.layers.{j}``, DeepSeek-V4 ``mtp.{i}``);
- ``APPENDED``: decoder layers appended to the trunk at ``{prefix}layers.{num_hidden_layers + i}`` (DeepSeek-V3.x,
  GLM, Step): only the config separates them from the trunk, so the test needs ``num_hidden_layers``. vLLM's
  ``get_spec_layer_idx_from_weight_name`` (``model_executor/models/utils.py``) takes ``model.layers.``,
  ``layers.`` and ``model.language_model.layers.`` alike; so does the test here (the family's prefixes);
- ``SUBSPACE``: a sub-namespace of the model's own (MiMo-7B ``model.mtp_layers.{i}``, MiMo-V2 ``model.mtp.layers.{i}``).

``MtpNames`` is that storage resolved against one config: which names are MTP tensors, which MTP depth a name
belongs to, the prefix of each depth's layer. It is what every caller asks (through ``ModelSpec``) instead of
testing a prefix itself: a prefix test is right only once the family is known (DeepSeek-V4.1 keeps a DSpark
drafter under ``mtp.``; a DeepSeek-V3 ``model.layers.61.`` is its MTP only because ``num_hidden_layers`` is 61).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

__all__ = ["APPENDED", "NAMESPACE", "SUBSPACE", "MtpNames", "MtpStorage"]

NAMESPACE = "namespace"
APPENDED = "appended"
SUBSPACE = "subspace"


@dataclass(frozen=True)
class MtpStorage:
    """How one family names its MTP tensors on disk."""

    kind: str  # NAMESPACE | APPENDED | SUBSPACE
    # NAMESPACE / SUBSPACE: the prefix every MTP tensor starts with ("mtp.", "model.mtp_layers.", "model.mtp.")
    root: str = "mtp."
    # NAMESPACE / SUBSPACE: what follows ``root`` up to and including the depth's layer number ("layers.{i}.", or
    # "{i}." for MiMo-7B's model.mtp_layers.{i}); the glue outside any layer (Qwen's mtp.fc) has no number
    layer: str = "layers."
    # SUBSPACE with several numbered roots (ERNIE-4.5: ``model.mtp_emb_norm.{i}``, ``model.mtp_block.{i}``, ...): each
    # infix after ``root`` that a depth number follows; (): ``layer`` alone
    layers: tuple[str, ...] = ()
    # Config keys (the first present wins) whose length is the number of sub-layers one depth stores (Nemotron-H:
    # each character of mtp_hybrid_override_pattern is one mtp.layers.{j}; the depth is j // len + 1); (): one layer
    sublayers_key: tuple[str, ...] = ()

    def resolve(self, prefixes: Iterable[str], first: int, sublayers: int = 1) -> MtpNames:
        """The name test for one config: ``prefixes`` the family's main-model prefixes (APPENDED), ``first`` the
        trunk's layer count (APPENDED: the index of depth 0)."""
        if self.kind == APPENDED:
            roots = tuple(dict.fromkeys(p + "layers." for p in prefixes))
            return MtpNames(APPENDED, roots, first, 1)
        roots = tuple(self.root + infix for infix in (self.layers or (self.layer,)))
        return MtpNames(self.kind, roots, 0, max(1, sublayers), self.root)


@dataclass(frozen=True)
class MtpNames:
    """The MTP name test of one config (hashable: cached functions are keyed by it)."""

    kind: str
    roots: tuple[str, ...]  # where the numbered layers start: "mtp.layers.", "model.layers.", ...
    first: int  # APPENDED: the trunk's layer count (depth 0's index); else 0
    sublayers: int = 1  # stored layers per MTP depth (Nemotron-H's hybrid pattern length)
    namespace: str = ""  # NAMESPACE / SUBSPACE: every MTP tensor starts with it (glue included)

    def is_mtp(self, name: str) -> bool:
        """Whether a tensor (or module) name is part of the MTP, anchored: never a substring test."""
        return bool(self.matcher(name))

    @cached_property
    def matcher(self) -> Callable[[str], object]:
        """``is_mtp`` as one callable whose result is truthy for an MTP name, for loops over a whole table (a header
        table holds ~10^5 names): the namespace's anchored prefix is one C-level regex match."""
        if self.kind != APPENDED:
            return re.compile(re.escape(self.namespace)).match
        layer_number = self._layer_number
        return lambda name: layer_number(name) is not None  # layer 0 (a standalone NextN export's) is an MTP

    @property
    def prefix_width(self) -> int | None:
        """How many leading characters of a name ``matcher`` reads: ``len(namespace)`` where it is a prefix test (every
        storage but appended layers), so names that share that many characters share the answer; None for appended
        layers (the layer number decides, whatever its length)."""
        return None if self.kind == APPENDED else len(self.namespace)

    def _layer_number(self, name: str) -> int | None:
        """APPENDED: the absolute layer number of a name at or past the trunk's end; None otherwise."""
        for root in self.roots:
            if name.startswith(root):
                number, dot, _ = name[len(root) :].partition(".")
                if dot and number.isdigit() and int(number) >= self.first:
                    return int(number)
        return None

    def depth_of(self, name: str) -> int | None:
        """The MTP depth (0-based) a name belongs to; None for a name outside every numbered layer (glue such as
        Qwen's ``mtp.fc``) or not an MTP name at all."""
        if self.kind == APPENDED:
            n = self._layer_number(name)
            return None if n is None else n - self.first
        m = self._layer_re.match(name)
        return None if m is None else int(m.group(1)) // self.sublayers

    @cached_property
    def _layer_re(self) -> re.Pattern[str]:
        return re.compile(f"^(?:{'|'.join(map(re.escape, self.roots))})(\\d+)\\.")

    def depth(self, names: Iterable[str]) -> int:
        """How many MTP depths a name set holds (the highest depth + 1; 0 for none)."""
        depths = [d for n in names if (d := self.depth_of(n)) is not None]
        return max(depths) + 1 if depths else 0

    def layer_prefix(self, name: str) -> str | None:
        """The numbered layer a name sits in, with its dot (``model.layers.61.``, ``mtp.layers.0.``); None outside."""
        for root in self.roots:
            if name.startswith(root):
                number, dot, _ = name[len(root) :].partition(".")
                if dot and number.isdigit() and (self.kind != APPENDED or int(number) >= self.first):
                    return f"{root}{number}."
        return None

    def layer_prefixes(self, depth: int) -> list[str]:
        """The prefix (with its dot) of every stored layer of ``depth`` MTP depths, in the first root's form."""
        root = self.roots[0]
        return [f"{root}{self.first + j}." for j in range(depth * self.sublayers)]
