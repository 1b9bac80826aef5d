"""What heal can heal, decided before anything loads (torch-free): the family, the layouts it writes an MTP back in,
the data, the compute dtype, the memory the quantized target and the training take, and where an in-place heal can
swap.

heal's plan refuses with these; ``convert --heal`` asks them of the output it is about to write (``check_convert``,
from its own plan), so a conversion is never run for a heal that would then be refused.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from mtpquant.errors import GraftError, HealRefusedError, MemoryPlanError
from mtpquant.families import Family
from mtpquant.formats.kinds import OUTPUT_FORMATS
from mtpquant.heal.options import HealOptions
from mtpquant.measure.memory import plan_target_memory, target_blocks
from mtpquant.runtime.machine import DTYPE_BYTES, compute_dtype, resolve_device

if TYPE_CHECKING:
    from mtpquant.checkpoint.table import Checkpoint

__all__ = [
    "DTYPE_BYTES",
    "WRITES_BACK",
    "check_convert",
    "check_family",
    "mtp_input_streams",
    "plan_target_memory",
    "target_blocks",
    "training_bytes",
]

WRITES_BACK = "heal writes back BF16, ModelOpt NVFP4 and ModelOpt FP8 per tensor"  # the kinds with heal_writes
_RUNTIME_BYTES = 1_000_000_000  # torch + transformers + modelopt imported and running (as convert's plan)


def check_family(family: Family, label: str, then: str = "the quant is left as it is") -> None:
    """Refuse a family whose MTP heal does not train (``Family.mtp_heal``: heal trains a family's reference forward
    through its ``step``, ``mtp.step.MtpForward``); ``then``: what the user is told happens instead."""
    if not family.mtp_heal:
        raise HealRefusedError(f"{label}: heal does not train the {family.display} MTP yet; {then}")


def mtp_input_streams(quant: Checkpoint) -> int:
    """How many hidden-size streams the MTP's own hidden input has where it is not the LM head's (Qwen4-Exp: the
    multi-stream state, ``MtpLayout.hidden_source``, ``hc_count`` streams), stored beside it; 0 otherwise."""
    if quant.spec.family.mtp.hidden_source is None:
        return 0
    return quant.spec.dim("hc_count")


def training_bytes(quant: Checkpoint, rows: int, head_bytes: int, tied: bool, streams: int) -> int:
    """The training phase's peak: MTP weights, gradients and AdamW state in float32 (16 bytes a parameter), the
    embedding and head (``head_bytes`` each), a batch of ``rows`` hidden states, the layer's activations (~24 per row
    and hidden unit of every stream; ``streams``: ``mtp_input_streams``), one chunk of logits."""
    params = 0
    for e in quant.mtp_tensors():
        n = 1
        for d in e.shape:
            n *= d
        params += n * (2 if e.dtype == "U8" else 1)
    spec = quant.spec
    H, V = spec.hidden_size, spec.dim("vocab_size")
    return (
        _RUNTIME_BYTES
        + 16 * params
        + head_bytes * (1 if tied else 2)
        + rows * H * 4 * 24 * max(1, streams)
        + 4 * 256 * V * 4
    )


def _exchange_possible_beside(out: Path) -> bool:
    """Whether the filesystem OUT is written on can exchange two directories (an in-place heal swaps OUT so); probed
    in a temporary directory beside OUT (or its nearest existing ancestor), removed at once."""
    from mtpquant.surgery.inplace import exchange_supported

    parent = out.absolute().parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    with contextlib.ExitStack() as stack:
        try:
            scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix=".mtpquant-probe-", dir=parent))
        except OSError:
            return True  # not writable: convert refuses OUT itself, in its own words
        return exchange_supported(Path(scratch))


def check_convert(
    options: HealOptions, src: Checkpoint, mode: str, output_format: str, out: Path, *, probe: bool = True
) -> None:
    """``convert --heal``: refuse now, before the conversion, what heal would refuse once OUT exists (``src``: the
    checkpoint being converted; ``mode``: the MTP mode; ``probe``: test OUT's filesystem, which writes and removes a
    directory beside OUT), with the exit code heal would give."""
    from mtpquant.text.calibration import check_calibration_source

    options.check()
    check_calibration_source(options.data)
    check_family(src.spec.family, src.label, "nothing was converted: convert it without --heal")
    if not src.mtp_tensors():
        raise HealRefusedError(f"{src.label}: has no MTP (no mtp.* tensors), so --heal would have nothing to heal")
    if mode in ("drop", "extract"):
        raise HealRefusedError(
            f"--mtp {mode} leaves OUT without its MTP, so --heal would have nothing to heal (use --mtp keep or "
            "--mtp quantize)"
        )
    if mode == "quantize" and not OUTPUT_FORMATS[output_format].heal_writes:
        raise HealRefusedError(
            f"--format compressed-tensors --mtp quantize stores OUT's MTP as compressed-tensors NVFP4; {WRITES_BACK} "
            "(use --format modelopt, or --mtp keep)"
        )
    device = resolve_device(options.device, probe=False)
    dtype = compute_dtype(device, options.dtype)
    shapes = ((e.name, e.shape) for e in src.tensors.values())
    try:
        plan_target_memory(shapes, src.classify, DTYPE_BYTES[dtype], device, max_memory=options.max_memory,
                           shard_bytes=options.max_shard_bytes)
    except MemoryPlanError as exc:  # said of heal's target (float32 on CPU), not of the conversion
        raise MemoryPlanError(f"--heal: {exc}; nothing was converted") from None
    if options.in_place and probe and not _exchange_possible_beside(out):
        raise GraftError(
            f"{out}: --heal heals OUT in place, which needs a filesystem with atomic directory exchange (Linux "
            "renameat2); convert, then heal OUT with --out"
        )
