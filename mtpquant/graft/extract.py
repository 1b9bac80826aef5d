"""extract: a checkpoint's MTP into a sidecar directory of its own, the inverse of graft (``graft QUANT --from SIDE``
puts it back), for every family the registry repairs.

Two forms:

- mtpquant's (the default): every MTP tensor under its own name, byte for byte, in ``mtp-*.safetensors`` shards (the
  layout ``convert --mtp extract`` and graft write), an index, the source's config.json and a README;
- SGLang's standalone NextN export (``nextn``; the community's extracted form of a DeepSeek MTP, e.g.
  lmsys/DeepSeek-V3-0324-NextN, made by sgl-project/sglang scripts/export_deepseek_nextn.py): the MTP layer renamed
  to ``model.layers.0``, the head and embedding copies left out (SGLang's NextN loader takes the target's), one file
  ``nextn_layer_parameters.safetensors``, config.json with ``num_hidden_layers: 1`` and the NextN architecture.
  SGLang loads it as a draft model; graft reads it back (its layer 0 under QUANT's MTP layer, the copies from
  QUANT's own head and embedding).

Only the MTP bytes are read (ranged reads from a Hub repo); the sidecar is built beside OUT, verified byte for byte
against the source, and renamed into place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge

from mtpquant.checkpoint.dtypes import planned_copy
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, OutputDir
from mtpquant.errors import MtpModeError, OutputExistsError, OutputVerificationError, UsageError
from mtpquant.families import surgery_refusal
from mtpquant.public import public_name
from mtpquant.records.record import FLAG, Options
from mtpquant.surgery.shards import write_planned_mtp
from mtpquant.units import format_bytes

__all__ = ["NEXTN_FILE", "ExtractOptions", "ExtractResult", "extract_mtp"]

log = logging.getLogger(__name__)

NEXTN_FILE = "nextn_layer_parameters.safetensors"  # the one file SGLang's export writes


@dataclass(frozen=True)
class ExtractOptions(Options):
    """Everything ``mtpquant extract`` takes."""

    source: str | os.PathLike[str]
    out: str | os.PathLike[str]
    nextn: bool = False  # SGLang's standalone NextN form instead of mtpquant's
    revision: str | None = None
    token: str | None = field(default=None, repr=False, metadata={FLAG: None})
    max_shard_bytes: Annotated[int, Ge(1)] = field(default=DEFAULT_MAX_SHARD_BYTES, metadata={FLAG: "--max-shard-size"})
    dry_run: bool = False


@dataclass
class ExtractResult:
    """What extract wrote (or, with ``dry_run``, would write)."""

    source: str
    destination: str | None
    form: str  # "mtpquant" | "nextn"
    mtp_tensors: int
    mtp_bytes: int
    shards: list[str]
    message: str
    bytes_fetched: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


def _plan(src: Checkpoint, nextn: bool) -> dict[str, str]:
    """The sidecar's name of every MTP tensor it takes (source name -> sidecar name), refusing one line."""
    spec, label = src.spec, src.label
    refusal = surgery_refusal(spec.family, label, "extract")
    if refusal is not None:
        raise refusal
    present = [e.name for e in src.mtp_tensors()]
    if not present:
        raise MtpModeError(f"{label}: has no MTP tensors ({spec.mtp.describe()}), so there is nothing to extract")
    missing = sorted(set(spec.expected_mtp_shapes(present)) - set(present))
    if missing:
        raise MtpModeError(
            f"{label}: MTP incomplete, {len(missing)} tensors missing (first: {missing[0]}); extract takes a whole MTP"
        )
    if not nextn:
        return {n: n for n in present}
    if spec.family.nextn_architecture is None or spec.nextn_standalone:
        what = "exists for DeepSeek-V3 / V3.2, not " + spec.family.display
        if spec.nextn_standalone:
            what = "is already one"
        raise UsageError(f"{label}: --nextn: SGLang's standalone NextN form {what}")
    if spec.mtp.layers != 1:
        raise UsageError(f"{label}: --nextn takes one MTP layer (SGLang's export asserts it), this one declares "
                         f"{spec.mtp.layers}")
    names = spec.mtp_names
    copies = tuple("." + c for c in spec.family.mtp.copies)
    out = {}
    for n in present:
        prefix = names.layer_prefix(n)
        if prefix is None or n.endswith(copies):  # the export skips embed_tokens and shared_head.head
            continue
        out[n] = f"{names.roots[0]}0.{n[len(prefix) :]}"
    return out


