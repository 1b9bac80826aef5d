"""How serving engines decide, per module, whether to build it quantized.

Mirrors vLLM 0.32's rules (``ModelOptQuantConfigBase.is_layer_excluded`` and
``apply_vllm_mapper`` in ``quantization/modelopt.py``, ``is_layer_skipped`` in
``quantization/utils/quant_utils.py``, compressed-tensors ``should_ignore_layer``, AutoRound's format
through ``quantization/inc/inc.py`` and ``inc/config_parser.py``) and SGLang's MTP loaders (below). Pure
functions on names.

SGLang (0.5.23, as recorded from a real server in ``tests/fixtures/sglang-cpu/README.md``; the source:
sgl-project/sglang ``python/sglang/srt/models/qwen3_5_mtp.py::_mtp_quant_config`` and
``qwen3_next_mtp.py::Qwen3NextForCausalLMMTP.__init__``) decides the MTP's quantization for the whole layer
before any per-module rule:

- ``modelopt_fp4`` (every exported checkpoint is serialized): the MTP is built unquantized, in BF16, whatever is
  on disk ("Serialized Qwen3.5 ModelOpt checkpoints keep embedded MTP weights in BF16"; Qwen3-Next's MTP drops a
  ``modelopt_fp4`` config outright);
- ``modelopt_mixed``: quantized only when ``quantized_layers`` lists ``mtp.*`` modules, then module by module as
  listed; otherwise BF16;
- any other format (compressed-tensors, ...): the checkpoint's quantization config, with its own per-module rules;
- ``mtp.fc`` is a plain ``nn.Linear`` in both models: never quantized.

What a mismatch does there: SGLang's Linear weight loaders assert the checkpoint tensor's shape
(``layers/linear.py``: ``assert param_data.shape == loaded_weight.shape``) and copy it into the module's dtype;
scales a BF16 module has no parameter for are skipped (``ignore_suffixes`` in ``load_weights``, or "not found in
params_dict, skip loading"). So a packed NVFP4 weight in a module SGLang built in BF16 stops the server at load,
and an FP8 weight of the same shape loads as its raw values, without its scales: a wrong MTP that drafts badly.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import translate
from typing import Any

from mtpquant.checkpoint.precision import is_quantized
from mtpquant.families import QWEN_MTP_NAMES, EngineRules, family, matches
from mtpquant.formats.quant_config import QuantMetadata

__all__ = [
    "BLOCK_FP8_MOE_ALGOS",
    "INC_DATA_TYPES",
    "LM_HEADS",
    "MODELOPT_QUANT_ALGOS",
    "EngineModule",
    "Expectation",
    "FusedShardsError",
    "auto_round_quantized",
    "ct_ignored",
    "engine_modules",
    "expand_modelopt_patterns",
    "mixed_algo",
    "modelopt_excluded",
    "mtp_load_refusal",
    "sglang_builds_quantized",
    "sglang_mtp_build",
    "vllm_builds_quantized",
    "vllm_expectation",
    "vllm_format_refusal",
]

# vLLM packs checkpoint Linears into one module (the family's EngineRules.packed); the shards must agree on
# precision. Qwen3.5's rules are the default for callers that have no family at hand.
_QWEN3 = family("qwen3_5").engine
PACKED = _QWEN3.packed
# vLLM 0.32 quantization/modelopt.py 125-160: the top-level quant_algo values ModelOpt configs accept
# (QUANT_ALGOS), the Linear algos (LINEAR_ALGOS) and the block-FP8 MoE labels (FP8_BLOCK_SCALES: the earlier
# label of NVIDIA's composed Qwen3.8-Flash-Next checkpoints, kept by vLLM as an alias of FP8_PB_WO).
LINEAR_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8")
MODELOPT_QUANT_ALGOS = (*LINEAR_ALGOS, "MIXED_PRECISION")
BLOCK_FP8_MOE_ALGOS = ("FP8_PB_WO", "FP8_BLOCK_SCALES")
# Element types vLLM 0.32's INC (AutoRound) config accepts: INCConfig.SUPPORTED_DTYPES, plus the mx_fp family.
INC_DATA_TYPES = ("int", "fp", "mx_fp")
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")
# LM heads as the engines name them (the model's lm_head; an MTP layer's own head, vLLM's "{layer}.head" for DeepSeek
# and GLM, "shared_head.head" for Step): vLLM's Fp8Config quantizes LinearBase and routed experts only
# (quantization/fp8.py get_quant_method), so an FP8 checkpoint keeps them unquantized
LM_HEADS = ("lm_head", "*.head", "*.shared_head.head")
_FP8_HEAD = "vLLM's Fp8Config builds the LM head unquantized (it quantizes Linear layers and experts only)"


class FusedShardsError(ValueError):
    """vLLM refuses a fused module whose shards disagree on being excluded."""


@dataclass(frozen=True)
class EngineModule:
    """One module as the engine builds it: its prefix and the checkpoint Linears it holds."""

    prefix: str
    members: tuple[str, ...]  # checkpoint module names (tensor name without `.weight` etc.)
    kind: str  # "linear" | "packed" | "experts" | "unquantized" | "embedding"


def expand_modelopt_patterns(patterns: Sequence[str]) -> list[str]:
    """vLLM's ``apply_vllm_mapper`` rewrite: ``X*`` (X not ending in '.') becomes ``X`` and ``X.*``."""
    out: list[str] = []
    for p in patterns:
        if len(p) >= 2 and p[-1] == "*" and p[-2] != ".":
            out += [p[:-1], p[:-1] + ".*"]
        else:
            out.append(p)
    return out


