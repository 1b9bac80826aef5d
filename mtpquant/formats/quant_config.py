"""Quantization metadata: ``hf_quant_config.json`` and ``config.json`` ``quantization_config``.

Reads both forms engines accept (ModelOpt's nested ``quantization`` block and the flat
``quantization_config``; compressed-tensors' ``ignore`` list) into one view, and edits exclusion
lists in both files so they always agree. ``config.json``'s ``quantization_config`` is found where vLLM finds it:
at the top level, else in ``text_config`` (``quantization_config_of``); reading, listing the exclusion lists
(``exclusion_lists``) and editing them all go through that one lookup.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mtpquant.errors import ConfigError

__all__ = [
    "HF_QUANT_CONFIG",
    "QuantMetadata",
    "exclusion_lists",
    "mixed_precision_config",
    "quantization_config_of",
    "read_quant_metadata",
    "with_exclusions",
    "without_exclusions",
]

HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class QuantMetadata:
    """The quantization a checkpoint declares, however it is spelled."""

    method: str  # "modelopt" | "compressed-tensors" | other quant_method
    algo: str  # "NVFP4", "FP8", "MIXED_PRECISION", "W4A16_NVFP4", "nvfp4-pack-quantized", ...
    group_size: int | None
    kv_cache_algo: str | None
    exclude: tuple[str, ...]
    quantized_layers: Mapping[str, Any] = field(default_factory=dict)
    declared_in: tuple[str, ...] = ()
    # exclusion lists per file, to report disagreement between config.json and hf_quant_config.json
    exclude_by_file: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # AutoRound's own format: which blocks are quantized, per-layer overrides, the element type
    blocks: tuple[str, ...] = ()
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    data_type: str | None = None

    @property
    def is_modelopt(self) -> bool:
        """ModelOpt format (vLLM ``modelopt``/``modelopt_fp4``/``modelopt_mixed``)."""
        return self.method.lower().startswith("modelopt")

    @property
    def is_compressed_tensors(self) -> bool:
        """compressed-tensors format (llm-compressor)."""
        return self.method == "compressed-tensors"

    @property
    def is_auto_round(self) -> bool:
        """AutoRound's own ``auto-round`` format (vLLM: ``inc``)."""
        return self.method == "auto-round"

    @property
    def vllm_method(self) -> str:
        """The vLLM quantization method name this metadata selects."""
        if self.is_compressed_tensors:
            return "compressed-tensors"
        if self.is_auto_round:
            return "inc"  # vLLM's INCConfig.override_quantization_method takes over auto-round
        if self.is_modelopt:
            algo = self.algo.upper()
            if algo == "MIXED_PRECISION":
                return "modelopt_mixed"
            if "FP4" in algo:
                return "modelopt_fp4"
            return "modelopt"
        return self.method


def _modelopt_from_hfq(hfq: Mapping[str, Any]) -> dict[str, Any] | None:
    q = hfq.get("quantization")
    if not isinstance(q, Mapping):
        return None
    return {
        "algo": str(q.get("quant_algo") or ""),
        "group_size": q.get("group_size"),
        "kv": q.get("kv_cache_quant_algo"),
        "exclude": tuple(q.get("exclude_modules") or ()),
        "layers": q.get("quantized_layers") or {},
    }


def quantization_config_of(config: Mapping[str, Any]) -> tuple[str, Any]:
    """``config.json``'s quantization_config and where it is (``quantization_config`` at the top level, else
    ``text_config.quantization_config``, as vLLM reads a multimodal config); ``(where, None)`` when there is none."""
    qc = config.get("quantization_config")
    text = config.get("text_config")
    if qc is None and isinstance(text, Mapping) and text.get("quantization_config") is not None:
        return "text_config.quantization_config", text["quantization_config"]
    return "quantization_config", qc


