"""Convert, the MTP: one code path per mode (keep, quantize, extract, drop).

Each path writes its MTP tensors (if any) and returns an ``MtpOutcome`` saying how the main
output's metadata must change: how many MTP layers ``config.json`` declares, which exclusions both
quantization files list, and (FP8 MTP beside an NVFP4 model) the per-module quantized layers.

- keep: every ``mtp.*`` tensor byte for byte into ``mtp-*`` shards (``write_mtp_shards``, the layout
  graft reproduces); exclusions ``mtp*`` (and ``re:^mtp\\..*`` for compressed-tensors metadata).
- quantize: the MTP Linears to NVFP4 / FP8 from ``mtpquant.mtp.quantize`` with input scales from the
  calibration pass; ``mtp.fc``, router, ``shared_expert_gate`` excluded by exact name; norms and
  those Linears copied byte for byte.
- extract: nothing MTP in the main output, the declaration removed; the MTP goes to its own
  directory (its own OutputDir): the same shards, an index, the source config, a README.
- drop: nothing MTP, the declaration removed, a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
from mtpquant.formats.quant_config import MTP_CT_PATTERNS, MTP_MODELOPT_PATTERNS
from mtpquant.surgery.shards import mtp_planned_tensors, write_mtp_shards, write_planned_mtp

__all__ = [
    "MtpOutcome",
    "drop_mtp",
    "extract_mtp",
    "keep_mtp",
    "load_mtp_layer",
    "quantize_mtp_into",
]

log = logging.getLogger(__name__)


@dataclass
class MtpOutcome:
    """What one MTP mode wrote and how the main output's metadata must change."""

    mode: str
    declared_layers: int  # MTP layers config.json declares (0: remove the declaration)
    shards: list[str] = field(default_factory=list)  # mtp-* shards written into OUT
    names: list[str] = field(default_factory=list)  # mtp.* tensor names written into OUT
    tensors: int = 0
    bytes: int = 0
    exclude_modelopt: list[str] = field(default_factory=list)
    exclude_ct: list[str] = field(default_factory=list)
    quantized_layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # for MIXED_PRECISION
    quantized_modules: list[str] = field(default_factory=list)
    mtp_out_tensors: int = 0
    notes: list[str] = field(default_factory=list)


def _declared(ckpt: Checkpoint) -> int:
    return max(1, ckpt.spec.mtp.layers)


def keep_mtp(od: OutputDir, ckpt: Checkpoint, max_bytes: int) -> MtpOutcome:
    """Copy every ``mtp.*`` tensor unchanged into its own shards; exclude ``mtp*``."""
    entries = ckpt.mtp_tensors()
    shards = write_mtp_shards(od, ckpt, [e.name for e in entries], max_bytes)
    return MtpOutcome(
        "keep",
        _declared(ckpt),
        shards=shards,
        names=sorted(e.name for e in entries),
        tensors=len(entries),
        bytes=sum(e.nbytes for e in entries),
        exclude_modelopt=list(MTP_MODELOPT_PATTERNS),
        exclude_ct=list(MTP_CT_PATTERNS),
    )


def load_mtp_layer(ckpt: Checkpoint, device: Any = None) -> Any:
    """The reference MtpLayer with the source's ``mtp.*`` weights (for calibration)."""
    from mtpquant.mtp.module import MtpConfig, MtpLayer

    cfg = MtpConfig.from_text_config(ckpt.config)
    tensors = {e.name: ckpt.read_tensor(e.name) for e in ckpt.mtp_tensors()}
    return MtpLayer.from_state_dict(cfg, tensors, device=device)


def quantize_mtp_into(
    od: OutputDir,
    ckpt: Checkpoint,
    layer: Any,
    input_amax: Mapping[str, Any],
    fmt: str,
    activations: bool,
    max_bytes: int,
    main_algo: str,
) -> MtpOutcome:
    """Quantize the MTP Linears (modelopt math) and write them, the rest byte for byte."""
    from mtpquant.convert.assemble import planned_tensor
    from mtpquant.mtp.quantize import quantize_mtp

    weights = {"mtp." + n: p.detach().cpu() for n, p in layer.named_parameters()}
    result = quantize_mtp(weights, input_amax, fmt, activations=activations)
    planned: list[PlannedTensor] = [planned_tensor(n, t) for n, t in result.tensors.items()]
    kept = [n for n in result.kept_tensors if n in ckpt.tensors]
    planned += mtp_planned_tensors(ckpt, kept)
    shards = write_planned_mtp(od, planned, max_bytes)
    outcome = MtpOutcome(
        "quantize",
        _declared(ckpt),
        shards=shards,
        names=sorted(t.name for t in planned),
        tensors=len(planned),
        bytes=sum(t.nbytes for t in planned),
        exclude_modelopt=list(result.excluded_modules),
        quantized_modules=list(result.quantized_modules),
    )
    layer_algo = "FP8" if fmt == "fp8" else main_algo
    if layer_algo != main_algo:
        outcome.quantized_layers = {m: {"quant_algo": layer_algo} for m in result.quantized_modules}
    outcome.notes.append(
        f"MTP quantized to {fmt.upper()} ({len(result.quantized_modules)} Linears); SGLang serves only a BF16 MTP "
        "and will not use it, vLLM will"
    )
    return outcome


def extract_mtp(mtp_od: OutputDir, ckpt: Checkpoint, max_bytes: int, out_name: str) -> MtpOutcome:
    """Write the MTP to its own directory (shards, index, source config, README); none in OUT."""
    entries = ckpt.mtp_tensors()
    write_mtp_shards(mtp_od, ckpt, [e.name for e in entries], max_bytes)
    mtp_od.write_index()
    mtp_od.write_json("config.json", ckpt.config)
    mtp_od.write_text("README.md", _extract_readme(ckpt, len(entries), out_name, mtp_od.final.name))
    outcome = MtpOutcome("extract", 0, mtp_out_tensors=len(entries), bytes=sum(e.nbytes for e in entries))
    outcome.notes.append(
        f"MTP ({len(entries)} tensors) extracted to {mtp_od.final}; the main output declares no MTP "
        f"(put it back with `mtpquant graft`)"
    )
    return outcome


def drop_mtp(ckpt: Checkpoint) -> MtpOutcome:
    """No MTP in the output, declaration removed; warn when one existed."""
    outcome = MtpOutcome("drop", 0)
    if ckpt.mtp_tensors():
        msg = "--mtp drop: the MTP layer is not in the output; speculative decoding with MTP is gone"
        log.warning(msg)
        outcome.notes.append(msg)
    return outcome


def _extract_readme(ckpt: Checkpoint, count: int, out_name: str, mtp_name: str) -> str:
    decl = ckpt.spec.mtp.describe()
    return f"""# MTP layer extracted by mtpquant

This directory holds the Multi-Token-Prediction (MTP) layer of `{ckpt.label}`
({ckpt.spec.family.display}): {count} `mtp.*` tensors under their original names, exactly the
bytes of the source checkpoint, in `mtp-*.safetensors` shards with an index. `config.json` is the
source's config (it declares the MTP: {decl}).

The quantized model `{out_name}` was written without the MTP, and its config declares none, so
engines do not expect one. To put it back (MTP in BF16, excluded from quantization):

```
mtpquant graft {out_name} --from {mtp_name} --out {out_name}-with-mtp
```

(or `--in-place` instead of `--out`). `convert --mtp extract` followed by `graft` gives the same
tensor files, byte for byte, as `convert --mtp keep`. Check the result with
`mtpquant inspect {out_name}-with-mtp`.
"""