def _packed_base(
    prefix: str, packed: Mapping[str, tuple[str, ...]] | None = None
) -> tuple[str, tuple[str, ...]] | None:
    base, _, last = prefix.rpartition(".")
    shards = (PACKED if packed is None else packed).get(last)
    return (base, shards) if shards else None


@dataclass(frozen=True)
class _Exclusions:
    """A modelopt exclusion list compiled once: the expanded names, and one regex each for the substring and the
    fnmatch tests (the same answers as testing pattern by pattern, in C)."""

    expanded: frozenset[str]
    ordered: tuple[str, ...]
    substring: re.Pattern[str]
    glob: re.Pattern[str]


@functools.lru_cache(maxsize=64)
def _exclusions(patterns: tuple[str, ...]) -> _Exclusions:
    expanded = expand_modelopt_patterns(patterns)
    return _Exclusions(
        frozenset(expanded),
        tuple(expanded),
        re.compile("|".join(re.escape(p) for p in sorted(expanded, key=len, reverse=True))),
        re.compile("|".join(f"(?:{translate(p)})" for p in expanded)),  # fnmatch: translate + match (POSIX case)
    )


def modelopt_excluded(
    prefix: str, patterns: Sequence[str], packed_groups: Mapping[str, tuple[str, ...]] | None = None
) -> bool:
    """ModelOpt-format exclusion as vLLM resolves it: exact (fused-aware), substring, fnmatch."""
    if not patterns:
        return False
    rules = _exclusions(tuple(patterns))
    expanded = rules.expanded
    packed = _packed_base(prefix, packed_groups)
    if packed is not None:
        base, shards = packed
        hits = [f"{base}.{s}" in expanded for s in shards]
        if any(hits) and not all(hits):
            raise FusedShardsError(
                f"some but not all shards of {prefix} are excluded ({', '.join(s for s, h in zip(shards, hits) if h)})"
            )
        if all(hits):
            return True
    elif prefix in expanded:
        return True
    # a pattern other than the prefix itself inside it (the longest is tried first at each position, so a match
    # equal to the whole prefix means no shorter pattern starts there; the others are then checked one by one)
    found = rules.substring.search(prefix)
    if found is not None and (found.group(0) != prefix or any(p != prefix and p in prefix for p in rules.ordered)):
        return True
    return rules.glob.match(prefix) is not None