def _patterns(where: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError(f"{where} must be a list of strings, got {str(value)[:60]!r}")
    return list(value)


def exclusion_lists(config: Mapping[str, Any], hfq: Mapping[str, Any] | None) -> list[tuple[str, bool, list[str]]]:
    """(file, is_compressed_tensors, patterns) for every exclusion list the two files declare; a list that is not a
    list of strings is a one-line ConfigError naming where it is."""
    out: list[tuple[str, bool, list[str]]] = []
    if hfq is not None and isinstance(hfq.get("quantization"), Mapping):
        q = hfq["quantization"]
        out.append(
            (
                HF_QUANT_CONFIG,
                False,
                _patterns(f"{HF_QUANT_CONFIG}: quantization.exclude_modules", q.get("exclude_modules")),
            )
        )
    key, qc = quantization_config_of(config)
    if isinstance(qc, Mapping):
        where = f"config.json: {key}"
        if qc.get("quant_method") == "compressed-tensors":
            out.append(("config.json", True, _patterns(f"{where}.ignore", qc.get("ignore"))))
        elif isinstance(qc.get("quantization"), Mapping):
            nested = qc["quantization"].get("exclude_modules")
            out.append(("config.json", False, _patterns(f"{where}.quantization.exclude_modules", nested)))
        else:
            name = "ignore" if qc.get("ignore") is not None else "exclude_modules"
            out.append(("config.json", False, _patterns(f"{where}.{name}", qc.get(name))))
    return out


def read_quant_metadata(config: Mapping[str, Any], hf_quant_config: Mapping[str, Any] | None) -> QuantMetadata | None:
    """The declared quantization, preferring ``config.json`` as vLLM does; None when unquantized."""
    _, qc = quantization_config_of(config)
    by_file: dict[str, tuple[str, ...]] = {}
    hfq = _modelopt_from_hfq(hf_quant_config) if hf_quant_config else None
    if hfq is not None:
        by_file[HF_QUANT_CONFIG] = hfq["exclude"]
    if isinstance(qc, Mapping):
        method = str(qc.get("quant_method") or "")
        ignore = tuple(qc.get("ignore") or qc.get("exclude_modules") or ())
        by_file["config.json"] = ignore
        if method == "compressed-tensors":
            fmt = str(qc.get("format") or "")
            kv = qc.get("kv_cache_scheme")
            return QuantMetadata(
                method,
                fmt,
                _ct_group_size(qc),
                "FP8" if kv else None,
                ignore,
                declared_in=("config.json",),
                exclude_by_file=by_file,
            )
        if "quantization" in qc and isinstance(qc["quantization"], Mapping):
            nested = _modelopt_from_hfq(qc) or {}
            by_file["config.json"] = nested.get("exclude", ())
            return QuantMetadata(
                method or "modelopt",
                nested.get("algo", ""),
                nested.get("group_size"),
                nested.get("kv"),
                nested.get("exclude", ()),
                nested.get("layers", {}),
                ("config.json",),
                by_file,
            )
        if method == "auto-round":
            return _auto_round(qc, by_file)
        layers = qc.get("quantized_layers") or (hfq or {}).get("layers") or {}
        declared = ("config.json", HF_QUANT_CONFIG) if hfq else ("config.json",)
        kv = qc.get("kv_cache_quant_algo") or (hfq or {}).get("kv")
        return QuantMetadata(
            method,
            str(qc.get("quant_algo") or (hfq or {}).get("algo") or ""),
            qc.get("group_size", (hfq or {}).get("group_size")),
            kv,
            ignore,
            layers,
            declared,
            by_file,
        )
    if hfq is not None:
        return QuantMetadata(
            "modelopt",
            hfq["algo"],
            hfq["group_size"],
            hfq["kv"],
            hfq["exclude"],
            hfq["layers"],
            (HF_QUANT_CONFIG,),
            by_file,
        )
    return None


def _auto_round(qc: Mapping[str, Any], by_file: dict[str, tuple[str, ...]]) -> QuantMetadata:
    """AutoRound's format: ``block_name_to_quantize`` (comma-separated or a list) and ``extra_config``."""
    blocks = qc.get("block_name_to_quantize") or qc.get("to_quant_block_names") or ()
    if isinstance(blocks, str):
        blocks = blocks.split(",")
    extra = qc.get("extra_config")
    data_type = qc.get("data_type")
    bits = qc.get("bits")
    group = qc.get("group_size")
    algo = f"{data_type or 'int'}{bits}" if bits is not None else str(data_type or "")
    return QuantMetadata(
        "auto-round",
        algo,
        group if isinstance(group, int) and not isinstance(group, bool) else None,
        None,
        (),
        declared_in=("config.json",),
        exclude_by_file=by_file,
        blocks=tuple(str(b) for b in blocks if isinstance(b, str)),
        extra_config=dict(extra) if isinstance(extra, Mapping) else {},
        data_type=str(data_type) if isinstance(data_type, str) else None,
    )


def _ct_group_size(qc: Mapping[str, Any]) -> int | None:
    groups = qc.get("config_groups")
    if isinstance(groups, Mapping):
        for g in groups.values():
            w = g.get("weights") if isinstance(g, Mapping) else None
            if isinstance(w, Mapping) and isinstance(w.get("group_size"), int):
                return int(w["group_size"])
    return None


def _merge(existing: Iterable[str], add: Iterable[str]) -> list[str]:
    out = list(existing)
    for p in add:
        if p not in out:
            out.append(p)
    return out


def _edit(
    config: Mapping[str, Any],
    hf_quant_config: Mapping[str, Any] | None,
    modelopt: Iterable[str],
    ct: Iterable[str],
    remove: bool,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    cfg = copy.deepcopy(dict(config))
    hfq = copy.deepcopy(dict(hf_quant_config)) if hf_quant_config is not None else None
    modelopt, ct = list(modelopt), list(ct)

    def apply(lst: Iterable[str], patterns: list[str]) -> list[str]:
        return [p for p in lst if p not in patterns] if remove else _merge(lst, patterns)

    if hfq is not None and isinstance(hfq.get("quantization"), dict):
        q = hfq["quantization"]
        q["exclude_modules"] = apply(q.get("exclude_modules") or [], modelopt)
    _, qc = quantization_config_of(cfg)  # the copy's own dict, wherever it is
    if isinstance(qc, dict):
        if qc.get("quant_method") == "compressed-tensors":
            qc["ignore"] = apply(qc.get("ignore") or [], ct)
        elif isinstance(qc.get("quantization"), dict):
            qc["quantization"]["exclude_modules"] = apply(qc["quantization"].get("exclude_modules") or [], modelopt)
        else:
            key = "ignore" if "ignore" in qc or "exclude_modules" not in qc else "exclude_modules"
            qc[key] = apply(qc.get(key) or [], modelopt)
    return cfg, hfq


def with_exclusions(
    config: Mapping[str, Any],
    hf_quant_config: Mapping[str, Any] | None,
    modelopt: Iterable[str],
    ct: Iterable[str],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Copies of both files with patterns appended (ModelOpt forms and compressed-tensors forms)."""
    return _edit(config, hf_quant_config, modelopt, ct, remove=False)


def without_exclusions(
    config: Mapping[str, Any],
    hf_quant_config: Mapping[str, Any] | None,
    modelopt: Iterable[str],
    ct: Iterable[str],
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Copies of both files with the given patterns removed from every exclusion list."""
    return _edit(config, hf_quant_config, modelopt, ct, remove=True)


def mixed_precision_config(
    hf_quant_config: Mapping[str, Any],
    main_modules: Iterable[str],
    main_algo: str,
    extra: Mapping[str, Any],
    is_mtp: Callable[[str], bool],
) -> dict[str, Any]:
    """``hf_quant_config.json`` rewritten as MIXED_PRECISION: per-module ``quantized_layers`` (the main model's modules
    in ``main_algo``, then ``extra``'s entries). A config that already is MIXED_PRECISION keeps its own entries less
    its MTP's (``is_mtp``: the family's MTP name test), which ``extra`` replaces."""
    hfq = copy.deepcopy(dict(hf_quant_config))
    q = hfq.setdefault("quantization", {})
    if str(q.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        layers = {k: v for k, v in (q.get("quantized_layers") or {}).items() if not is_mtp(k)}
    else:
        group = q.get("group_size", 16)
        layers = {m: {"quant_algo": main_algo, "group_size": group} for m in sorted(main_modules)}
    layers.update({k: dict(v) for k, v in extra.items()})
    q["quant_algo"] = "MIXED_PRECISION"
    q["quantized_layers"] = dict(sorted(layers.items()))
    q.pop("group_size", None)
    return hfq
