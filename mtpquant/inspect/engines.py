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

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fnmatch import translate
from typing import Any

from mtpquant.formats.quant_config import QuantMetadata

__all__ = [
    "INC_DATA_TYPES",
    "EngineModule",
    "FusedShardsError",
    "auto_round_quantized",
    "ct_ignored",
    "engine_modules",
    "expand_modelopt_patterns",
    "modelopt_excluded",
    "sglang_builds_quantized",
    "sglang_mtp_build",
    "vllm_builds_quantized",
    "vllm_format_refusal",
]

# vLLM packs these checkpoint Linears into one module; the shards must agree on precision.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
# Modules vLLM builds without any quantization config (router and shared-expert gate).
ALWAYS_UNQUANTIZED = ("mlp.gate", "mlp.shared_expert_gate")
# Element types vLLM 0.32's INC (AutoRound) config accepts: INCConfig.SUPPORTED_DTYPES, plus the mx_fp family.
INC_DATA_TYPES = ("int", "fp", "mx_fp")
_REGEX_CHARS = set(r"*+?^$()[]{}|\\")


class FusedShardsError(ValueError):
    """vLLM refuses a fused module whose shards disagree on being excluded."""


@dataclass(frozen=True)
class EngineModule:
    """One module as the engine builds it: its prefix and the checkpoint Linears it holds."""

    prefix: str
    members: tuple[str, ...]  # checkpoint module names (tensor name without `.weight` etc.)
    kind: str  # "linear" | "packed" | "experts" | "unquantized"


def expand_modelopt_patterns(patterns: Sequence[str]) -> list[str]:
    """vLLM's ``apply_vllm_mapper`` rewrite: ``X*`` (X not ending in '.') becomes ``X`` and ``X.*``."""
    out: list[str] = []
    for p in patterns:
        if len(p) >= 2 and p[-1] == "*" and p[-2] != ".":
            out += [p[:-1], p[:-1] + ".*"]
        else:
            out.append(p)
    return out


def _packed_base(prefix: str) -> tuple[str, tuple[str, ...]] | None:
    base, _, last = prefix.rpartition(".")
    shards = PACKED.get(last)
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


def modelopt_excluded(prefix: str, patterns: Sequence[str]) -> bool:
    """ModelOpt-format exclusion as vLLM resolves it: exact (fused-aware), substring, fnmatch."""
    if not patterns:
        return False
    rules = _exclusions(tuple(patterns))
    expanded = rules.expanded
    packed = _packed_base(prefix)
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


def ct_ignored(prefix: str, patterns: Sequence[str]) -> bool:
    """compressed-tensors ``ignore``: exact names or ``re:`` regexes only; fused shards must agree."""
    packed = _packed_base(prefix)
    if packed is not None:
        base, shards = packed
        hits = [_ct_match(f"{base}.{s}", patterns) for s in shards]
        if any(hits) and not all(hits):
            raise FusedShardsError(f"some but not all shards of {prefix} are in the compressed-tensors ignore list")
        return all(hits)
    return _ct_match(prefix, patterns)


def _mixed_quantized(prefix: str, meta: QuantMetadata) -> bool:
    layers = meta.quantized_layers
    packed = _packed_base(prefix)
    if packed is not None:
        base, shards = packed
        hits = [f"{base}.{s}" in layers for s in shards]
        if any(hits) and not all(hits):
            raise FusedShardsError(f"some but not all shards of {prefix} are listed in quantized_layers")
        return all(hits)
    if prefix.endswith(".experts"):
        return any(k.startswith(prefix + ".") for k in layers)
    return prefix in layers


def vllm_format_refusal(meta: QuantMetadata | None) -> str | None:
    """Why vLLM refuses the checkpoint's quantization format outright (before any MTP question), or None."""
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


