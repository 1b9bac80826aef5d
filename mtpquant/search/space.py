"""The MTP precision search's space, from headers alone: configurations (a precision per precision group of the
family), the tensors each one writes and their bytes on disk, which of them the engines load, and how the output
declares them.

- A configuration (``Assignment``) gives each of the family's precision groups (``MtpLayout.groups``: the input
  projection, the attention projections, the dense MLP or the shared expert, the routed experts) one of ``bf16``,
  ``fp8``, ``nvfp4``; MTP Linears in no group (routers, gates) and every norm keep the source's bytes.
- Its tensors are those ``mtp.quantize.quantize_mtp`` writes for it (``planned_table``: NVFP4 ``weight`` U8
  [out, in / 2], ``weight_scale`` F8_E4M3 [out, in / 16], ``weight_scale_2`` F32 []; FP8 ``weight`` F8_E4M3 and
  ``weight_scale`` F32 []; an ``input_scale`` F32 [] each with activations), so its bytes are exact before any weight
  is read (``tests/test_search_space.py`` checks them against the written tensors).
- The engines' rules are applied as the checkpoint would carry them (``engine.loading.mtp_load_refusal``): a
  configuration is declared ``plain`` (the main model's one quant_algo, the BF16 groups excluded by name: vLLM follows
  per-module exclusions, SGLang builds the whole MTP of a ``modelopt_fp4`` checkpoint in BF16) where every chosen
  engine loads that, else ``mixed`` (MIXED_PRECISION, every quantized MTP module listed in ``quantized_layers``: vLLM
  and SGLang then build each as listed, SGLang's ``mtp.fc`` always plain); a configuration neither loads is not in
  the space.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

from mtpquant.checkpoint.header import DTYPE_BITS
from mtpquant.checkpoint.modules import linear_modules
from mtpquant.checkpoint.precision import is_quantized, linear_precisions
from mtpquant.engine.loading import mtp_load_refusal
from mtpquant.engine.table import NAMES, EngineName, searched
from mtpquant.families import FUSED_EXPERT_PIECES, QWEN_MTP_NAMES, Family, MtpGroup
from mtpquant.formats.kinds import NVFP4_BLOCK, UNQUANTIZED, WRITTEN, precision_kind, quantizes
from mtpquant.formats.quant_config import QuantMetadata
from mtpquant.recipes.recipe import recipe_excludes
from mtpquant.records.record import Record

__all__ = [
    "BLOCK",
    "ENGINE_CHOICES",
    "PRECISIONS",
    "Assignment",
    "Declaration",
    "MtpSpace",
    "Planned",
    "engines_of",
    "layer_entry",
]

Precision = Literal["bf16", "fp8", "nvfp4"]
PRECISIONS: tuple[str, ...] = get_args(Precision)  # widest first
EngineChoice = EngineName | Literal["any"]
ENGINE_CHOICES: tuple[str, ...] = (*NAMES, "any")
BLOCK = NVFP4_BLOCK  # NVFP4 block: a quantized Linear's input dimension must be a multiple of it


def engines_of(choice: str) -> tuple[str, ...]:
    """The engines ``--engine`` names (``any``: every one, so a configuration must load in all of them)."""
    return searched() if choice == "any" else (choice,)


def layer_entry(precision: str, main_algo: str) -> dict[str, Any]:
    """A quantized MTP module's ``quantized_layers`` entry: NVFP4 as the main model's (its quant_algo, group 16), FP8
    per tensor."""
    return WRITTEN[precision].layer_entry(main_algo)


@dataclass(frozen=True)
class Assignment(Record):
    """One configuration: a precision per precision group, in the family's group order; written as
    ``{"input": "bf16", "attention": "nvfp4", ...}``."""

    groups: tuple[str, ...]
    precisions: tuple[Precision, ...]

    def __post_init__(self) -> None:
        if len(self.groups) != len(self.precisions):
            raise ValueError("Assignment: one precision per group")

    @classmethod
    def uniform(cls, groups: Sequence[str], precision: str) -> Assignment:
        """Every group in ``precision``."""
        return cls(tuple(groups), tuple(precision for _ in groups))  # type: ignore[misc]

    @classmethod
    def of(cls, mapping: Mapping[str, str]) -> Assignment:
        """From ``{group: precision}`` (in its order)."""
        return cls(tuple(mapping), tuple(mapping.values()))  # type: ignore[arg-type]

    def __getitem__(self, group: str) -> str:
        return self.precisions[self.groups.index(group)]

    def with_group(self, group: str, precision: str) -> Assignment:
        """This configuration with ``group`` in ``precision``."""
        chosen = tuple(precision if g == group else p for g, p in zip(self.groups, self.precisions))
        return Assignment(self.groups, chosen)  # type: ignore[arg-type]

    def changed(self) -> tuple[str, ...]:
        """The groups not in BF16."""
        return tuple(g for g, p in zip(self.groups, self.precisions) if quantizes(p))

    @property
    def all_bf16(self) -> bool:
        """Whether every group keeps BF16 (the MTP is the source's)."""
        return not self.changed()

    @property
    def label(self) -> str:
        """``input bf16, attention nvfp4, mlp fp8``."""
        return ", ".join(f"{g} {p}" for g, p in zip(self.groups, self.precisions))

    def json_out(self, data: dict[str, Any]) -> dict[str, Any]:
        """``{group: precision}``."""
        return dict(zip(data["groups"], data["precisions"]))

    @classmethod
    def json_in(cls, data: dict[str, Any]) -> dict[str, Any]:
        """From ``{group: precision}``."""
        return {"groups": list(data), "precisions": list(data.values())}


class Planned(NamedTuple):
    """One tensor a configuration writes, as a header describes it."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


@dataclass(frozen=True)
class Declaration:
    """How the output declares a configuration: ``plain`` (the main model's quant_algo, BF16 modules excluded) or
    ``mixed`` (MIXED_PRECISION, ``quantized_layers`` listing every quantized MTP module); None: no engine choice
    loads it, with why."""

    kind: Literal["plain", "mixed"] | None
    refusal: str | None = None


def _namespace(module: str) -> str:
    """The MTP namespace a module lies in: ``mtp`` (the Qwen families), or its appended layer ``model.layers.N`` (the
    planner excludes a whole BF16 MTP as ``mtp*`` / ``model.layers.N*``)."""
    return QWEN_MTP_NAMES.namespace.rstrip(".") if QWEN_MTP_NAMES.is_mtp(module) else ".".join(module.split(".")[:3])


def _split_experts(name: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[str, Planned]] | None:
    """A fused 3-D expert tensor as its per-expert Linear weights (None: not one)."""
    stem, _, leaf = name.rpartition(".")
    if not stem.endswith(".mlp.experts") or leaf not in FUSED_EXPERT_PIECES or len(shape) != 3:
        return None
    pieces = FUSED_EXPERT_PIECES[leaf]
    rows = shape[1] // len(pieces)
    return [
        (f"{stem}.{e}.{p}.weight", Planned(dtype, (rows, shape[2]))) for e in range(shape[0]) for p in pieces
    ]


class MtpSpace:
    """The configurations of one MTP (``source``: its ``mtp.*`` tensors as header entries or ``(dtype, shape)``) for
    a family, a main model quantized with ``main_algo`` (``activations``: W4A4, input scales written) and the engines
    that must load the result."""

    def __init__(
        self,
        family: Family,
        source: Mapping[str, Any],
        *,
        main_algo: str = "NVFP4",
        activations: bool = True,
        engines: Sequence[str] = ("vllm",),
        precisions: Sequence[str] = PRECISIONS,
        exclude: Sequence[str] = (),
    ) -> None:
        unknown = [e for e in engines if e not in searched()]
        if unknown:
            raise ValueError(
                f"the search does not apply engine {unknown[0]!r}'s rules (it applies {', '.join(searched())})"
            )
        self.family = family
        self.main_algo = main_algo
        self.activations = activations
        self.engines = tuple(engines)
        self.precisions = tuple(p for p in PRECISIONS if p in precisions or not quantizes(p))
        self.exclude = tuple(exclude)  # the recipe's quantization.exclude: the MTP Linears it matches stay BF16
        self.source: dict[str, Planned] = {}
        self.split: dict[str, list[str]] = {}  # a fused 3-D source tensor -> the per-expert weights it holds
        for name, entry in sorted(source.items()):
            dtype, shape = (entry.dtype, tuple(entry.shape)) if hasattr(entry, "dtype") else (entry[0], tuple(entry[1]))
            pieces = _split_experts(name, dtype, shape)
            if pieces is None:
                self.source[name] = Planned(dtype, shape)
                continue
            self.split[name] = [n for n, _ in pieces]
            self.source.update(pieces)
        self.modules = linear_modules(self.source)
        layout = family.mtp
        found: dict[str, list[str]] = {g.key: [] for g in layout.groups}
        for m in self.modules:
            group = layout.group_of(m)
            if group is not None:
                found[group.key].append(m)
        self.groups: tuple[MtpGroup, ...] = tuple(g for g in layout.groups if found[g.key])
        self.members: dict[str, tuple[str, ...]] = {g.key: tuple(found[g.key]) for g in self.groups}

    @property
    def group_keys(self) -> tuple[str, ...]:
        """The groups this MTP has, in the family's order."""
        return tuple(g.key for g in self.groups)

    @property
    def bf16(self) -> Assignment:
        """The source MTP: every group BF16."""
        return Assignment.uniform(self.group_keys, "bf16")

    def fixed_groups(self) -> tuple[str, ...]:
        """The groups the recipe's ``quantization.exclude`` keeps BF16 (one of their Linears matched), in order."""
        return tuple(k for k in self.group_keys if any(recipe_excludes(self.exclude, m) for m in self.members[k]))

    def group(self, key: str) -> MtpGroup:
        """The registry's group ``key``."""
        return next(g for g in self.groups if g.key == key)

    def module_precision(self, assignment: Assignment) -> dict[str, str]:
        """Every MTP Linear in a group -> its precision under ``assignment`` (``quantize_mtp``'s ``precision``)."""
        return {m: assignment[g] for g, members in self.members.items() for m in members}

    # ---- what a configuration writes -------------------------------------------------------------------
    def planned_table(self, assignment: Assignment) -> dict[str, Planned]:
        """Every ``mtp.*`` tensor the configuration writes, with its dtype and shape (what ``quantize_mtp`` makes of
        it; a group in BF16 keeps the source's tensors, fused 3-D experts fused)."""
        precision = self.module_precision(assignment)
        quantized = {m for m, p in precision.items() if quantizes(p)}
        out: dict[str, Planned] = {}
        for name, entry in self.source.items():
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            kind = precision_kind(precision.get(module or "", UNQUANTIZED))
            if kind is None:
                out[name] = entry
                continue
            rows, cols = entry.shape
            for suffix, (dtype, shape) in kind.planned(rows, cols, self.activations).items():
                out[f"{module}.{suffix}"] = Planned(dtype, shape)
        for fused, pieces in self.split.items():  # experts left in BF16 stay the source's fused tensors
            if not any(p[: -len(".weight")] in quantized for p in pieces):
                for p in pieces:
                    del out[p]
                leaf = fused.rpartition(".")[2]
                first = self.source[pieces[0]]
                experts = len(pieces) // len(FUSED_EXPERT_PIECES[leaf])
                out[fused] = Planned(first.dtype, (experts, first.shape[0] * len(FUSED_EXPERT_PIECES[leaf]),
                                                   first.shape[1]))
        return dict(sorted(out.items()))

    def nbytes(self, assignment: Assignment) -> int:
        """The MTP's bytes on disk under ``assignment`` (tensor data, as ``total_size`` counts it)."""
        return sum(t.nbytes for t in self.planned_table(assignment).values())

    def group_bytes(self, key: str, precision: str) -> int:
        """The bytes of group ``key``'s Linears in ``precision`` (the rest of the MTP left out)."""
        table = self.planned_table(self.bf16.with_group(key, precision))
        members = set(self.members[key])

        def of_group(name: str) -> bool:  # a member's tensor, or a fused source tensor holding members (BF16)
            pieces = self.split.get(name, [name])
            return any(p.rsplit(".", 1)[0] in members for p in pieces)

        return sum(t.nbytes for n, t in table.items() if of_group(n))

    # ---- which configurations exist --------------------------------------------------------------------
    def refusal(self, key: str, precision: str) -> str | None:
        """Why group ``key`` cannot be stored in ``precision`` at all (None: it can): not a precision searched, an
        NVFP4 block that does not divide a Linear's input, FP8 beside a weight-only recipe (no input scales)."""
        if precision not in self.precisions:
            return f"{precision} is not searched"
        kind = precision_kind(precision)
        if kind is None:
            return None
        kept = next((m for m in self.members[key] if recipe_excludes(self.exclude, m)), None)
        if kept is not None:
            return f"{kept}: the recipe's quantization.exclude keeps it BF16"
        if kind.static_inputs and not self.activations:
            return f"{kind.label} needs input scales, and the recipe quantizes weights only"
        if (block := kind.group_size) is not None:
            odd = next((m for m in self.members[key] if self.source[m + ".weight"].shape[-1] % block), None)
            if odd is not None:
                return f"{odd}: input dimension {self.source[odd + '.weight'].shape[-1]} is not a multiple of {block}"
        return None

    def metadata(self, assignment: Assignment, kind: str) -> QuantMetadata:
        """The quantization metadata the output would carry for ``assignment`` (MTP entries only)."""
        precision = self.module_precision(assignment)
        disk = self.disk_precision(assignment)
        plain = tuple(sorted(m for m, p in disk.items() if not is_quantized(p)))
        if len(plain) == len(disk):  # the planner's rule: a whole-BF16 MTP is excluded as its namespace's pattern
            plain = tuple(sorted({_namespace(m) + "*" for m in disk}))
        if kind == "plain":
            return QuantMetadata("modelopt", self.main_algo, BLOCK, None, plain)
        layers = {m: layer_entry(p, self.main_algo) for m, p in sorted(precision.items()) if quantizes(p)}
        return QuantMetadata("modelopt", "MIXED_PRECISION", None, None, plain, layers)

    def disk_precision(self, assignment: Assignment) -> dict[str, str]:
        """Every MTP Linear -> its precision on disk under ``assignment`` (the one rule, ``linear_precisions``, read
        from the planned table; fused BF16 experts as their per-expert members)."""
        table = self.planned_table(assignment)
        disk = linear_precisions(table)
        for fused, pieces in self.split.items():
            if fused in disk:
                precision = disk.pop(fused)
                disk.update({p[: -len(".weight")]: precision for p in pieces})
        return disk

    def declaration(self, assignment: Assignment) -> Declaration:
        """How the output declares ``assignment`` so that every chosen engine loads it: ``plain`` where they all load
        that, else ``mixed``; ``Declaration(None, why)`` when neither loads in some engine."""
        refusals = [r for g, p in zip(assignment.groups, assignment.precisions) if (r := self.refusal(g, p))]
        if refusals:
            return Declaration(None, refusals[0])
        disk = self.disk_precision(assignment)
        rules = self.family.engine
        why = ""
        kinds: tuple[Literal["plain", "mixed"], ...] = ("plain", "mixed")
        for kind in kinds:
            meta = self.metadata(assignment, kind)
            refusal = next((r for e in self.engines if (r := mtp_load_refusal(e, disk, meta, rules))), None)
            if refusal is None:
                return Declaration(kind)
            why = refusal
        return Declaration(None, why)

    def configurations(self) -> list[Assignment]:
        """Every configuration the chosen engines load, smallest first (then in the family's group order)."""
        found = [
            a
            for combo in itertools.product(self.precisions, repeat=len(self.groups))
            if self.declaration(a := Assignment(self.group_keys, combo)).kind is not None  # type: ignore[arg-type]
        ]
        return sorted(found, key=lambda a: (self.nbytes(a), [PRECISIONS.index(p) for p in a.precisions]))

    def loadable(self, assignments: Iterable[Assignment]) -> list[Assignment]:
        """The ones of ``assignments`` the chosen engines load."""
        return [a for a in assignments if self.declaration(a).kind is not None]
