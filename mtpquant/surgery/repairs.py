"""Metadata repairs beyond the MTP's exclusions, decided from the tensors and the registry, one line each.

- day-0 labels: an architecture / model_type alias the engines do not know, relabelled to the family's
  canonical name (the weights are the same);
- MIXED_PRECISION ``quantized_layers``: MTP entries written under the engine's layer index (vLLM renames the
  checkpoint's ``mtp.layers.i`` itself, so such names are renamed twice) put back under the checkpoint's index,
  and routed experts whose label selects a method that cannot load their tensors relabelled from what is on
  disk (block-scaled FP8 with ``weight_scale_inv`` -> ``FP8_PB_WO``);
- embedding tables the engine cannot quantize (the Qwen4-Exp PLE n-gram table) excluded by exact name where a
  ModelOpt / compressed-tensors config would otherwise make vLLM raise.

Every repair edits both ``config.json`` and ``hf_quant_config.json`` where they declare the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtpquant.checkpoint.header import FLOAT_DTYPES
from mtpquant.checkpoint.precision import table_precision
from mtpquant.engine.loading import FusedShardsError, engine_modules, mixed_algo
from mtpquant.engine.vllm import vllm_expectation
from mtpquant.families import ModelSpec
from mtpquant.formats.kinds import FP8, FP8_BLOCK, NVFP4, StorageKind, by_label
from mtpquant.formats.quant_config import HF_QUANT_CONFIG, QuantMetadata, read_quant_metadata, with_exclusions

__all__ = ["repair_labels"]

# The label that selects the method loading what is on disk (vLLM 0.32 modelopt.py 1864-1890).
_LABEL_FOR_DISK: dict[StorageKind, dict[str, Any]] = {
    FP8_BLOCK: {"quant_algo": "FP8_PB_WO", "group_size": 128},
    NVFP4: {"quant_algo": "NVFP4", "group_size": 16},
    FP8: {"quant_algo": "FP8"},
}


@dataclass(frozen=True)
class _Checkpoint:
    """What the repairs read (the model, its tensors and their precision on disk) and where they say what they did."""

    spec: ModelSpec
    tensors: Mapping[str, Any]
    precision: Mapping[str, str]
    changes: list[str]


def _relabel_aliases(ck: _Checkpoint, config: dict[str, Any]) -> None:
    for where, alias, canonical in ck.spec.aliases():
        if where.startswith("architectures["):
            i = int(where[len("architectures[") : -1])
            config["architectures"][i] = canonical
        elif where == "model_type":
            config["model_type"] = canonical
        else:
            config["text_config"]["model_type"] = canonical
        ck.changes.append(f"config.json: {where} {alias} -> {canonical} (the day-0 label engines do not know)")


def _layer_maps(config: dict[str, Any], hfq: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """(file, the quantized_layers dict itself) for every MIXED_PRECISION declaration."""
    out: list[tuple[str, dict[str, Any]]] = []
    q = hfq.get("quantization") if hfq is not None else None
    if isinstance(q, dict) and isinstance(q.get("quantized_layers"), dict):
        out.append((HF_QUANT_CONFIG, q["quantized_layers"]))
    qc = config.get("quantization_config")
    if isinstance(qc, dict):
        nested = qc.get("quantization")
        holder = nested if isinstance(nested, dict) else qc
        if isinstance(holder.get("quantized_layers"), dict):
            out.append(("config.json", holder["quantized_layers"]))
    return out


def _sort_in_place(layers: dict[str, Any]) -> None:
    """``quantized_layers`` back in name order, the dict itself (its config file holds it)."""
    ordered = dict(sorted(layers.items()))
    layers.clear()
    layers.update(ordered)


def _rename_engine_indices(ck: _Checkpoint, layer_maps: list[tuple[str, dict[str, Any]]]) -> None:
    if not ck.spec.family.mtp.engine_layer_offset:
        return
    n = ck.spec.dim("num_hidden_layers")
    names = ck.spec.mtp_names
    held = {d for t in ck.tensors if (d := names.depth_of(t)) is not None}
    root = names.roots[0]
    for f, layers in layer_maps:
        renamed = 0
        for key in list(layers):
            d = names.depth_of(key)
            prefix = names.layer_prefix(key)
            if d is not None and prefix is not None and d not in held and d - n in held:
                new = f"{root}{d - n}.{key[len(prefix) :]}"
                layers[new] = layers.pop(key)
                renamed += 1
        if renamed:
            _sort_in_place(layers)
            ck.changes.append(
                f"{f}: quantized_layers: {renamed} MTP entries renamed from the engine's layer index "
                f"{root}{n}+i to the checkpoint's {root}i (vLLM adds num_hidden_layers itself)"
            )


def _relabel_experts(ck: _Checkpoint, config: dict[str, Any], hfq: dict[str, Any] | None, meta: QuantMetadata) -> None:
    layer_maps = _layer_maps(config, hfq)
    if not layer_maps:
        return
    rules, precision = ck.spec.family.engine, ck.precision
    names = [m for m in precision if ck.spec.is_mtp(m)]
    for mod in engine_modules(names, rules):
        if mod.kind != "experts":
            continue
        disks = {precision[m] for m in mod.members}
        if len(disks) != 1:
            continue
        (disk,) = disks
        stored = by_label(disk)
        want = None if stored is None else _LABEL_FOR_DISK.get(stored)
        try:
            e = vllm_expectation(mod, meta, rules)
            algo = mixed_algo(mod.prefix, meta, rules.packed)
        except FusedShardsError:
            continue
        if want is None or (e.quantized and e.expects == disk):
            continue
        for f, layers in layer_maps:
            for m in mod.members:
                layers[m] = dict(want)
            _sort_in_place(layers)
            # a block scale under a name the method does not register by default
            note = f" ({stored.scales[0]} on disk)" if stored is not None and stored.blocks else ""
            ck.changes.append(
                f"{f}: quantized_layers: {mod.prefix} ({len(mod.members)} entries) {algo or 'absent'} -> "
                f"{want['quant_algo']}{note}"
            )


def _exclude_tables(
    ck: _Checkpoint, config: dict[str, Any], hfq: dict[str, Any] | None, meta: QuantMetadata
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    rules = ck.spec.family.engine
    if not rules.embedding_tables or meta.algo.upper() == "MIXED_PRECISION":
        return config, hfq
    names = [m for m in ck.precision if not ck.spec.is_mtp(m)]
    refused = [
        mod.prefix
        for mod in engine_modules(names, rules)
        if mod.kind == "embedding"
        and table_precision(ck.tensors, mod.prefix, mod.members) in FLOAT_DTYPES
        and vllm_expectation(mod, meta, rules).refusal is not None
    ]
    if not refused:
        return config, hfq
    new_config, new_hfq = with_exclusions(config, hfq, refused, refused)
    for f in ([HF_QUANT_CONFIG] if new_hfq != hfq else []) + (["config.json"] if new_config != config else []):
        what = "ignore" if f == "config.json" else "exclude_modules"
        ck.changes.append(f"{f}: {what} += {', '.join(refused)} (vLLM raises on an n-gram table it would quantize)")
    return new_config, new_hfq


def repair_labels(
    spec: ModelSpec,
    config: dict[str, Any],
    hfq: dict[str, Any] | None,
    tensors: Mapping[str, Any],
    precision: Mapping[str, str],
    changes: list[str],
) -> tuple[dict[str, Any], dict[str, Any] | None, QuantMetadata | None]:
    """``config`` / ``hfq`` (edited copies) with the label repairs applied, and the quantization they declare then
    (None: none); one line per repair in ``changes``. ``precision``: every Linear of ``tensors`` -> its precision on
    disk (``checkpoint.precision.linear_precisions``). The metadata is parsed once, and again only after a repair
    changed it."""
    ck = _Checkpoint(spec, tensors, precision, changes)
    _relabel_aliases(ck, config)
    _rename_engine_indices(ck, _layer_maps(config, hfq))
    meta = read_quant_metadata(config, hfq)
    if meta is None:
        return config, hfq, None
    before = len(changes)
    _relabel_experts(ck, config, hfq, meta)
    if len(changes) != before:
        meta = read_quant_metadata(config, hfq)
        assert meta is not None
    new_config, new_hfq = _exclude_tables(ck, config, hfq, meta)
    if new_config is not config or new_hfq is not hfq:
        meta = read_quant_metadata(new_config, new_hfq)
    return new_config, new_hfq, meta
