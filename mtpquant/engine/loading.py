"""The loading rules the engines share: how a checkpoint's Linears group into the modules an engine builds, and how
ModelOpt and compressed-tensors exclusion lists and MIXED_PRECISION ``quantized_layers`` resolve for a module name.

Mirrors vLLM 0.32 (``ModelOptQuantConfigBase.is_layer_excluded`` and ``apply_vllm_mapper`` in
``quantization/modelopt.py``, ``is_layer_skipped`` in ``quantization/utils/quant_utils.py``, compressed-tensors
``should_ignore_layer``, ``ModelOptMixedPrecisionConfig._resolve_quant_algo``), which SGLang's ModelOpt configs
follow too. Each engine's own decisions (which module it builds quantized, with which method; what it refuses) are in
that engine's module: ``engine/vllm.py``, ``engine/sglang.py``, ``engine/trtllm.py``; ``mtp_load_refusal`` asks the
one an engine's table row (``engine/table.py``) names. Pure functions on names.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import translate
from typing import Any

from mtpquant.checkpoint.precision import is_quantized
from mtpquant.families import EngineRules, family, matches
from mtpquant.formats.quant_config import QuantMetadata

__all__ = [
    "BLOCK_FP8_MOE_ALGOS",
    "LINEAR_FORMATS",
    "LM_HEADS",
    "MODELOPT_QUANT_ALGOS",
    "MOE_METHODS",
    "PACKED",
    "UNQUANTIZED_MOE",
    "EngineModule",
    "Expectation",
    "FusedShardsError",
    "ct_ignored",
    "declared_format",
    "engine_modules",
    "expand_modelopt_patterns",
    "mixed_algo",
    "modelopt_excluded",
    "mtp_load_refusal",
    "packed_base",
    "unmatched_exclusions",
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
# LM heads as the engines name them (the model's lm_head; an MTP layer's own head, vLLM's "{layer}.head" for DeepSeek
# and GLM, "shared_head.head" for Step): vLLM's Fp8Config quantizes LinearBase and routed experts only
# (quantization/fp8.py get_quant_method), so an FP8 checkpoint keeps them unquantized
LM_HEADS = ("lm_head", "*.head", "*.shared_head.head")


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


def packed_base(
    prefix: str, packed: Mapping[str, tuple[str, ...]] | None = None
) -> tuple[str, tuple[str, ...]] | None:
    base, _, last = prefix.rpartition(".")
    shards = (PACKED if packed is None else packed).get(last)
    return (base, shards) if shards else None


@dataclass(frozen=True)
class _Exclusions:
    """A modelopt exclusion list compiled once: the expanded names, and one regex each for the substring and the
    fnmatch tests (the same answers as testing pattern by pattern, in C; the fnmatch one holds only the patterns with
    a wildcard: any other matches its own name alone, which the expanded names answer; None: there is none)."""

    expanded: frozenset[str]
    ordered: tuple[str, ...]
    substring: re.Pattern[str]
    glob: re.Pattern[str] | None


_GLOB_CHARS = re.compile(r"[*?\[]")  # fnmatch's special characters: a pattern without one matches only itself


@functools.lru_cache(maxsize=64)
def _exclusions(patterns: tuple[str, ...]) -> _Exclusions:
    expanded = expand_modelopt_patterns(patterns)
    wild = [p for p in expanded if _GLOB_CHARS.search(p)]
    return _Exclusions(
        frozenset(expanded),
        tuple(expanded),
        re.compile("|".join(re.escape(p) for p in sorted(expanded, key=len, reverse=True))),
        # fnmatch: translate + match (POSIX case)
        re.compile("|".join(f"(?:{translate(p)})" for p in wild)) if wild else None,
    )


def modelopt_excluded(
    prefix: str, patterns: Sequence[str], packed_groups: Mapping[str, tuple[str, ...]] | None = None
) -> bool:
    """ModelOpt-format exclusion as vLLM resolves it: exact (fused-aware), substring, fnmatch."""
    if not patterns:
        return False
    rules = _exclusions(tuple(patterns))
    expanded = rules.expanded
    packed = packed_base(prefix, packed_groups)
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
    return prefix in expanded or (rules.glob is not None and rules.glob.match(prefix) is not None)


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
    packed = packed_base(prefix, packed_groups)
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
    packed = packed_base(prefix, packed_groups)
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
MOE_METHODS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "FP8_PB_WO": ("FP8-block", "Fp8MoEMethod (block)", ("weight", "weight_scale_inv")),
    "FP8_BLOCK_SCALES": ("FP8-block", "Fp8MoEMethod (block)", ("weight", "weight_scale_inv")),
    "FP8": ("FP8", "ModelOptFp8MoEMethod", ("weight", "weight_scale", "input_scale")),
    "NVFP4": ("NVFP4", "ModelOptNvFp4FusedMoE", ("weight", "weight_scale", "weight_scale_2", "input_scale")),
    "W4A16_NVFP4": ("NVFP4", "ModelOptNvFp4FusedMoE (W4A16)", ("weight", "weight_scale", "weight_scale_2")),
}
UNQUANTIZED_MOE = ("BF16", "UnquantizedFusedMoEMethod", ("weight",))
# Linears under MIXED_PRECISION: algos outside LINEAR_ALGOS get UnquantizedLinearMethod (modelopt.py 1850-1858).
LINEAR_FORMATS = {
    "FP8": "FP8",
    "FP8_PER_CHANNEL_PER_TOKEN": "FP8",
    "FP8_PB_WO": "FP8-PB",
    "NVFP4": "NVFP4",
    "W4A16_NVFP4": "NVFP4",
}


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


def declared_format(
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
            return MOE_METHODS[resolved][0] if resolved in MOE_METHODS else None
        return LINEAR_FORMATS.get(resolved)
    return LINEAR_FORMATS.get(algo)


def mtp_load_refusal(
    engine: str, precision: Mapping[str, str], meta: QuantMetadata | None, rules: EngineRules = _QWEN3
) -> str | None:
    """Why ``engine`` (a key of ``engine.table``) does not load an MTP stored as ``precision`` (every MTP Linear ->
    its on-disk precision: ``BF16``, ``NVFP4``, ``FP8``, ...) under ``meta``, or None when every module loads.

    Each module as the engine builds it (``engine_modules``: packed groups and routed experts are one module whose
    members share one precision) must be built quantized exactly when it is stored quantized, in the format its
    metadata declares (the engine module's ``build_expectation``: vLLM's per-module rules, SGLang's decision for the
    whole MTP first). The precision search (``convert --mtp auto``) asks it of every configuration before measuring
    one.
    """
    from mtpquant.engine.table import engine as engine_row

    build = engine_row(engine).adapter.build_expectation
    packed = rules.packed
    for module in engine_modules(sorted(precision), rules):
        disks = sorted({precision[m] for m in module.members})
        if len(disks) > 1:
            return f"{engine}: {module.prefix} is one module, its members are stored as {', '.join(disks)}"
        disk = disks[0]
        try:
            e = build(module, meta, rules)
            if e.refusal is not None:
                return f"{engine}: {e.refusal}"
            expects = declared_format(module.prefix, meta, packed, module.kind == "experts") if meta else None
        except FusedShardsError as exc:
            return f"{engine}: {exc}"
        stored = is_quantized(disk)
        if e.quantized != stored:
            how = "quantized" if e.quantized else "unquantized"
            return f"{engine} builds {module.prefix} {how} ({e.reason}), but it is {disk} on disk"
        if e.quantized and expects is not None and expects != disk:
            return f"{engine} loads {module.prefix} as {expects} ({e.reason}), but it is {disk} on disk"
    return None


_WILDCARDS = re.compile(r"[*?\[\]]+")


def unmatched_exclusions(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """The exclusion entries that can match no module of ``names`` (checkpoint module names, and the engines' own
    names of them) by any engine's rule: what a ModelOpt export once wrote with a corrupt suffix (TensorRT-LLM PR
    #18607: the Nemotron-3-Ultra export's ``exclude_modules`` matched nothing, so the modules were quantized anyway).

    Every engine's match (vLLM's and SGLang's substring or ``fnmatch``, TensorRT-LLM's ``fnmatchcase`` on a name or an
    ancestor, a ``re:`` entry) needs each literal run of the pattern inside some name, so an entry whose longest
    literal run is in none matches nothing anywhere. Most runs are a name's start (found by bisection in the sorted
    names); the others are looked for in the joined names, joined only when one is."""
    ordered = sorted(names)
    blob: str | None = None
    out: list[str] = []
    for p in patterns:
        if p.startswith("re:"):
            blob = blob if blob is not None else "\n".join(ordered)
            try:
                hit = re.search(f"(?m)^(?:{p[3:]})", blob) is not None
            except re.error:
                hit = False
        else:
            literal = max(_WILDCARDS.split(p), key=len)
            i = bisect.bisect_left(ordered, literal)
            hit = i < len(ordered) and ordered[i].startswith(literal)
            if not hit:
                blob = blob if blob is not None else "\n".join(ordered)
                hit = literal in blob
        if not hit:
            out.append(p)
    return out