def _nextn_config(src: Checkpoint) -> dict[str, Any]:
    config = dict(src.config)
    config.update({"num_hidden_layers": 1, "architectures": [str(src.spec.family.nextn_architecture)]})
    return dict(sorted(config.items()))  # the export writes its keys sorted


def _readme(src: Checkpoint, count: int, nextn: bool, name: str) -> str:
    from mtpquant.card_marker import seal, unsealed_marker

    source = public_name(src.label, src.source.ref())
    if nextn:
        form = (
            f"SGLang's standalone NextN form: the MTP layer as `model.layers.0.*` in `{NEXTN_FILE}` ({count} tensors, "
            "without the head and embedding copies), `config.json` with `num_hidden_layers: 1` and the "
            f"`{src.spec.family.nextn_architecture}` architecture. SGLang loads it as a draft model "
            f"(`--speculative-draft-model-path {name}`)"
        )
    else:
        form = (
            f"{count} MTP tensors under their original names, exactly the bytes of the source, in `mtp-*.safetensors` "
            "shards with an index; `config.json` is the source's"
        )
    return seal(f"""{unsealed_marker()}

# MTP layer extracted by mtpquant

The Multi-Token-Prediction (MTP) layer of `{source}` ({src.spec.family.display}): {form}.

To put it into a quant of the same model that lost it (the MTP's bytes only, its exclusions and declaration
repaired):

```
mtpquant graft QUANT --from {name} --out QUANT-mtp
```
""")


def _verify(path: Path, src: Checkpoint, names: dict[str, str]) -> None:
    out = Checkpoint.open(path, strict=True)
    if set(out.tensors) != set(names.values()):
        diff = sorted(set(out.tensors) ^ set(names.values()))
        raise OutputVerificationError(f"{path}: the sidecar's tensor set differs from the plan ({diff[0]})")
    for source_name, name in sorted(names.items()):
        a, b = out.tensors[name], src.tensors[source_name]
        if (a.dtype, a.shape) != (b.dtype, b.shape) or out.read_raw(a) != src.read_raw(b):
            raise OutputVerificationError(f"{path}: {name} differs from {source_name} in the source")
    if not out.mtp_only:
        raise OutputVerificationError(f"{path}: the sidecar holds tensors its config does not make MTP ones")


def extract_mtp(options: ExtractOptions) -> ExtractResult:
    """Write the MTP of ``options.source`` into a sidecar at ``options.out`` (see the module docstring)."""
    t0 = time.perf_counter()
    options.check_fields(UsageError)
    out = Path(options.out).absolute()
    if os.path.lexists(out):
        raise OutputExistsError(f"{out}: output already exists; extract never overwrites (choose a new --out)")
    src = Checkpoint.open(options.source, revision=options.revision, token=options.token, name_errors=True)
    names = _plan(src, options.nextn)
    form = "nextn" if options.nextn else "mtpquant"
    size = sum(src.tensors[n].nbytes for n in names)
    result = ExtractResult(src.label, None, form, len(names), size, [], "")
    if options.dry_run:
        result.message = f"would extract {len(names)} MTP tensors ({format_bytes(size)}) of {src.label} to {out}"
    else:
        src.prefetch(names)  # a remote source reads adjacent tensors in one request
        planned = [dataclasses.replace(planned_copy(src, src.tensors[n]), name=new) for n, new in names.items()]
        with OutputDir(out) as od:
            if options.nextn:
                od.write_shard(NEXTN_FILE, sorted(planned, key=lambda t: t.name), {"format": "pt"})
                result.shards = [NEXTN_FILE]
                config = _nextn_config(src)
            else:
                result.shards = write_planned_mtp(od, planned, options.max_shard_bytes)
                config = dict(src.config)
            od.write_index()
            od.write_json("config.json", config)
            od.write_text("README.md", _readme(src, len(names), options.nextn, out.name))
            result.destination = str(od.finalize(lambda path: _verify(path, src, names)))
        result.message = (
            f"extracted {len(names)} MTP tensors ({format_bytes(size)}) of {src.label} to {result.destination}"
            + (" (SGLang's standalone NextN form)" if options.nextn else "")
        )
    result.bytes_fetched = src.source.bytes_read
    result.seconds = round(time.perf_counter() - t0, 3)
    log.info("%s", result.message)
    return result
