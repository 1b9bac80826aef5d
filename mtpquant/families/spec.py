"""A family resolved against one ``config.json``: the ``ModelSpec`` (dimensions, prefixes, MTP declaration and
inventory) and the header table's tensor classes. Recognition goes through the registry (``FAMILIES``)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, TypeVar

from mtpquant.errors import (
    ConfigError,
    MtpConfigError,
    MtpNeverShippedError,
    MtpquantError,
    NotAnMtpError,
    UnsupportedArchitectureError,
)
from mtpquant.families.generic import declares_mtp, generic_family
from mtpquant.families.mtp_config import MtpConfig, config_int
from mtpquant.families.nextn import NEXTN_FAMILIES
from mtpquant.families.others import OTHER_FAMILIES
from mtpquant.families.qwen3 import QWEN3_FAMILIES
from mtpquant.families.qwen4_exp import QWEN4_EXP
from mtpquant.families.released import RELEASED_FAMILIES
from mtpquant.families.schema import MTP_PREFIX, NEVER_SHIPPED, SUPPORTED, UNKNOWN, Family
from mtpquant.families.storage import APPENDED, NAMESPACE, MtpNames

__all__ = [
    "FAMILIES",
    "QWEN_MTP_NAMES",
    "VISION_PREFIX",
    "ModelSpec",
    "MtpDeclaration",
    "TensorClass",
    "check_mtp_forward",
    "classify_tensor",
    "dimension_differences",
    "group_by_class",
    "mtp_config",
    "nested_key",
    "resolve",
    "supported_architectures",
    "surgery_refusal",
    "tensor_classifier",
]

VISION_PREFIX = "model.visual."
V = TypeVar("V")

FAMILIES: tuple[Family, ...] = (*QWEN3_FAMILIES, QWEN4_EXP, *NEXTN_FAMILIES, *OTHER_FAMILIES, *RELEASED_FAMILIES)

_PER_EXPERT_MTP = re.compile(r"\.mlp\.experts\.\d+\.")
# The name test of the ``mtp.`` namespace (Qwen's storage): what a caller with no config at hand may assume.
QWEN_MTP_NAMES = MtpNames(NAMESPACE, (MTP_PREFIX + "layers.",), 0, 1, MTP_PREFIX)


def supported_architectures() -> list[str]:
    """Every canonical architecture name the registry accepts, sorted (day-0 aliases are accepted too)."""
    return sorted(a for f in FAMILIES for a in f.architectures if a not in f.aliases)


@dataclass(frozen=True)
class MtpDeclaration:
    """How (and whether) a config declares the MTP layer."""

    layers: int
    key: str | None  # the config key, e.g. "text_config.mtp_num_hidden_layers"; None: family default
    value: Any

    @property
    def declared(self) -> bool:
        """True when engines will expect MTP tensors."""
        return self.layers > 0

    def describe(self) -> str:
        """Human form, e.g. ``text_config.mtp_num_hidden_layers = 1``."""
        if self.key is None:
            if self.layers == 0:
                return "not declared"
            return f"not in config (engines default to {self.layers} layer)"
        return f"{self.key} = {self.value!r}"


class TensorClass:
    """Tensor classes used by the header table."""

    MAIN = "main"
    MTP = "mtp"
    VISION = "vision"
    EMBED = "embed"
    LM_HEAD = "lm_head"
    OTHER = "other"


@dataclass(frozen=True)
class ModelSpec:
    """A family resolved against one config: dimensions, prefixes and the expected MTP tensor set."""

    family: Family
    architecture: str
    config: Mapping[str, Any] = field(repr=False)
    text: Mapping[str, Any] = field(repr=False)
    wrapped: bool
    mtp: MtpDeclaration

    # ---- dimensions -------------------------------------------------------------------------
    def dim(self, key: str) -> int:
        """An integer dimension of the text config, or a one-line error naming the key."""
        return config_int(self.text, key)

    @property
    def hidden_size(self) -> int:
        """Hidden size H."""
        return self.dim("hidden_size")

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for dense)."""
        return self.dim("num_experts") if self.family.moe else 0

    @property
    def tied_embeddings(self) -> bool:
        """Whether ``lm_head`` shares ``embed_tokens`` (then no ``lm_head.weight`` on disk)."""
        value = self.config.get("tie_word_embeddings", self.text.get("tie_word_embeddings", False))
        return bool(value)

    @property
    def main_prefix(self) -> str:
        """Main-model prefix for the wrapper layout (text-only re-exports: see ``main_prefix_for``)."""
        return self.family.wrapper_prefix

    def main_prefix_for(self, names: Iterable[str]) -> str:
        """The main-model prefix actually used by a tensor name set (text-only exports vary)."""
        if self.wrapped and self.family.status != UNKNOWN:  # an unknown family's prefix is whatever its names use
            return self.family.wrapper_prefix
        names = list(names)
        for prefix in self.family.text_only_prefixes:
            if any(n.startswith(prefix + "layers.") for n in names):
                return prefix
        return self.family.text_only_prefixes[0]

    def declaration_path(self, key: str) -> str:
        """Where a text-config key lives in config.json (``text_config.KEY`` for wrappers)."""
        return f"text_config.{key}" if self.wrapped else key

    def aliases(self) -> list[tuple[str, str, str]]:
        """Day-0 labels in this config: (where, alias, canonical), e.g. ``("architectures[0]", "Qwen3_8Flash...",
        "Qwen4Exp...")``; empty for a config that uses the canonical names."""
        found: list[tuple[str, str, str]] = []
        aliases = self.family.aliases
        for i, arch in enumerate(self.config.get("architectures") or []):
            if arch in aliases:
                found.append((f"architectures[{i}]", arch, aliases[arch]))
        for where, sub in (("", self.config), ("text_config.", self.config.get("text_config"))):
            if isinstance(sub, Mapping) and sub.get("model_type") in aliases:
                found.append((f"{where}model_type", sub["model_type"], aliases[sub["model_type"]]))
        return found

    # ---- MTP --------------------------------------------------------------------------------
    def expected_mtp_shapes(self, present: Iterable[str] | None = None) -> dict[str, tuple[int, ...]]:
        """The exact ``mtp.*`` tensor names and shapes this config implies (empty if undeclared).

        ``present``: the MTP names a checkpoint holds; where the family accepts either expert form (a fused 3-D
        pair or a per-expert bank), the form those names use is expected. Without it, the family's own form.
        """
        if not self.mtp.declared:
            return {}
        layout = self.family.mtp
        per_expert = layout.per_expert
        if present is not None:
            present = list(present)
        if layout.either_expert_form and present is not None:
            per_expert = any(_PER_EXPERT_MTP.search(n) for n in present)
        text = {**self.text, "num_hidden_layers": 0} if self.nextn_standalone else self.text
        shapes = layout.shapes(text, self.mtp.layers, per_expert)
        if layout.storage.kind == APPENDED and (prefix := self.appended_prefix(present)) != "model.":
            shapes = {prefix + n[len("model.") :]: s for n, s in shapes.items()}  # written as model.layers.{N+i}.
        if layout.copies and (not layout.copies_required or self.nextn_standalone):  # the NextN export drops them
            copies = tuple("." + c for c in layout.copies)
            if present is None or not any(n.endswith(copies) for n in present):  # all or none, as the source has them
                shapes = {n: s for n, s in shapes.items() if not n.endswith(copies)}
        return shapes

    def classify(self, name: str, main_prefix: str | None = None) -> str:
        """Class of one tensor name: main / mtp / vision / embed / lm_head / other."""
        return tensor_classifier(main_prefix or self.main_prefix, self.family.has_vision, self.mtp_names)(name)

    # ---- where the MTP lives --------------------------------------------------------------------------------------
    @property
    def nextn_standalone(self) -> bool:
        """A standalone MTP export (SGLang's NextN form): ``num_hidden_layers`` 1, the MTP at layer 0, no copies."""
        return self.architecture == self.family.nextn_architecture

    @cached_property
    def mtp_names(self) -> MtpNames:
        """The family's MTP name test resolved against this config (the trunk's layer count for appended layers; 0 for
        a standalone NextN export, whose one layer is the MTP: SGLang's deepseek_nextn.py takes layer 0 then)."""
        storage = self.family.mtp.storage
        first = 0 if self.nextn_standalone else self.dim("num_hidden_layers") if storage.kind == APPENDED else 0
        sublayers = 1
        for key in storage.sublayers_key:
            pattern = self.text.get(key)
            if isinstance(pattern, (str, list)) and pattern:
                sublayers = len(pattern)
                break
        return storage.resolve(self.family.text_only_prefixes, first, sublayers)

    def appended_prefix(self, present: Iterable[str] | None = None) -> str:
        """Where appended MTP layers sit: under the prefix ``present`` (MTP names) uses, else the wrapper's prefix for
        a wrapper config (GLM-5.3-Flash: ``model.language_model.``), else ``model.``."""
        for name in present or ():
            for root in self.mtp_names.roots:
                if name.startswith(root):
                    return root[: -len("layers.")]
        return self.family.wrapper_prefix if self.wrapped else "model."

    def mtp_rename_to(self, other: ModelSpec) -> Callable[[str], str]:
        """This checkpoint's MTP names as ``other`` (a checkpoint of the same family) numbers its MTP layers: a
        standalone NextN export's layer 0 becomes the model's layer ``num_hidden_layers``; the identity otherwise."""
        mine, theirs = self.mtp_names, other.mtp_names
        if mine.kind != APPENDED or mine.first == theirs.first:
            return lambda name: name

        def rename(name: str) -> str:
            prefix = mine.layer_prefix(name)
            depth = mine.depth_of(name)
            if prefix is None or depth is None:
                return name
            return f"{theirs.roots[0]}{theirs.first + depth}.{name[len(prefix) :]}"

        return rename

    def mtp_unexpected(
        self, present: Iterable[str], expected: Iterable[str], module_of: Callable[[str], str] = str
    ) -> list[str]:
        """The MTP tensors of ``present`` the layout does not account for (sorted): those whose module (``module_of``;
        by default the name itself) the expected set lacks; where the inventory is the glue only, those outside the
        declared layers; none where it is presence only."""
        inventory = self.family.mtp.inventory
        if inventory == "none":
            return []
        modules = {module_of(n) for n in expected}
        names = self.mtp_names
        depth = self.mtp.layers
        out = []
        for n in present:
            if module_of(n) in modules:
                continue
            if inventory == "glue" and (d := names.depth_of(n)) is not None and d < depth:
                continue
            out.append(n)
        return sorted(out)

    def is_mtp(self, name: str) -> bool:
        """Whether a tensor or module name belongs to the MTP (the family's storage; anchored, never a substring)."""
        return self.mtp_names.is_mtp(name)

    def mtp_depth(self, names: Iterable[str]) -> int:
        """The MTP depth a set of MTP tensor names holds (Nemotron-H: sub-layers per depth counted as one)."""
        return self.mtp_names.depth(names)

    def mtp_borrowed_head(self, names: Iterable[str]) -> tuple[str, str] | None:
        """``(head, "lm_head")``: the MTP head module vLLM's drafter builds and fills with the target's ``lm_head``
        where the family's drafter does (``EngineRules.head_from_target``) and ``names`` (a table's tensor names) hold
        ``lm_head.weight`` but no head of the MTP layer's own; None otherwise."""
        leaf, first = self.family.engine.head_from_target, self.mtp_names.first
        if not leaf or not self.mtp.declared or not first:
            return None
        names = set(names)
        head = f"{self.appended_prefix(n for n in names if self.is_mtp(n))}layers.{first}.{leaf}"
        return (head, "lm_head") if "lm_head.weight" in names and head + ".weight" not in names else None

    def engine_mtp_name(self, name: str) -> str:
        """An MTP module name as the engine's draft builds it (for its quantization rules)."""
        return self.family.mtp.engine_name(name, self.mtp_names.first or self._layers_or_zero())

    def _layers_or_zero(self) -> int:
        value = self.text.get("num_hidden_layers")
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def mtp_exclusion_patterns(self, layers: int | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The exclusion patterns that cover the whole MTP of ``layers`` depths (default: the declared depth) in
        every form the engines match, as (ModelOpt ``exclude_modules`` / ``ignore`` patterns, compressed-tensors
        ``ignore`` patterns): ``mtp*`` and ``re:^mtp\\..*`` for the ``mtp.`` namespace, with TensorRT-LLM's
        ``model.layers.<num_hidden_layers + i>*`` where it drafts the family (``engine/trtllm.py``); one per
        appended layer, ``model.layers.61*``, plus the engine's own form of the name where its draft renames the layer
        (GLM-5.3-Flash: ``model.language_model.layers.45*`` and ``model.layers.45*``)."""
        names = self.mtp_names
        depth = self.mtp.layers if layers is None else layers
        if names.kind != APPENDED:
            stem = names.namespace.rstrip(".")
            modelopt, ct = [f"{stem}*"], [f"re:^{re.escape(names.namespace)}.*"]
            # TensorRT-LLM builds the namespace's layers as model.layers.<num_hidden_layers + i> (its weight mapper)
            # and matches exclusions on those names: its form too, where it drafts the family's MTP
            n = self._layers_or_zero()
            if self.family.engine.drafters.get("trtllm") and stem == "mtp" and n:
                modelopt += [f"model.layers.{n + i}*" for i in range(max(depth, 1))]
            # where the engine's draft builds a layer under another name (MiMo-7B, ERNIE, HY-V4, LongCat, DeepSeek-V4:
            # model.layers.{k}), that name too: the exclusions are matched against the draft's module names
            for i in range(depth * names.sublayers):
                for root in names.roots:
                    engine = self.engine_mtp_name(f"{root}{i}.x")[:-2]
                    if not engine.startswith(names.namespace) and f"{engine}*" not in modelopt:
                        modelopt.append(f"{engine}*")
                        ct.append(f"re:^{re.escape(engine)}\\..*")
            return tuple(modelopt), tuple(ct)
        prefix = self.appended_prefix()
        stems: list[str] = []
        for i in range(depth):
            stem = f"{prefix}layers.{names.first + i}"
            engine = self.engine_mtp_name(stem + ".x")[:-2]
            stems += [stem] + ([] if engine.startswith(stem + ".") or engine == stem else [engine])
        return tuple(f"{s}*" for s in stems), tuple(f"re:^{re.escape(s)}\\..*" for s in stems)


@lru_cache(maxsize=32)
def tensor_classifier(
    main_prefix: str, has_vision: bool = True, names: MtpNames = QWEN_MTP_NAMES
) -> Callable[[str], str]:
    """The class of a tensor name given the main-model prefix and the family's MTP name test (``names``: the
    ``mtp.`` namespace unless given), as one function (a table classifies every name). The MTP test comes first:
    an appended MTP layer sits under the main prefix."""
    embed = main_prefix + "embed_tokens."
    vision = VISION_PREFIX if has_vision else None
    is_mtp = names.matcher

    def classify(name: str) -> str:
        if is_mtp(name):
            return TensorClass.MTP
        if vision is not None and name.startswith(vision):
            return TensorClass.VISION
        if name.startswith("lm_head."):
            return TensorClass.LM_HEAD
        if name.startswith(main_prefix):
            return TensorClass.EMBED if name.startswith(embed) else TensorClass.MAIN
        return TensorClass.OTHER

    return classify


def group_by_class(
    tensors: Mapping[str, V], main_prefix: str, has_vision: bool = True, names: MtpNames = QWEN_MTP_NAMES
) -> dict[str, dict[str, V]]:
    """``tensors`` (a table: name -> entry) by class (``tensor_classifier``), each group in the table's order. Where
    the MTP test reads a fixed prefix (``MtpNames.prefix_width``) every test does, so a name's class is that of its
    first characters up to the longest prefix tested: the classifier runs once per distinct head (a few thousand in a
    table of ~300,000 names), not once per name."""
    classify = tensor_classifier(main_prefix, has_vision, names)
    groups: dict[str, dict[str, V]] = defaultdict(dict)
    width = names.prefix_width
    if width is None:
        for name, value in tensors.items():
            groups[classify(name)][name] = value
        return dict(groups)
    width = max(width, len(VISION_PREFIX) if has_vision else 0, len("lm_head."), len(main_prefix + "embed_tokens."))
    memo: dict[str, str] = {}
    for name, value in tensors.items():
        head = name[:width]
        cls = memo.get(head)
        if cls is None:
            cls = memo[head] = classify(head)
        groups[cls][name] = value
    return dict(groups)


def classify_tensor(name: str, main_prefix: str, has_vision: bool = True, names: MtpNames = QWEN_MTP_NAMES) -> str:
    """Class of a tensor name given the main-model prefix (and the family's MTP name test)."""
    return tensor_classifier(main_prefix, has_vision, names)(name)


def _identify(config: Mapping[str, Any], names: Iterable[str] | None = None) -> tuple[Family, str]:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ConfigError("config.json: 'architectures' must be a list")
    for family in FAMILIES:
        for arch in architectures:
            if arch in family.architectures:
                return family, arch
    for family in FAMILIES:  # a standalone MTP export: the model type says whose (V3 and V3.2 share the class)
        if family.nextn_architecture in architectures and model_type in family.model_types:
            return family, str(family.nextn_architecture)
    for family in FAMILIES:
        if model_type in family.model_types:
            text = model_type.endswith("_text") or family.wrapper_class is None
            return family, family.text_class if text else str(family.wrapper_class)
    found = ", ".join(map(str, architectures)) or f"model_type {model_type!r}"
    if declares_mtp(config):  # release day: the generic checks for the storage the tensors show
        generic = generic_family(config, names)
        return generic, generic.text_class
    raise UnsupportedArchitectureError(
        f"config.json: unsupported architecture {found}; supported: {', '.join(supported_architectures())}"
    )


def nested_key(config: Mapping[str, Any], key: str) -> Any:
    """The value of a dotted depth key (``mtp_config.num_nextn_predict_layers``: Inkling's), read from config.json's
    top level; None where any step is missing."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _declaration(family: Family, config: Mapping[str, Any], text: Mapping[str, Any], wrapped: bool) -> MtpDeclaration:
    for key in family.mtp.depth_keys:
        dotted = "." in key or family.mtp.depth_at_top  # a path from config.json's top level
        value = nested_key(config, key) if dotted else text.get(key)
        if value is None:
            continue
        where = key if dotted or not wrapped else f"text_config.{key}"
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return MtpDeclaration(value, where, value)
        raise ConfigError(f"config.json: {where} must be a non-negative integer, got {value!r}")
    return MtpDeclaration(family.mtp.default_layers, None, None)


def resolve(config: Mapping[str, Any], names: Iterable[str] | None = None) -> ModelSpec:
    """Resolve a ``config.json`` mapping into a ModelSpec, or fail listing what is supported. ``names`` (the
    checkpoint's tensor names) matter only for an architecture the registry does not know whose config declares an MTP:
    they show where its MTP is (``families.generic``)."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json: top level must be a JSON object")
    family, arch = _identify(config, names)
    wrapped = isinstance(config.get("text_config"), Mapping)
    text: Mapping[str, Any] = config["text_config"] if wrapped else config
    mtp = _declaration(family, config, text, wrapped)
    return ModelSpec(family=family, architecture=arch, config=config, text=text, wrapped=wrapped, mtp=mtp)


def surgery_refusal(family: Family, label: str, what: str) -> MtpquantError | None:
    """The one-line refusal of an MTP surgery (``what``: "graft", "graft --fix-metadata", ...) on ``label`` for a
    family mtpquant does not repair (its own exit code: never shipped, or not an MTP), or None."""
    if family.status == SUPPORTED:
        return None
    if family.status == UNKNOWN:
        return UnsupportedArchitectureError(f"{label}: {what} refused: {family.status_note}; inspect only")
    error = MtpNeverShippedError if family.status == NEVER_SHIPPED else NotAnMtpError
    return error(f"{label}: {what} refused: {family.status_note}")


def check_mtp_forward(config: Mapping[str, Any]) -> ModelSpec:
    """Refuse, in one line, a config whose MTP mtpquant's reference forward cannot compute (a family without one by
    name, the family's own checks, then, for the Qwen forward, whatever ``MtpConfig`` refuses); the resolved spec.
    Every refusal before anything loads."""
    spec = resolve(config)
    family = spec.family
    if not family.mtp_forward:
        raise MtpConfigError(f"mtpquant has no reference MTP forward for {family.display} ({family.key}) yet")
    if family.mtp.config_check is not None:
        family.mtp.config_check(spec.text)
    if family.mtp.appended is None:
        MtpConfig.from_text_config(config)
    return spec


def mtp_config(config: Mapping[str, Any]) -> MtpConfig:
    """The Qwen reference forward's dimensions for ``config``, or one line saying why not (``check_mtp_forward``)."""
    check_mtp_forward(config)
    return MtpConfig.from_text_config(config)


# ---- two checkpoints of one model ------------------------------------------------------------------------------
# Dimensions that must agree for two checkpoints to be the same model (missing in either: a mismatch): graft checks
# them before it puts one's MTP into the other, validate before it compares one against the other.
_CORE_KEYS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
)
_DENSE_KEYS = ("intermediate_size",)
_MOE_KEYS = ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def dimension_differences(a: Mapping[str, Any], b: Mapping[str, Any], family: Family) -> list[str]:
    """``"key A vs B"`` for every model dimension in which two text configs of ``family`` differ (empty: the same
    shapes); the family's ``lineage_keys`` are compared only where both configs have them (some exporters drop keys
    they do not use)."""
    core = _CORE_KEYS + (_MOE_KEYS if family.moe else _DENSE_KEYS)
    diffs = [f"{k} {_fmt(a.get(k))} vs {_fmt(b.get(k))}" for k in core if a.get(k) != b.get(k)]
    extra = ("num_experts_per_tok", *family.lineage_keys)
    diffs += [f"{k} {_fmt(a[k])} vs {_fmt(b[k])}" for k in extra if k in a and k in b and a[k] != b[k]]
    return diffs
