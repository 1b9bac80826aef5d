"""The compressed-tensors output format (``convert --format compressed-tensors``).

convert always exports through nvidia-modelopt; for this format the finished modelopt checkpoint in the
output's temporary directory is then converted by the compressed-tensors library's own converter
(``convert_checkpoint`` with ``ModelOptNvfp4Converter``): ``weight`` -> ``weight_packed``,
``weight_scale_2`` -> ``weight_global_scale`` (its reciprocal), ``input_scale`` -> ``input_global_scale``
(its reciprocal), format ``nvfp4-pack-quantized``, ``quantization_config.ignore`` for every Linear left
unquantized. modelopt's ``mtp*`` exclusion becomes ``re:^mtp\\..*`` (the form compressed-tensors honours);
other wildcard patterns become anchored ``re:`` patterns, exact names stay exact.

The converter rewrites every shard (it loads one shard at a time), so this format writes the output twice.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

from mtpquant.checkpoint.writer import OutputDir
from mtpquant.errors import RecipeError

__all__ = ["FORMATS", "check_ct_recipe", "ct_ignore", "ct_tensor_names", "to_compressed_tensors"]

log = logging.getLogger(__name__)

FORMATS = ("modelopt", "compressed-tensors")
_SCRATCH = ".compressed-tensors"
_RENAMED = {"weight_scale_2": "weight_global_scale", "input_scale": "input_global_scale"}


def check_ct_recipe(quant_algo: str, activations: bool, mtp_format: str, mode: str) -> None:
    """Refuse (at plan time) what compressed-tensors' ModelOpt-NVFP4 converter does not convert."""
    if quant_algo != "NVFP4" or not activations:
        raise RecipeError(
            f"--format compressed-tensors converts NVFP4 W4A4 (the recipe is {quant_algo}"
            f"{'' if activations else ', weights only'}); use --format modelopt for it"
        )
    if mode == "quantize" and mtp_format != "nvfp4":
        raise RecipeError("--format compressed-tensors with --mtp quantize needs --mtp-format nvfp4")


def ct_ignore(patterns: Iterable[str], mtp_patterns: tuple[Sequence[str], Sequence[str]]) -> list[str]:
    """modelopt exclusions as compressed-tensors ``ignore`` entries (in order, without duplicates); ``mtp_patterns``:
    the family's whole-MTP patterns in both forms (``ModelSpec.mtp_exclusion_patterns``).

    vLLM matches the ignore list of a module it builds packed (``in_proj_ba``, ``qkv_proj``, ...) shard by shard,
    so an excluded packed name also lists its shards' names.
    """
    from mtpquant.engine.loading import PACKED

    out: list[str] = []
    for p in patterns:
        if p in mtp_patterns[0]:
            out += mtp_patterns[1]
        elif p.startswith("re:") or not any(c in p for c in "*?["):
            out.append(p)
            base, _, last = p.rpartition(".")
            out += [f"{base}.{shard}" if base else shard for shard in PACKED.get(last, ())]
        else:
            out.append("re:^" + re.escape(p).replace(r"\*", ".*").replace(r"\?", ".") + "$")
    return list(dict.fromkeys(out))


def ct_tensor_names(names: Sequence[str]) -> list[str]:
    """The names modelopt-layout tensors get in the compressed-tensors layout (for the output's verification)."""
    quantized = {n.rsplit(".", 1)[0] for n in names if n.endswith(".weight_scale_2")}
    out = []
    for n in names:
        module, _, param = n.rpartition(".")
        if module in quantized and param == "weight":
            out.append(f"{module}.weight_packed")
        else:
            out.append(f"{module}.{_RENAMED.get(param, param)}" if module in quantized else n)
    return sorted(out)


def to_compressed_tensors(
    od: OutputDir, exclude: Sequence[str], device: str, mtp_patterns: tuple[Sequence[str], Sequence[str]]
) -> dict[str, Any]:
    """Convert the modelopt shards in ``od``'s temporary directory in place; returns the ``quantization_config``
    that replaces modelopt's in config.json (the caller writes it).

    ``od`` holds the finished modelopt shards, their index and config.json; ``exclude`` is modelopt's
    ``exclude_modules``; ``mtp_patterns`` the family's whole-MTP patterns (ModelOpt, compressed-tensors). The
    converter writes into a scratch directory inside ``od``; its shards replace the modelopt ones (renames) and the
    index is rebuilt from them.
    """
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from loguru import logger as ct_logger  # compressed-tensors logs through loguru: its notes stay out of ours

    scratch = od.path / _SCRATCH
    converter = ModelOptNvfp4Converter(ignore=ct_ignore(exclude, mtp_patterns), targets=["Linear"])
    log.info("converting to compressed-tensors (nvfp4-pack-quantized) with compressed-tensors' ModelOpt converter")
    ct_logger.disable("compressed_tensors")
    try:
        convert_checkpoint(od.path, scratch, converter, max_workers=1, device=device)
        converted = json.loads((scratch / "config.json").read_text(encoding="utf-8"))["quantization_config"]
        for shard in sorted(scratch.glob("*.safetensors")):
            od.adopt_file(shard, shard.name)
    finally:
        ct_logger.enable("compressed_tensors")
        shutil.rmtree(scratch, ignore_errors=True)
    od.write_index()
    return dict(converted)