def _ct_match(name: str, patterns: Sequence[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name:
            return True
    return False


def ct_ignored(
    prefix: str, patterns: Sequence[str], packed_groups: Mapping[str, tuple[str, ...]] | None = None
) -> bool:
    """compressed-tensors ``ignore``: exact names or ``re:`` regexes only; fused shards must agree."""
    packed = _packed_base(prefix, packed_groups)
    if packed is not None:
        base, shards = packed
        hits = [_ct_match(f"{base}.{s}", patterns) for s in shards]
        if any(hits) and not all(hits):
            raise FusedShardsError(f"some but not all shards of {prefix} are in the compressed-tensors ignore list")
        return all(hits)
    return _ct_match(prefix, patterns)


@dataclass(frozen=True)
class _LayerIndex:
    """quantized_layers keys sorted (prefix lookups by bisection) with their position in the file (vLLM takes the
    first match in the file's order)."""

    layers: Mapping[str, Any]  # kept alive with the index: the cache is keyed by its id
    keys: tuple[str, ...]
    order: Mapping[str, int]

    def first_below(self, prefix: str) -> str | None:
        """The first key (in file order) that starts with ``prefix``."""
        i = bisect.bisect_left(self.keys, prefix)
        found: list[str] = []
        while i < len(self.keys) and self.keys[i].startswith(prefix):
            found.append(self.keys[i])
            i += 1
        return min(found, key=self.order.__getitem__) if found else None


_LAYER_INDEXES: dict[int, _LayerIndex] = {}


def _layer_index(layers: Mapping[str, Any]) -> _LayerIndex:
    index = _LAYER_INDEXES.get(id(layers))
    if index is None or index.layers is not layers or len(index.keys) != len(layers):
        if len(_LAYER_INDEXES) > 16:
            _LAYER_INDEXES.clear()
        index = _LayerIndex(layers, tuple(sorted(layers)), {k: i for i, k in enumerate(layers)})
        _LAYER_INDEXES[id(layers)] = index
    return index


def mixed_algo(
    prefix: str, meta: QuantMetadata, packed_groups: Mapping[str, tuple[str, ...]] | None = None
) -> str | None:
    """The quant_algo MIXED_PRECISION resolves for an engine module, or None (not listed: unquantized).

    Mirrors ``ModelOptMixedPrecisionConfig._resolve_quant_algo`` (vLLM 0.32 quantization/modelopt.py 1717-1796):
    the exact name, then the packed shards (all listed ones must agree), then any key below the prefix (routed
    experts), then any key below the experts' parent.
    """
    layers = meta.quantized_layers

    def algo(key: str) -> str:
        info = layers[key]
        return str(info.get("quant_algo", "") if isinstance(info, Mapping) else "").upper()

    if prefix in layers:
        return algo(prefix)
    packed = _packed_base(prefix, packed_groups)
    if packed is not None:
        base, shards = packed
        algos = {algo(f"{base}.{s}") for s in shards if f"{base}.{s}" in layers}
        if len(algos) > 1:
            raise FusedShardsError(f"mixed quant_algo within fused layer {prefix}: {', '.join(sorted(algos))}")
        if algos:
            return algos.pop()
    index = _layer_index(layers)
    below = index.first_below(prefix + ".")
    if below is None and prefix.endswith(".experts"):
        below = index.first_below(prefix.rsplit(".experts", 1)[0] + ".")
    return None if below is None else algo(below)


def vllm_format_refusal(meta: QuantMetadata | None) -> str | None:
    """Why vLLM refuses the checkpoint's quantization format outright (before any MTP question), or None."""
    if meta is not None and meta.is_modelopt and meta.algo.upper() not in MODELOPT_QUANT_ALGOS:
        return (
            f"vLLM 0.32's ModelOpt config does not accept quant_algo {meta.algo!r} (it accepts "
            f"{', '.join(MODELOPT_QUANT_ALGOS)}): the checkpoint will not load"
        )
    if meta is None or not meta.is_auto_round:
        return None
    dt = meta.data_type or "int"
    if dt in INC_DATA_TYPES or "mx_fp" in dt:
        return None
    return (
        f"vLLM 0.32 does not support auto-round data_type {dt!r} (INC supports {', '.join(INC_DATA_TYPES)}): "
        "the checkpoint will not load"
    )


def _extra_bits(prefix: str, extra: Mapping[str, Any]) -> int | None:
    """``bits`` of the extra_config entry for ``prefix`` (exact, suffix, then regex key), as INC resolves it."""
    for key in (prefix, f"model.{prefix}"):
        cfg = extra.get(key)
        if isinstance(cfg, dict):
            return int(cfg.get("bits", 16))
    for key, cfg in extra.items():
        if isinstance(cfg, dict) and prefix.endswith(f".{key}"):
            return int(cfg.get("bits", 16))
    for key, cfg in extra.items():
        if isinstance(cfg, dict) and any(c in _REGEX_CHARS for c in key):
            try:
                if re.search(key, prefix):
                    return int(cfg.get("bits", 16))
            except re.error:
                continue
    return None


def auto_round_quantized(prefix: str, meta: QuantMetadata) -> tuple[bool, str]:
    """AutoRound: an ``extra_config`` entry decides (bits >= 16: unquantized); else ``block_name_to_quantize``."""
    packed = _packed_base(prefix)
    names = [f"{packed[0]}.{s}" for s in packed[1]] if packed else [prefix]
    bits = {_extra_bits(n, meta.extra_config) for n in names}
    if len(bits) > 1:
        raise FusedShardsError(f"the shards of {prefix} have different bits in the auto-round extra_config")
    (b,) = bits
    if b is not None:
        return b < 16, f"auto-round extra_config bits {b}"
    if meta.blocks:
        inside = any(prefix.startswith(block) for block in meta.blocks)
        return inside, ("inside" if inside else "outside") + " auto-round block_name_to_quantize"
    if prefix == "lm_head" or prefix.endswith(".lm_head"):
        return False, "vLLM builds lm_head unquantized for auto-round"
    return True, "auto-round quantizes every Linear"


@dataclass(frozen=True)
class Expectation:
    """What vLLM builds for one engine module: quantized or not, why, and (where known) the on-disk format its
    method has parameters for."""

    quantized: bool
    reason: str
    expects: str | None = None  # on-disk precision the method loads (module_precision's names); None: not checked
    method: str | None = None  # vLLM's method, for messages
    params: tuple[str, ...] = ()  # checkpoint tensor suffixes the method registers (routed experts)
    workaround: bool = False  # unquantized only thanks to an engine workaround (a warning)
    refusal: str | None = None  # vLLM raises while building the module (the module cannot load at all)


# vLLM 0.32's methods for routed experts under ModelOpt MIXED_PRECISION (modelopt.py 1864-1890), with the
# checkpoint suffixes each registers: Fp8MoEMethod with a weight block registers w13/w2_weight_scale_inv
# (fp8.py 484-487, 631-633); ModelOptFp8MoEMethod w*_weight_scale + w*_input_scale (modelopt.py 560-580);
# ModelOptNvFp4FusedMoE weight_scale, weight_scale_2, input_scale (modelopt.py 950-1006).
_MOE_METHODS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "FP8_PB_WO": ("FP8-block", "Fp8MoEMethod (block)", ("weight", "weight_scale_inv")),
    "FP8_BLOCK_SCALES": ("FP8-block", "Fp8MoEMethod (block)", ("weight", "weight_scale_inv")),
    "FP8": ("FP8", "ModelOptFp8MoEMethod", ("weight", "weight_scale", "input_scale")),
    "NVFP4": ("NVFP4", "ModelOptNvFp4FusedMoE", ("weight", "weight_scale", "weight_scale_2", "input_scale")),
    "W4A16_NVFP4": ("NVFP4", "ModelOptNvFp4FusedMoE (W4A16)", ("weight", "weight_scale", "weight_scale_2")),
}
_UNQUANTIZED_MOE = ("BF16", "UnquantizedFusedMoEMethod", ("weight",))
# Linears under MIXED_PRECISION: algos outside LINEAR_ALGOS get UnquantizedLinearMethod (modelopt.py 1850-1858).
_LINEAR_FORMATS = {
    "FP8": "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8",
    "FP8_PB_WO": "FP8-PB",
    "NVFP4": "NVFP4",
    "W4A16_NVFP4": "NVFP4",
}


def _embedding_expectation(
    prefix: str, meta: QuantMetadata | None, packed: Mapping[str, tuple[str, ...]]
) -> Expectation:
    """vLLM 0.32 ``Qwen4ExpPLEEmbeddingMethod.from_quant_config`` (models/qwen4_exp/common/ngram_embedding.py
    174-227): the n-gram table is FP8 only when MIXED_PRECISION resolves it to FP8 (or the checkpoint is FP8
    serialized); a ModelOpt / compressed-tensors config that does not exclude it raises NotImplementedError."""
    if meta is None:
        return Expectation(False, "checkpoint declares no quantization", "BF16")
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        algo = mixed_algo(prefix, meta, packed)
        if algo == "FP8":
            return Expectation(True, "quantized_layers: FP8", "FP8", "Qwen4ExpPLEFp8EmbeddingMethod")
        label = f"quantized_layers: {algo}" if algo else "absent from quantized_layers"
        return Expectation(False, label, "BF16", "Qwen4ExpPLEUnquantizedEmbeddingMethod")
    excluded = (
        ct_ignored(prefix, meta.exclude, packed)
        if meta.is_compressed_tensors
        else modelopt_excluded(prefix, meta.exclude, packed)
        if meta.is_modelopt
        else False
    )
    if excluded:
        return Expectation(False, "excluded", "BF16", "Qwen4ExpPLEUnquantizedEmbeddingMethod")
    config = {"modelopt_fp4": "ModelOptNvFp4Config", "modelopt": "ModelOptFp8Config"}.get(
        meta.vllm_method, "CompressedTensorsConfig" if meta.is_compressed_tensors else meta.vllm_method
    )
    refusal = (
        f"{prefix} is not excluded, and vLLM's PLE n-gram table raises NotImplementedError: Qwen4Exp PLE embedding "
        f"does not support quantization config {config}"
    )
    return Expectation(False, "not excluded", refusal=refusal)


def _mixed_expectation(
    module: EngineModule, prefix: str, meta: QuantMetadata, packed: Mapping[str, tuple[str, ...]]
) -> Expectation:
    algo = mixed_algo(prefix, meta, packed)
    if module.kind == "experts":
        expects, method, params = _MOE_METHODS.get(algo or "", _UNQUANTIZED_MOE)
        label = f"quantized_layers: {algo}" if algo else "absent from quantized_layers"
        return Expectation(algo in _MOE_METHODS, label, expects, method, params)
    if algo is None:
        return Expectation(False, "absent from quantized_layers", "BF16", "UnquantizedLinearMethod")
    if algo not in _LINEAR_FORMATS:
        return Expectation(False, f"quantized_layers: {algo} (not a Linear algo)", "BF16", "UnquantizedLinearMethod")
    return Expectation(True, f"quantized_layers: {algo}", _LINEAR_FORMATS[algo], f"ModelOptLinearMethod ({algo})")


def vllm_expectation(
    module: EngineModule,
    meta: QuantMetadata | None,
    rules: EngineRules = _QWEN3,
    engine_prefix: str | None = None,
) -> Expectation:
    """How vLLM 0.32 builds one engine module of a checkpoint with this metadata. Raises FusedShardsError.

    ``engine_prefix``: the module's name as the engine builds it (vLLM renames Qwen4-Exp MTP layers); ``meta``
    must then carry the engine's renamed exclusion lists too.
    """
    prefix = engine_prefix or module.prefix
    packed = rules.packed
    if module.kind == "embedding":
        return _embedding_expectation(prefix, meta, packed)
    if meta is None:
        return Expectation(False, "checkpoint declares no quantization")
    if module.kind == "unquantized":
        return Expectation(False, "vLLM builds it without a quantization config")
    forced = next(
        (r for r in rules.forced_unquantized if r.method == meta.vllm_method and matches(prefix, (r.pattern,))), None
    )
    if forced is not None:
        excluded = modelopt_excluded(prefix, meta.exclude, packed)
        if excluded and forced.workaround:
            return Expectation(False, "excluded")
        return Expectation(
            False, f"forced unquantized by {forced.source}", workaround=forced.workaround and not excluded
        )
    if meta.is_compressed_tensors:
        ignored = ct_ignored(prefix, meta.exclude, packed)
        return Expectation(
            not ignored, "in compressed-tensors ignore" if ignored else "not in compressed-tensors ignore"
        )
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        if modelopt_excluded(prefix, meta.exclude, packed):
            return Expectation(False, "excluded")
        return _mixed_expectation(module, prefix, meta, packed)
    if meta.is_modelopt:
        excluded = modelopt_excluded(prefix, meta.exclude, packed)
        return Expectation(not excluded, "excluded" if excluded else "not excluded")
    if meta.is_auto_round:
        q, reason = auto_round_quantized(prefix, meta)
        return Expectation(q, reason)
    if meta.vllm_method == "fp8" and matches(prefix, LM_HEADS):
        return Expectation(False, _FP8_HEAD)
    return Expectation(True, f"quant_method {meta.method!r}")


def vllm_builds_quantized(module: EngineModule, meta: QuantMetadata | None) -> tuple[bool, str]:
    """Whether vLLM builds the module quantized, and a short reason (Qwen3.5's rules). Raises FusedShardsError."""
    e = vllm_expectation(module, meta)
    return e.quantized, e.reason


# routed experts: ``mlp.experts`` (Qwen, DeepSeek, GLM), ``mixer.experts`` (Nemotron-H), per expert or fused 3-D
_EXPERT_RE = re.compile(r"^(.*\.(?:mlp|mixer)\.experts)(\.\d+\.\w+|\.gate_up_proj|\.down_proj)$")
_TABLE_SHARD = re.compile(r"^(.*)\.shard_\d+$")


def engine_modules(linear_names: Sequence[str], rules: EngineRules = _QWEN3) -> list[EngineModule]:
    """Group checkpoint Linear module names into the modules vLLM builds (packed, experts, embedding tables)."""
    members: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}

    def add(prefix: str, name: str, kind: str) -> None:
        members.setdefault(prefix, []).append(name)
        kinds[prefix] = kind

    # longest shard names first: "indexer.index_qk_proj" before a plain leaf
    shards = sorted(((s, p) for p, ss in rules.packed.items() for s in ss), key=lambda sp: -len(sp[0]))
    for name in sorted(linear_names):
        m = _EXPERT_RE.match(name) if ".experts." in name else None
        if m:
            add(m.group(1), name, "experts")
            continue
        if rules.embedding_tables:
            t = _TABLE_SHARD.match(name)
            table = t.group(1) if t else name
            if matches(table, rules.embedding_tables):
                add(table, name, "embedding")
                continue
        if matches(name, rules.built_unquantized):
            members[name], kinds[name] = [name], "unquantized"
            continue
        shard = next((sh for sh, _ in shards if name.endswith("." + sh)), None)
        if shard is not None:
            packed = next(p for sh, p in shards if sh == shard)
            add(f"{name[: -len(shard) - 1]}.{packed}", name, "packed")
            continue
        members[name], kinds[name] = [name], "linear"
    return [EngineModule(prefix, tuple(names), kinds[prefix]) for prefix, names in members.items()]


