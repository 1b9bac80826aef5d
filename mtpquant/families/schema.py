"""The registry's schema: what one family states about its checkpoints, its MTP and how engines build them.

A family is data. Everything that differs between Qwen generations (recognition from ``config.json``,
tensor prefixes, the MTP tensor inventory and its depth keys, which modules engines build as quantizable
Linears, fused and packed groups, what NVFP4 must leave unquantized, the engine's MTP layer-index remap)
is a field here, filled in by one entry per family (``qwen3.py``, ``qwen4_exp.py``). Code elsewhere asks
the registry and names no MTP tensor itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import translate
from functools import lru_cache
from typing import Any

from mtpquant.families.storage import NAMESPACE, MtpStorage

QWEN_STORAGE = MtpStorage(NAMESPACE)  # the ``mtp.`` namespace: Qwen's, every family's default

__all__ = [
    "MTP_PREFIX",
    "NEVER_SHIPPED",
    "NOT_MTP",
    "RECOGNISED",
    "SEPARATE",
    "SUPPORTED",
    "UNKNOWN",
    "EngineRules",
    "Family",
    "ForcedUnquantized",
    "MtpGroup",
    "MtpLayout",
    "Shapes",
    "is_mtp_name",
    "matches",
    "mtp_layer_count",
]

MTP_PREFIX = "mtp."

# What mtpquant does with a family's MTP (``Family.status``): the whole doctor (inspect, graft, extract,
# --fix-metadata); inspect only, every surgery refused in one line; a drafter that is not an MTP; a declaration whose
# weights were never published.
SUPPORTED = "supported"
RECOGNISED = "recognised"
NOT_MTP = "not_mtp"
NEVER_SHIPPED = "never_shipped"
# The drafter is a model of its own, never stored in the target (Gemma-4's assistant checkpoint): inspect says so and
# the target is judged without an MTP; every surgery refuses in one line (there is nothing of it to graft or extract).
SEPARATE = "separate_drafter"
# An architecture the registry does not know whose config declares an MTP (``families.generic``): inspect's generic
# checks for the storage its tensors show, with one line saying so; every surgery refuses (exit 4).
UNKNOWN = "unknown"

# (text config, MTP depth, per-expert bank) -> every mtp.* tensor name with its shape
Shapes = Callable[[Mapping[str, Any], int, bool], dict[str, tuple[int, ...]]]


def is_mtp_name(name: str) -> bool:
    """The ``mtp.`` namespace test (Qwen's storage), anchored. Right only for a family known to store its MTP there:
    ask ``ModelSpec.is_mtp`` (the family's own storage) wherever a checkpoint is at hand."""
    return name.startswith(MTP_PREFIX)


_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layer_count(names: Iterable[str]) -> int:
    """Number of MTP decoder layers a tensor name set holds (highest ``mtp.layers.N`` + 1)."""
    layers = [int(m.group(1)) for n in names if (m := _MTP_LAYER.match(n))]
    return max(layers) + 1 if layers else 0


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """fnmatch (case-sensitive) of a module name against any of the registry's patterns."""
    return bool(patterns) and _matcher(patterns)(name) is not None


@lru_cache(maxsize=64)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], Any]:
    """The patterns as one compiled regex (fnmatch's own translation): one C call per name."""
    return re.compile("|".join(f"(?:{translate(p)})" for p in patterns)).match


@dataclass(frozen=True)
class MtpGroup:
    """One precision group of a family's MTP: the Linears that take one precision together when the MTP's precision is
    chosen per group (``convert --mtp auto``, ``tune-mtp``). A group holds whole fused and packed groups (q/k/v,
    gate/up, every routed expert: engines build each as one module, so they share one precision)."""

    key: str  # "input" | "attention" | "mlp" | "shared_expert" | "experts"
    label: str  # for reports: "input projection (mtp.fc)"
    # fnmatch on MTP Linear module names, mtp. included (routed experts by their per-expert names)
    modules: tuple[str, ...]


