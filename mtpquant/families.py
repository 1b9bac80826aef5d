"""The family registry: everything mtpquant knows about each supported Qwen architecture.

Architecture knowledge lives here and nowhere else: recognition from ``config.json``, tensor
prefixes, how the MTP is declared, the exact MTP tensor set and shapes, the fused-scale groups and
the modules NVFP4 must leave unquantized. Other modules ask the registry instead of testing
``model_type`` themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from mtpquant.errors import ConfigError, UnsupportedArchitectureError

__all__ = [
    "FAMILIES",
    "FUSED_EXPERT_PIECES",
    "Family",
    "ModelSpec",
    "MtpDeclaration",
    "TensorClass",
    "classify_tensor",
    "dimension_differences",
    "is_mtp_name",
    "resolve",
    "supported_architectures",
]

MTP_PREFIX = "mtp."
VISION_PREFIX = "model.visual."


# transformers' fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]): per expert, the
# per-expert Linears it concatenates along the rows, in this order (the gate first), experts stacked in order.
FUSED_EXPERT_PIECES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def is_mtp_name(name: str) -> bool:
    """Anchored MTP test: ``mtp.`` at the start of the name, never a substring match."""
    return name.startswith(MTP_PREFIX)


@dataclass(frozen=True)
class Family:
    """One supported architecture family and the facts that differ between families."""

    key: str
    display: str
    # (model_type, architecture) pairs this family answers to; wrapper configs carry `text_config`.
    model_types: frozenset[str]
    architectures: frozenset[str]
    moe: bool
    # Main-model tensor prefixes: the wrapper layout first, then text-only re-exports.
    wrapper_prefix: str
    text_only_prefixes: tuple[str, ...]
    has_vision: bool
    # Config key that declares the MTP depth (inside text_config for wrappers); None: undeclared.
    mtp_key: str | None
    mtp_default_layers: int
    # transformers classes used to load the main model.
    wrapper_class: str | None
    text_class: str
    # Linear module name suffixes that share one input (and so one weight_scale_2 / input_scale).
    fused_groups: tuple[tuple[str, ...], ...]
    # Module-name patterns (fnmatch, relative to the full tensor name) NVFP4 leaves unquantized.
    unquantized: tuple[str, ...]
    # Whether main-model experts are stored fused 3-D (`experts.gate_up_proj`) on disk.
    fused_main_experts: bool


_COMMON_UNQUANTIZED = (
    "lm_head",
    "*embed_tokens",
    "*.mlp.gate",
    "*.shared_expert_gate",
    "*linear_attn.conv1d",
    "model.visual*",
    "mtp*",
)

FAMILIES: tuple[Family, ...] = (
    Family(
        key="qwen3_5",
        display="Qwen3.5 / Qwen3.6 dense",
        model_types=frozenset({"qwen3_5", "qwen3_5_text"}),
        architectures=frozenset({"Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"}),
        moe=False,
        wrapper_prefix="model.language_model.",
        text_only_prefixes=("model.language_model.", "model."),
        has_vision=True,
        mtp_key="mtp_num_hidden_layers",
        mtp_default_layers=0,
        wrapper_class="Qwen3_5ForConditionalGeneration",
        text_class="Qwen3_5ForCausalLM",
        fused_groups=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("mlp.gate_proj", "mlp.up_proj"),
            ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
        ),
        unquantized=(*_COMMON_UNQUANTIZED, "*linear_attn.in_proj_a", "*linear_attn.in_proj_b"),
        fused_main_experts=False,
    ),
    Family(
        key="qwen3_5_moe",
        display="Qwen3.5 / Qwen3.6 MoE",
        model_types=frozenset({"qwen3_5_moe", "qwen3_5_moe_text"}),
        architectures=frozenset({"Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"}),
        moe=True,
        wrapper_prefix="model.language_model.",
        text_only_prefixes=("model.language_model.", "model."),
        has_vision=True,
        mtp_key="mtp_num_hidden_layers",
        mtp_default_layers=0,
        wrapper_class="Qwen3_5MoeForConditionalGeneration",
        text_class="Qwen3_5MoeForCausalLM",
        fused_groups=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("shared_expert.gate_proj", "shared_expert.up_proj"),
            ("gate_proj", "up_proj"),
            ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
        ),
        unquantized=(*_COMMON_UNQUANTIZED, "*linear_attn.in_proj_a", "*linear_attn.in_proj_b"),
        fused_main_experts=True,
    ),
    Family(
        key="qwen3_next",
        display="Qwen3-Next",
        model_types=frozenset({"qwen3_next"}),
        architectures=frozenset({"Qwen3NextForCausalLM"}),
        moe=True,
        wrapper_prefix="model.",
        text_only_prefixes=("model.",),
        has_vision=False,
        mtp_key=None,
        mtp_default_layers=1,
        wrapper_class=None,
        text_class="Qwen3NextForCausalLM",
        fused_groups=(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("shared_expert.gate_proj", "shared_expert.up_proj"),
            ("gate_proj", "up_proj"),
        ),
        unquantized=(*_COMMON_UNQUANTIZED, "*linear_attn.in_proj_ba"),
        fused_main_experts=False,
    ),
)


def supported_architectures() -> list[str]:
    """Every architecture name the registry accepts, sorted."""
    return sorted(a for f in FAMILIES for a in f.architectures)


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
        value = self.text.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: text config key {key!r} is missing or not an integer")
        return value

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
        if self.wrapped:
            return self.family.wrapper_prefix
        names = list(names)
        for prefix in self.family.text_only_prefixes:
            if any(n.startswith(prefix + "layers.") for n in names):
                return prefix
        return self.family.text_only_prefixes[0]

    # ---- MTP --------------------------------------------------------------------------------
    def expected_mtp_shapes(self) -> dict[str, tuple[int, ...]]:
        """The exact ``mtp.*`` tensor names and shapes this config implies (empty if undeclared)."""
        if not self.mtp.declared:
            return {}
        H = self.hidden_size
        heads, kv = self.dim("num_attention_heads"), self.dim("num_key_value_heads")
        hd = self.dim("head_dim")
        gate = 2 if self.text.get("attn_output_gate", True) else 1
        shapes: dict[str, tuple[int, ...]] = {
            "mtp.fc.weight": (H, 2 * H),
            "mtp.pre_fc_norm_embedding.weight": (H,),
            "mtp.pre_fc_norm_hidden.weight": (H,),
            "mtp.norm.weight": (H,),
        }
        for i in range(self.mtp.layers):
            p = f"mtp.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (gate * heads * hd, H),
                p + "self_attn.k_proj.weight": (kv * hd, H),
                p + "self_attn.v_proj.weight": (kv * hd, H),
                p + "self_attn.o_proj.weight": (H, heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
            }
            if self.family.moe:
                E, inter = self.dim("num_experts"), self.dim("moe_intermediate_size")
                shared = self.dim("shared_expert_intermediate_size")
                shapes |= {
                    p + "mlp.gate.weight": (E, H),
                    p + "mlp.shared_expert.gate_proj.weight": (shared, H),
                    p + "mlp.shared_expert.up_proj.weight": (shared, H),
                    p + "mlp.shared_expert.down_proj.weight": (H, shared),
                    p + "mlp.shared_expert_gate.weight": (1, H),
                }
                for e in range(E):
                    q = f"{p}mlp.experts.{e}."
                    shapes |= {
                        q + "gate_proj.weight": (inter, H),
                        q + "up_proj.weight": (inter, H),
                        q + "down_proj.weight": (H, inter),
                    }
            else:
                inter = self.dim("intermediate_size")
                shapes |= {
                    p + "mlp.gate_proj.weight": (inter, H),
                    p + "mlp.up_proj.weight": (inter, H),
                    p + "mlp.down_proj.weight": (H, inter),
                }
        return shapes

    def classify(self, name: str, main_prefix: str | None = None) -> str:
        """Class of one tensor name: main / mtp / vision / embed / lm_head / other."""
        return classify_tensor(name, main_prefix or self.main_prefix, self.family.has_vision)


@lru_cache(maxsize=32)
def tensor_classifier(main_prefix: str, has_vision: bool = True) -> Callable[[str], str]:
    """The class of a tensor name given the main-model prefix, as one function (a table classifies every name)."""
    embed = main_prefix + "embed_tokens."
    vision = VISION_PREFIX if has_vision else None

    def classify(name: str) -> str:
        if is_mtp_name(name):
            return TensorClass.MTP
        if vision is not None and name.startswith(vision):
            return TensorClass.VISION
        if name.startswith("lm_head."):
            return TensorClass.LM_HEAD
        if name.startswith(main_prefix):
            return TensorClass.EMBED if name.startswith(embed) else TensorClass.MAIN
        return TensorClass.OTHER

    return classify


def classify_tensor(name: str, main_prefix: str, has_vision: bool = True) -> str:
    """Class of a tensor name given the main-model prefix."""
    return tensor_classifier(main_prefix, has_vision)(name)


def _identify(config: Mapping[str, Any]) -> tuple[Family, str]:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ConfigError("config.json: 'architectures' must be a list")
    for family in FAMILIES:
        for arch in architectures:
            if arch in family.architectures:
                return family, arch
    for family in FAMILIES:
        if model_type in family.model_types:
            text = model_type.endswith("_text") or family.wrapper_class is None
            return family, family.text_class if text else str(family.wrapper_class)
    found = ", ".join(map(str, architectures)) or f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"config.json: unsupported architecture {found}; supported: {', '.join(supported_architectures())}"
    )


def resolve(config: Mapping[str, Any]) -> ModelSpec:
    """Resolve a ``config.json`` mapping into a ModelSpec, or fail listing what is supported."""
    if not isinstance(config, Mapping):
        raise ConfigError("config.json: top level must be a JSON object")
    family, arch = _identify(config)
    wrapped = isinstance(config.get("text_config"), Mapping)
    text: Mapping[str, Any] = config["text_config"] if wrapped else config
    if family.mtp_key is None:
        mtp = MtpDeclaration(family.mtp_default_layers, None, None)
    else:
        value = text.get(family.mtp_key)
        where = f"text_config.{family.mtp_key}" if wrapped else family.mtp_key
        if value is None:
            mtp = MtpDeclaration(0, None, None)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            mtp = MtpDeclaration(value, where, value)
        else:
            raise ConfigError(f"config.json: {where} must be a non-negative integer, got {value!r}")
    return ModelSpec(family=family, architecture=arch, config=config, text=text, wrapped=wrapped, mtp=mtp)


# ---- two checkpoints of the same model ----------------------------------------------------------------------------
# Dimensions that must agree for two checkpoints to be the same model (missing in either: a mismatch); graft
# checks them before it puts one's MTP into the other, validate before it compares one against the other.
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
# Compared only where both configs have them (some exporters drop keys they do not use).
_EXTRA_KEYS = (
    "num_experts_per_tok",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "full_attention_interval",
    "attn_output_gate",
    "layer_types",
)


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def dimension_differences(a: Mapping[str, Any], b: Mapping[str, Any], moe: bool) -> list[str]:
    """``"key A vs B"`` for every model dimension in which two text configs differ (empty: the same shapes)."""
    core = _CORE_KEYS + (_MOE_KEYS if moe else _DENSE_KEYS)
    diffs = [f"{k} {_fmt(a.get(k))} vs {_fmt(b.get(k))}" for k in core if a.get(k) != b.get(k)]
    diffs += [f"{k} {_fmt(a[k])} vs {_fmt(b[k])}" for k in _EXTRA_KEYS if k in a and k in b and a[k] != b[k]]
    return diffs