def sglang_mtp_build(
    meta: QuantMetadata | None, is_mtp: Callable[[str], bool] = QWEN_MTP_NAMES.is_mtp
) -> tuple[bool, str]:
    """Whether SGLang builds the MTP with the checkpoint's quantization at all, and why (see the module docstring);
    ``is_mtp``: the family's MTP name test (``ModelSpec.is_mtp``; the ``mtp.`` namespace by default)."""
    if meta is None:
        return False, "the checkpoint declares no quantization"
    method = meta.vllm_method  # SGLang names the ModelOpt and compressed-tensors formats as vLLM does
    if method == "modelopt_fp4":
        return False, "SGLang builds the MTP of a serialized modelopt_fp4 checkpoint in BF16"
    if method == "modelopt_mixed":
        if any(is_mtp(name) for name in meta.quantized_layers):
            return True, "quantized_layers lists the MTP"
        return False, "SGLang builds the MTP in BF16: modelopt_mixed lists no MTP module in quantized_layers"
    return True, f"SGLang builds the MTP with the checkpoint's {method} quantization"


def sglang_builds_quantized(
    module: EngineModule,
    meta: QuantMetadata | None,
    rules: EngineRules = _QWEN3,
    is_mtp: Callable[[str], bool] = QWEN_MTP_NAMES.is_mtp,
) -> tuple[bool, str]:
    """Whether SGLang builds this MTP module quantized, and a short reason (``rules``, ``is_mtp``: the family's; the
    Qwen3.5 ones by default). Raises FusedShardsError."""
    if matches(module.prefix, rules.sglang_plain):
        return False, f"SGLang builds {module.prefix} as a plain Linear"
    if module.kind == "unquantized":
        return False, "SGLang builds it without a quantization config"
    whole, why = sglang_mtp_build(meta, is_mtp)
    if not whole or meta is None:
        return False, why
    if meta.is_compressed_tensors:
        ignored = ct_ignored(module.prefix, meta.exclude)
        return not ignored, "in compressed-tensors ignore" if ignored else "not in compressed-tensors ignore"
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        algo = mixed_algo(module.prefix, meta)
        return algo is not None, f"quantized_layers: {algo}" if algo else "absent from quantized_layers"
    if meta.is_modelopt:
        excluded = modelopt_excluded(module.prefix, meta.exclude)
        return not excluded, "excluded" if excluded else "not excluded"
    if meta.vllm_method == "fp8" and matches(module.prefix, LM_HEADS):
        return False, "SGLang builds the MTP head unquantized (its Fp8Config quantizes Linear layers and experts only)"
    return True, why