def vllm_builds_quantized(module: EngineModule, meta: QuantMetadata | None) -> tuple[bool, str]:
    """Whether vLLM builds the module quantized, and a short reason. Raises FusedShardsError."""
    if meta is None:
        return False, "checkpoint declares no quantization"
    if module.kind == "unquantized":
        return False, "vLLM builds it without a quantization config"
    if meta.is_compressed_tensors:
        ignored = ct_ignored(module.prefix, meta.exclude)
        return (not ignored, "in compressed-tensors ignore" if ignored else "not in compressed-tensors ignore")
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        q = _mixed_quantized(module.prefix, meta)
        return q, "listed in quantized_layers" if q else "absent from quantized_layers"
    if meta.is_modelopt:
        if module.prefix == "mtp.fc" and meta.vllm_method == "modelopt_fp4":
            excluded = modelopt_excluded(module.prefix, meta.exclude)
            return False, "excluded" if excluded else "forced unquantized by vLLM's mtp.fc workaround"
        excluded = modelopt_excluded(module.prefix, meta.exclude)
        return (not excluded, "excluded" if excluded else "not excluded")
    if meta.is_auto_round:
        return auto_round_quantized(module.prefix, meta)
    return True, f"quant_method {meta.method!r}"


_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)(\.\d+\.\w+|\.gate_up_proj|\.down_proj)$")


def engine_modules(linear_names: Sequence[str]) -> list[EngineModule]:
    """Group checkpoint Linear module names into the modules vLLM builds (packed, experts)."""
    out: dict[str, EngineModule] = {}
    reverse = {shard: packed for packed, shards in PACKED.items() for shard in shards}
    for name in sorted(linear_names):
        base, _, last = name.rpartition(".")
        m = _EXPERT_RE.match(name) if ".mlp.experts." in name else None
        if m:
            prefix = m.group(1)
            prev = out.get(prefix)
            out[prefix] = EngineModule(prefix, (*(prev.members if prev else ()), name), "experts")
            continue
        if any(name.endswith("." + u) for u in ALWAYS_UNQUANTIZED):
            out[name] = EngineModule(name, (name,), "unquantized")
            continue
        packed = reverse.get(last)
        if packed is not None:
            prefix = f"{base}.{packed}"
            prev = out.get(prefix)
            out[prefix] = EngineModule(prefix, (*(prev.members if prev else ()), name), "packed")
            continue
        out[name] = EngineModule(name, (name,), "linear")
    return list(out.values())


def sglang_mtp_build(meta: QuantMetadata | None) -> tuple[bool, str]:
    """Whether SGLang builds the MTP with the checkpoint's quantization at all, and why (see the module docstring)."""
    if meta is None:
        return False, "the checkpoint declares no quantization"
    method = meta.vllm_method  # SGLang names the ModelOpt and compressed-tensors formats as vLLM does
    if method == "modelopt_fp4":
        return False, "SGLang builds the MTP of a serialized modelopt_fp4 checkpoint in BF16"
    if method == "modelopt_mixed":
        if any(name.startswith("mtp.") for name in meta.quantized_layers):
            return True, "modelopt_mixed lists mtp.* modules in quantized_layers"
        return False, "SGLang builds the MTP in BF16: modelopt_mixed lists no mtp.* module in quantized_layers"
    return True, f"SGLang builds the MTP with the checkpoint's {method} quantization"


def sglang_builds_quantized(module: EngineModule, meta: QuantMetadata | None) -> tuple[bool, str]:
    """Whether SGLang builds this MTP module quantized, and a short reason. Raises FusedShardsError."""
    if module.prefix == "mtp.fc":
        return False, "SGLang builds mtp.fc as a plain Linear"
    if module.kind == "unquantized":
        return False, "SGLang builds it without a quantization config"
    whole, why = sglang_mtp_build(meta)
    if not whole or meta is None:
        return False, why
    if meta.is_compressed_tensors:
        ignored = ct_ignored(module.prefix, meta.exclude)
        return not ignored, "in compressed-tensors ignore" if ignored else "not in compressed-tensors ignore"
    if meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        q = _mixed_quantized(module.prefix, meta)
        return q, "listed in quantized_layers" if q else "absent from quantized_layers"
    if meta.is_modelopt:
        excluded = modelopt_excluded(module.prefix, meta.exclude)
        return not excluded, "excluded" if excluded else "not excluded"
    return True, why