@dataclass(frozen=True)
class MtpLayout:
    """How one family stores and declares its MTP, and which of its modules may be quantized."""

    # Config keys that declare the depth (in text_config for wrappers), in the order engines read them; the first
    # one present wins, the first of all is the one written when a declaration is added. (): no key exists.
    depth_keys: tuple[str, ...]
    # Layers engines assume when no depth key is present (Qwen3-Next: 1; Qwen3.5: 0, the MTP is off).
    default_layers: int
    # Other MTP settings engines read from the same config (kept verbatim by every surgery).
    setting_keys: tuple[str, ...]
    # The inventory: every mtp.* tensor and its shape, from the text config and the depth.
    shapes: Shapes
    # Routed MTP experts as stored by the family's release: a per-expert bank (True) or fused 3-D tensors.
    per_expert: bool
    # Whether the other expert form is accepted too (engines load both).
    either_expert_form: bool
    # MTP modules an engine builds as quantizable Linears / MoE (fnmatch on module names, mtp. included): what a
    # quantized MTP may quantize (less ``unquantized``).
    engine_linears: tuple[str, ...]
    # MTP Linears a quantized MTP keeps in BF16, excluded by exact name (fnmatch on module names).
    unquantized: tuple[str, ...]
    # Leaf names of Linears that read one input and so share one weight_scale_2 / input_scale.
    fused_groups: tuple[tuple[str, ...], ...]
    # Whether the engine renames mtp.layers.i to mtp.layers.{num_hidden_layers + i} in module names and in
    # ignore / quantized_layers entries (vLLM's Qwen4ExpMTP); False: the checkpoint's own indices.
    engine_layer_offset: bool = False
    # The decoder submodule (relative to the text decoder) whose *input* is the MTP's hidden input (Qwen4-Exp: the
    # multi-stream state before the final ``hyper_connection_mixer``); None: the decoder's last_hidden_state (after
    # the final norm, Qwen3.5 / Qwen3-Next).
    hidden_source: str | None = None
    # Torch-free checks of the text config beyond MtpConfig's that the family's reference forward needs (one-line
    # MtpConfigError each), run by ``families.mtp_config`` at plan time; None: none.
    config_check: Callable[[Mapping[str, Any]], None] | None = None
    # Where the MTP tensors live (the storage class); Qwen's own ``mtp.`` namespace by default.
    storage: MtpStorage = QWEN_STORAGE
    # Whether the depth keys sit at config.json's top level even in a wrapper config (EXAONE 4.5: exaone4_5_mtp.py
    # reads config.num_nextn_predict_layers, text_config.num_hidden_layers); a dotted key is always such a path
    depth_at_top: bool = False
    # Copies of the head and the embedding some checkpoints carry inside each MTP layer (leaf names relative to the
    # layer: DeepSeek-V3's and GLM-4.5's ``shared_head.head.weight`` and ``embed_tokens.weight``), all or none.
    copies: tuple[str, ...] = ()
    # Whether the family's checkpoints always carry them (DeepSeek-V3: the drafter loads its head from them);
    # False: a checkpoint may or may not (GLM-4.5 does, GLM-4.6+ do not; vLLM maps lm_head into the MTP's head).
    copies_required: bool = False
    # A module name as the engine's draft builds it, for its quantization rules (vLLM strips GLM-5.3-Flash's
    # ``model.language_model.``, nests Step's block under ``mtp_block``, names DeepSeek's MTP head ``{layer}.head``);
    # None: the checkpoint's name. The engine reads its exclusion lists unchanged (unlike ``engine_layer_offset``).
    engine_rename: Callable[[str, int], str] | None = None
    # What ``shapes`` enumerates: "exact" (every MTP tensor), "glue" (each declared layer's glue only: the block
    # follows per-layer config mtpquant does not model; tensors inside a declared layer are not unexpected), "none"
    # (nothing: presence only, for families mtpquant recognises without modelling).
    inventory: str = "exact"
    # How an appended-layer ("NextN") MTP computes (``families.nextn.AppendedForward``: the transformers classes of
    # its block, the concatenation order, which stream the next draft step reads); None: not that kind of MTP.
    appended: Any = None
    # The precision groups, in the order reports list them (``MtpGroup``); MTP Linears in no group stay unquantized
    # (routers, gates, the engines' unquantized projections). (): the precision cannot be chosen per group.
    groups: tuple[MtpGroup, ...] = ()

    def group_of(self, module: str) -> MtpGroup | None:
        """The precision group an MTP Linear belongs to (None: none, it stays in the source precision)."""
        return next((g for g in self.groups if matches(module, g.modules)), None)

    def engine_name(self, name: str, num_hidden_layers: int) -> str:
        """An MTP module or pattern as the engine names it (patterns that do not start with ``mtp.`` unchanged).

        Mirrors ``_remap_ignored_layers`` in vLLM 0.32 ``vllm/models/qwen4_exp/nvidia/mtp.py`` (lines 68-83): every
        number after ``.layers.`` in a name starting with ``mtp.`` is offset by ``num_hidden_layers``.
        """
        if self.engine_rename is not None:
            return self.engine_rename(name, num_hidden_layers)
        if not self.engine_layer_offset or not name.startswith(MTP_PREFIX):
            return name
        return _LAYER_NUMBER.sub(lambda m: str(num_hidden_layers + int(m.group(0))), name)

    def is_unquantized(self, module: str) -> bool:
        """Whether a quantized MTP keeps this MTP Linear in BF16."""
        return matches(module, self.unquantized)


