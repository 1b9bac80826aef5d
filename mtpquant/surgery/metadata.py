"""The metadata side of an MTP: its declaration in config.json and its quantization exclusions, planned here for
convert's outputs and graft's repairs alike (``plan_metadata``, from the result's tensor table).

Engines decide per module whether a Linear is quantized from the exclusion lists, so an MTP kept
unquantized must be covered in every file that declares quantization: ``hf_quant_config.json``
``exclude_modules`` and ``config.json`` ``quantization_config.ignore``. Matching follows the engines
(``mtpquant.engine.loading``): ModelOpt lists by exact name, substring or fnmatch with ``X*`` also
covering ``X`` and ``X.*``; compressed-tensors lists by exact name or ``re:`` regex only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mtpquant.checkpoint.precision import is_quantized, linear_precisions
from mtpquant.engine.loading import FusedShardsError, ct_ignored, mixed_algo, modelopt_excluded
from mtpquant.engine.table import ENGINES
from mtpquant.families import ModelSpec, nested_key, resolve
from mtpquant.families.storage import APPENDED
from mtpquant.formats.quant_config import (
    HF_QUANT_CONFIG,
    QuantMetadata,
    exclusion_lists,
    with_exclusions,
)
from mtpquant.surgery.repairs import repair_labels

__all__ = [
    "MetadataPlan",
    "declare_mtp",
    "mtp_modules",
    "plan_metadata",
    "spec_with_mtp_layers",
    "uncovered_modules",
]

# A layer's routed experts: one engine module (vLLM's FusedMoE ``{layer}.mlp.experts``), matched as a whole.
_EXPERT_BANKS = ("mlp.experts", "mixer.experts")

def mtp_modules(spec: ModelSpec, precision: Mapping[str, str]) -> dict[str, bool]:
    """Every MTP Linear module of ``spec``'s family (and the engine's packed names for them) -> whether it is stored
    unquantized.

    ``precision`` maps every Linear of a table to its precision on disk (``checkpoint.precision.linear_precisions``:
    the one rule of what a Linear is, and of what is quantized). Packed groups are the family's
    (``EngineRules.packed``); routed experts are one engine module too.
    """
    names = spec.mtp_names
    modules = {m: not is_quantized(p) for m, p in precision.items() if names.matcher(m)}
    # vLLM packs q/k/v into qkv_proj and gate/up into gate_up_proj and matches exclusions on those
    # prefixes too (vllm/model_executor/models/qwen3_next_mtp.py, packed_modules_mapping).
    groups = spec.family.engine.packed
    fused: dict[str, list[str]] = {}
    for stem in modules:
        layer = names.layer_prefix(stem)
        if layer is None:
            continue
        block = next((b for b in _EXPERT_BANKS if stem.startswith(f"{layer}{b}.")), None)
        if block is not None:  # routed experts: one engine module, whatever their leaves
            fused.setdefault(layer + block, []).append(stem)
            continue
        for fused_name, shards in groups.items():
            for shard in shards:
                if stem.endswith("." + shard):
                    fused.setdefault(f"{stem[: -len(shard) - 1]}.{fused_name}", []).append(stem)
    for fused_name, group in fused.items():
        modules[fused_name] = all(modules[m] for m in group)
    return dict(sorted(modules.items()))


def _expert_bank(module: str, spec: ModelSpec) -> bool:
    """Whether ``module`` is an MTP layer's routed-expert bank (``model.layers.92.mlp.experts``)."""
    layer = spec.mtp_names.layer_prefix(module)
    return layer is not None and module in {layer + b for b in _EXPERT_BANKS}


def uncovered_modules(
    modules: Iterable[str],
    patterns: Iterable[str],
    compressed_tensors: bool,
    engine_name: Callable[[str], str] | None = None,
) -> list[str]:
    """Modules that no exclusion pattern covers, by the matching rules of the list's format; with ``engine_name``
    (the engine's draft renames MTP modules: ``ModelSpec.engine_mtp_name``) a module is covered only when both its
    checkpoint name and the engine's are."""
    patterns = list(patterns)
    match = ct_ignored if compressed_tensors else modelopt_excluded
    out = []
    for m in modules:
        try:
            covered = match(m, patterns)
            if covered and engine_name is not None and engine_name(m) != m:
                covered = match(engine_name(m), patterns)
        except FusedShardsError:  # some members of a fused module excluded, some not: not covered
            covered = False
        if not covered:
            out.append(m)
    return out