def _declared_format(
    prefix: str, meta: QuantMetadata, packed: Mapping[str, tuple[str, ...]], experts: bool
) -> str | None:
    """The on-disk format the metadata declares for a quantized module (None: not checked): a plain ModelOpt config
    its one quant_algo's, MIXED_PRECISION the module's resolved algo's (routed experts: the MoE method's)."""
    if not meta.is_modelopt:
        return None
    algo = meta.algo.upper()
    if algo == "MIXED_PRECISION":
        resolved = mixed_algo(prefix, meta, packed) or ""
        if experts:
            return _MOE_METHODS[resolved][0] if resolved in _MOE_METHODS else None
        return _LINEAR_FORMATS.get(resolved)
    return _LINEAR_FORMATS.get(algo)


def mtp_load_refusal(
    engine: str, precision: Mapping[str, str], meta: QuantMetadata | None, rules: EngineRules = _QWEN3
) -> str | None:
    """Why ``engine`` (``vllm`` | ``sglang``) does not load an MTP stored as ``precision`` (every MTP Linear -> its
    on-disk precision: ``BF16``, ``NVFP4``, ``FP8``, ...) under ``meta``, or None when every module loads.

    Each module as the engine builds it (``engine_modules``: packed groups and routed experts are one module whose
    members share one precision) must be built quantized exactly when it is stored quantized, in the format its
    metadata declares (``vllm_expectation``; SGLang: ``sglang_builds_quantized``, which decides the whole MTP first).
    The precision search (``convert --mtp auto``) asks it of every configuration before measuring one.
    """
    packed = rules.packed
    for module in engine_modules(sorted(precision), rules):
        disks = sorted({precision[m] for m in module.members})
        if len(disks) > 1:
            return f"{engine}: {module.prefix} is one module, its members are stored as {', '.join(disks)}"
        disk = disks[0]
        try:
            if engine == "sglang":
                built, why = sglang_builds_quantized(module, meta)
            else:
                e = vllm_expectation(module, meta, rules)
                if e.refusal is not None:
                    return f"{engine}: {e.refusal}"
                built, why = e.quantized, e.reason
            expects = _declared_format(module.prefix, meta, packed, module.kind == "experts") if meta else None
        except FusedShardsError as exc:
            return f"{engine}: {exc}"
        stored = is_quantized(disk)
        if built != stored:
            how = "quantized" if built else "unquantized"
            return f"{engine} builds {module.prefix} {how} ({why}), but it is {disk} on disk"
        if built and expects is not None and expects != disk:
            return f"{engine} loads {module.prefix} as {expects} ({why}), but it is {disk} on disk"
    return None