_LAYER_NUMBER = re.compile(r"(?<=\.layers\.)\d+")


@dataclass(frozen=True)
class ForcedUnquantized:
    """A module an engine builds without quantization whatever the exclusions say, under one quantization method."""

    method: str  # the vLLM quantization method name (get_name()), e.g. "modelopt_fp4"
    pattern: str  # fnmatch on the engine module name
    source: str  # where the engine does it (file and function), for the report
    workaround: bool  # True: a compatibility workaround a correct checkpoint should not rely on (a warning)


@dataclass(frozen=True)
class EngineRules:
    """How vLLM builds the family's modules: packed groups, modules built without a quantization config."""

    # vLLM's packed_modules_mapping: engine module leaf -> checkpoint shard names (dotted names allowed)
    packed: Mapping[str, tuple[str, ...]]
    # fnmatch patterns of modules vLLM always builds without a quantization config (router, gates, ...)
    built_unquantized: tuple[str, ...]
    forced_unquantized: tuple[ForcedUnquantized, ...] = ()
    # fnmatch patterns of engine modules that are embedding tables looked up (not Linears), with their shards
    embedding_tables: tuple[str, ...] = ()
    # architectures / model types the engine release knows (None: every architecture of the family)
    known_architectures: frozenset[str] | None = None
    # fnmatch patterns of modules built unquantized whose FP8 checkpoint weight the engine dequantizes as it loads
    # (DeepSeek-V3.2's indexer wk: _try_load_fp8_indexer_wk), so FP8 on disk loads too
    dequantized_on_load: tuple[str, ...] = ()
    # fnmatch patterns of MTP modules SGLang builds as a plain Linear (never quantized): Qwen's ``mtp.fc``,
    # DeepSeek's / GLM's ``eh_proj`` (sgl: models/deepseek_nextn.py, glm4_moe_nextn.py)
    sglang_plain: tuple[str, ...] = ("mtp.fc",)
    # The drafter each engine builds for the family's MTP: engine -> class ("" where the engine has none)
    drafters: Mapping[str, str] = field(default_factory=dict)
    # What vLLM's drafter raises when the checkpoint has none of a declared MTP layer's weights ({layer}: its index):
    # the loader's own check (DeepSeek's and GLM-5's is_mtp_completeness_check_enabled, Step's parameter check);
    # "": none (its model loader's weight tracking catches it only for an unquantized checkpoint)
    missing_mtp_error: str = ""
    # The MTP head vLLM's drafter builds with the quantization config and loads the target's ``lm_head.weight`` into
    # when the layer carries no head of its own (GLM: glm4_moe_mtp.py load_weights maps it to
    # ``model.layers.{n}.shared_head.head``, ``ParallelLMHead(prefix="{layer}.head")``): its leaf under the first MTP
    # layer, ``""`` where the drafter does not. That head must be excluded as the BF16 ``lm_head`` is.
    head_from_target: str = ""


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
    mtp: MtpLayout
    engine: EngineRules
    # transformers classes used to load the main model (None: not loadable by the installed transformers).
    wrapper_class: str | None
    text_class: str
    # Linear module name suffixes that share one input (and so one weight_scale_2 / input_scale).
    fused_groups: tuple[tuple[str, ...], ...]
    # Module-name patterns (fnmatch, relative to the full tensor name) NVFP4 leaves unquantized.
    unquantized: tuple[str, ...]
    # Whether main-model experts are stored fused 3-D (`experts.gate_up_proj`) on disk.
    fused_main_experts: bool
    # Day-0 labels some checkpoints carry over identical weights: alias -> canonical (model types and
    # architectures alike); recognised, reported, and relabelled by `graft --fix-metadata`.
    aliases: Mapping[str, str] = field(default_factory=dict)
    # Other config keys that must agree for one checkpoint's MTP to fit another's (graft's lineage check).
    lineage_keys: tuple[str, ...] = ()
    # Whether mtpquant has a reference forward of this family's MTP (quantize mode, validate).
    mtp_forward: bool = True
    # Whether heal can train this family's MTP (it trains the reference forward, by its MtpForward step).
    mtp_heal: bool = True
    # Whether SGLang builds a quantized MTP from a MIXED_PRECISION config that lists mtp.* layers (SGLang 0.5.23
    # _mtp_quant_config); otherwise mtpquant reports that SGLang serves only a BF16 MTP.
    sglang_mixed_mtp: bool = False
    # What mtpquant does with the family's MTP (SUPPORTED, RECOGNISED, NOT_MTP, NEVER_SHIPPED), and for the last
    # three the one line that says why (inspect reports it, every surgery refuses with it).
    status: str = SUPPORTED
    status_note: str = ""
    # Whether convert (modelopt NVFP4 through the family's transformers class and mtpquant's calibration) takes it.
    convert: bool = True
    # The architecture of the family's standalone MTP export, the community's extracted form (SGLang's
    # scripts/export_deepseek_nextn.py: "DeepseekV3ForCausalLMNextN", num_hidden_layers 1, the MTP at layer 0,
    # without the head / embedding copies, in nextn_layer_parameters.safetensors); None: the family has none
    nextn_architecture: str | None = None
    # vLLM 0.32's drafter classes for this family where ``engine.drafters`` does not name them (the Qwen families)
    vllm_drafters: tuple[str, ...] = ()
    # How vLLM 0.32's drafter renames the checkpoint's MTP names as it loads them (prose, for ``mtpquant families``)
    vllm_remap: str = ""
    # The vLLM 0.32 files whose loader these facts are read from (under vllm/), for ``mtpquant families``
    sources: tuple[str, ...] = ()
    # Leaf renames transformers' conversion_mapping applies to the family's main-model tensors as it loads them
    # (checkpoint suffix -> transformers suffix: MiMo-V2's ``self_attn.attention_sink_bias`` -> ``self_attn.sinks``),
    # for loaders that place tensors by name (validate's target)
    hf_renames: tuple[tuple[str, str], ...] = ()

    @property
    def mtp_key(self) -> str | None:
        """The config key a declaration is written under (None: the family has no key, engines assume a depth)."""
        return self.mtp.depth_keys[0] if self.mtp.depth_keys else None

    @property
    def mtp_default_layers(self) -> int:
        """MTP layers engines assume when the config has no depth key."""
        return self.mtp.default_layers

    def canonical(self, label: str) -> str:
        """A model type or architecture with any day-0 alias replaced by its canonical name."""
        return self.aliases.get(label, label)