@dataclass(frozen=True)
class MetadataPlan:
    """New contents of config.json / hf_quant_config.json (None: unchanged) and what changed."""

    config: dict[str, Any] | None = None
    hf_quant_config: dict[str, Any] | None = None
    changes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def changed_files(self) -> list[str]:
        """Names of the JSON files this plan rewrites."""
        out = []
        if self.hf_quant_config is not None:
            out.append(HF_QUANT_CONFIG)
        if self.config is not None:
            out.append("config.json")
        return out


def _insert_after(target: dict[str, Any], key: str, value: Any, order: list[str]) -> dict[str, Any]:
    """``target`` with ``key`` inserted where ``order`` (the reference key order) puts it."""
    if key in target:
        return {**target, key: value}
    anchor = None
    if key in order:
        for k in reversed(order[: order.index(key)]):
            if k in target:
                anchor = k
                break
    if anchor is None and key in order and any(k in target for k in order):
        # key comes first in the reference order: put it first
        return {key: value, **target}
    out: dict[str, Any] = {}
    for k, v in target.items():
        out[k] = v
        if k == anchor:
            out[key] = value
    if key not in out:
        out[key] = value
    return out


def declare_mtp(spec: ModelSpec, layers: int, reference: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``spec.config`` declaring ``layers`` MTP layers: the one declaration rule convert and graft use.

    ``layers > 0``: the depth key the config already uses (else the family's first, e.g.
    ``text_config.mtp_num_hidden_layers``) set to it; a key that is absent goes where ``reference`` (SRC's
    config) has it, else at the end. The position matters for "extract then graft == keep, bit for bit".
    ``layers == 0``: a key that is present is set to 0 in place (not removed: no engine can then default it back
    to one layer, and a later graft restores the value at the same position); an absent key stays absent unless
    engines would assume a layer without it (Qwen4-Exp), then it is written as 0. Families without a key
    (Qwen3-Next, engines assume one layer) are unchanged.
    """
    keys = spec.family.mtp.depth_keys
    config = copy.deepcopy(dict(spec.config))
    if not keys:
        return config
    target = config["text_config"] if spec.wrapped else config
    key = next((k for k in keys if nested_key(config, k) is not None), keys[0]) if spec.family.mtp.depth_at_top or any(
        "." in k for k in keys) else next((k for k in keys if target.get(k) is not None), keys[0])
    if "." in key or spec.family.mtp.depth_at_top:  # a path from the top level (Inkling: mtp_config.*)
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            child = node.get(part)
            node[part] = child = dict(child) if isinstance(child, Mapping) else {}
            node = child
        if layers > 0 or leaf in node or spec.family.mtp.default_layers > 0:
            node[leaf] = max(layers, 0)
        return config
    if layers <= 0:
        if key in target or spec.family.mtp.default_layers > 0:
            target[key] = 0
        _per_layer_lists(spec, target, 0, {})
        return config
    ref_text: Mapping[str, Any] = {}
    if reference is not None:
        ref_text = reference.get("text_config", reference) if spec.wrapped else reference
        if not isinstance(ref_text, Mapping):
            ref_text = {}
    if spec.wrapped:
        config["text_config"] = _insert_after(config["text_config"], key, layers, list(ref_text))
        _per_layer_lists(spec, config["text_config"], layers, ref_text)
    else:
        config = _insert_after(config, key, layers, list(ref_text))
        _per_layer_lists(spec, config, layers, ref_text)
    assert resolve(config).mtp.layers == layers
    return config


# Per-layer lists an appended-layer family's release may pad with its MTP layers' entries (Step-3.5: layer_types,
# swiglu limits, per-layer RoPE; transformers' Step3p7TextConfig splits them off, vLLM's Step3p5DecoderLayer indexes
# them by the layer's number)
_PER_LAYER_KEYS = ("layer_types", "mlp_layer_types", "swiglu_limits", "swiglu_limits_shared", "rope_theta",
                   "partial_rotary_factors")


def _per_layer_lists(spec: ModelSpec, text: dict[str, Any], layers: int, reference: Mapping[str, Any]) -> None:
    """Keep an appended-layer family's padded per-layer lists in step with the declared depth, in place: undeclared
    (``layers`` 0), the MTP layers' trailing entries go (a list of ``num_hidden_layers`` + old depth entries is cut
    to ``num_hidden_layers``: transformers refuses a list longer than the layers it builds); declared, a list the
    reference (SRC) pads to ``num_hidden_layers + layers`` is taken from it."""
    if spec.family.mtp.storage.kind != APPENDED or not isinstance(n := text.get("num_hidden_layers"), int):
        return
    for key in _PER_LAYER_KEYS:
        value, ref = text.get(key), reference.get(key)
        if not isinstance(value, list):
            continue
        if layers == 0 and len(value) == n + spec.mtp.layers and spec.mtp.layers > 0:
            text[key] = value[:n]
        elif layers > 0 and len(value) == n and isinstance(ref, list) and len(ref) == n + layers and ref[:n] == value:
            text[key] = list(ref)


def spec_with_mtp_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """``spec`` as if its config declared ``layers`` MTP layers (``declare_mtp``; families without a key: unchanged)."""
    if spec.family.mtp_key is None or spec.mtp.layers == layers:
        return spec
    return resolve(declare_mtp(spec, layers))


def plan_metadata(
    spec: ModelSpec,
    hf_quant_config: Mapping[str, Any] | None,
    tensors: Mapping[str, Any],
    *,
    mtp_layers: int,
    reference_config: Mapping[str, Any] | None = None,
    precision: Mapping[str, str] | None = None,
) -> MetadataPlan:
    """What config.json / hf_quant_config.json need so that the MTP in ``tensors`` is declared and excluded.

    ``tensors`` is the full tensor table of the result (name -> header entry); ``precision``: its
    ``linear_precisions``, where the caller has them (``Checkpoint.linear_precisions``). Unquantized MTP
    modules must be excluded everywhere quantization is declared; when every MTP module is
    unquantized the family patterns are added (``mtp*``; ``re:^mtp\\..*`` for compressed-tensors),
    otherwise the exact names of the uncovered unquantized modules.
    """
    changes: list[str] = []
    warnings: list[str] = []
    config: dict[str, Any] = copy.deepcopy(dict(spec.config))
    if mtp_layers > 0 and spec.family.mtp_key is not None and spec.mtp.layers != mtp_layers:
        config = declare_mtp(spec, mtp_layers, reference_config)
        where = resolve(config).mtp.key
        before = "absent" if spec.mtp.key is None else repr(spec.mtp.value)
        changes.append(f"config.json: {where} = {mtp_layers} (was {before})")
    elif mtp_layers == 0 and spec.mtp.declared and spec.family.mtp_key and not any(
        map(spec.mtp_names.matcher, tensors)
    ):
        config = declare_mtp(spec, 0)
        changes.append(
            f"config.json: {spec.mtp.key} = 0 (was {spec.mtp.value!r}): no MTP tensors, so the declaration engines "
            "would wait for is removed (graft --from SRC puts the MTP back instead)"
        )

    hfq = copy.deepcopy(dict(hf_quant_config)) if hf_quant_config is not None else None
    precision = linear_precisions(tensors) if precision is None else precision
    config, hfq, meta = repair_labels(spec, config, hfq, tensors, precision, changes)
    lists = exclusion_lists(config, hfq)  # the repaired files' lists, read with their metadata
    borrowed = spec.mtp_borrowed_head(tensors)
    if borrowed is not None and any(map(spec.mtp_names.matcher, tensors)):  # the draft's head holds the lm_head
        precision = {**precision, borrowed[0]: precision.get(borrowed[1], "missing")}
    modules = mtp_modules(spec, precision)
    rename = spec.engine_mtp_name if spec.family.mtp.engine_rename is not None else None
    unquantized = [m for m, plain in modules.items() if plain]
    all_plain = len(unquantized) == len(modules)
    if meta is not None and meta.is_modelopt and meta.algo.upper() == "MIXED_PRECISION":
        # MIXED_PRECISION builds a module unquantized unless quantized_layers lists it: only listed ones need more
        unquantized = [m for m in unquantized if _listed(m, meta, spec.family.engine.packed)]
    if meta is not None and unquantized:
        missing = {f: uncovered_modules(unquantized, pats, ct, rename) for f, ct, pats in lists}
        if any(missing.values()):
            if all_plain:
                modelopt, ct = (list(p) for p in resolve(config).mtp_exclusion_patterns(mtp_layers or None))
            else:
                # exact names of real modules (vLLM treats a fused group as excluded when all members are) and of
                # routed-expert banks, which vLLM builds as one FusedMoE matched by its own name
                # (ModelOptQuantConfigBase.is_layer_excluded): an MTP whose experts alone stay BF16
                names = sorted({m for ms in missing.values() for m in ms if m in precision or _expert_bank(m, spec)})
                if rename is not None:
                    names = sorted({*names, *(rename(m) for m in names)})
                modelopt, ct = names, names
            config, hfq = with_exclusions(config, hfq, modelopt, ct)
            old_lists, lists = lists, exclusion_lists(config, hfq)
            for f, is_ct, pats in lists:
                old = next((p for g, _, p in old_lists if g == f), [])
                added = [p for p in pats if p not in old]
                if added:
                    what = "ignore" if f == "config.json" else "exclude_modules"
                    changes.append(f"{f}: {what} += {', '.join(added)}")
                still = uncovered_modules(unquantized, pats, is_ct, rename)
                if still:
                    warnings.append(f"{f}: MTP module {still[0]} is still not excluded")
    partial = unquantized and not all_plain
    if meta is not None and meta.is_modelopt and partial and meta.algo.upper() != "MIXED_PRECISION":
        # the unquantized modules of a partly quantized MTP by every drafting engine's own name of them (TensorRT-LLM's
        # model.layers.<n>.fc for Qwen's mtp.fc: engine/trtllm.py), where a ModelOpt list lacks it: each engine
        # matches exclusions against the modules it builds (ModelOpt lists only: TensorRT-LLM's rules are ModelOpt's)
        drafting = [row for row in ENGINES if spec.family.engine.drafters.get(row.key)]
        own = sorted({n for row in drafting for n in row.adapter.module_names(unquantized, spec)} - set(unquantized))
        lacking = [n for n in own if any(n not in pats for _, is_ct, pats in lists if not is_ct)]
        if lacking:
            config, hfq, lists = _add_modelopt_forms(config, hfq, lists, lacking, changes)
    if meta is not None and meta.is_modelopt and all_plain and unquantized and meta.algo.upper() != "MIXED_PRECISION":
        # the whole-MTP patterns in every engine's form (TensorRT-LLM's model.layers.<n>* too): a list that covers
        # the MTP for vLLM only gets the forms it lacks (ModelOpt lists only; compressed-tensors lists are vLLM's)
        family_patterns = resolve(config).mtp_exclusion_patterns(mtp_layers or None)[0]
        lacking = [p for p in family_patterns if any(p not in pats for _, is_ct, pats in lists if not is_ct)]
        if lacking:
            config, hfq, lists = _add_modelopt_forms(config, hfq, lists, lacking, changes)
    quantized_but_excluded = [
        (f, m)
        for f, ct, pats in lists
        for m, plain in modules.items()
        if not plain and not uncovered_modules([m], pats, ct)
    ]
    if quantized_but_excluded:
        f, m = quantized_but_excluded[0]
        warnings.append(
            f"{f}: MTP module {m} is stored quantized but excluded; engines will fail to load it "
            "(exclusions are only ever added here, never removed)"
        )
    return MetadataPlan(
        config if config != spec.config else None,
        hfq if hfq is not None and hfq != hf_quant_config else None,
        tuple(changes),
        tuple(warnings),
    )


def _add_modelopt_forms(
    config: dict[str, Any],
    hfq: dict[str, Any] | None,
    lists: list[tuple[str, bool, list[str]]],
    patterns: list[str],
    changes: list[str],
) -> tuple[dict[str, Any], dict[str, Any] | None, list[tuple[str, bool, list[str]]]]:
    """``patterns`` added to the ModelOpt exclusion lists (an engine's own form of names already excluded), each
    addition a line of ``changes``; the new lists."""
    config, hfq = with_exclusions(config, hfq, patterns, ())
    old_lists, lists = lists, exclusion_lists(config, hfq)
    for f, is_ct, pats in lists:
        old = next((p for g, _, p in old_lists if g == f), [])
        added = [p for p in pats if p not in old]
        if added and not is_ct:
            what = "ignore" if f == "config.json" else "exclude_modules"
            changes.append(f"{f}: {what} += {', '.join(added)}")
    return config, hfq, lists


def _listed(module: str, meta: QuantMetadata, packed: Mapping[str, tuple[str, ...]]) -> bool:
    try:
        return mixed_algo(module, meta, packed) is not None
    except FusedShardsError:
        return True
