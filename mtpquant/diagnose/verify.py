"""graft's verification of the finished result, where it was built, before it is put in place."""

from __future__ import annotations

import logging
from pathlib import Path

from mtpquant.checkpoint.digest import checksum, checksum_file
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.report import inspect_checkpoint
from mtpquant.errors import OutputVerificationError
from mtpquant.surgery.metadata import plan_metadata
from mtpquant.surgery.write import Verified

__all__ = ["verify_result"]

log = logging.getLogger(__name__)


def verify_result(
    path: Path,
    expected: dict[str, tuple[int, ...]],
    src_hashes: dict[str, str] | None,
    mtp_layers: int,
    quant: Checkpoint,
) -> Verified:
    """Check the finished result where it was built; raise if it is not healthy. Returns the checks run.

    The inspect verdict must be clean, except for failures QUANT already had that graft does not
    touch (a main-model defect, say): those stay, and are reported as warnings.
    """

    def fail(reason: str) -> OutputVerificationError:
        return OutputVerificationError(f"the result failed verification and was not put in place: {reason}")

    # Every file graft wrote (new MTP shards, rewritten shards, index, JSON) is read and parsed again;
    # a hard link to a QUANT shard reuses the header parsed when QUANT was opened, but only when it is
    # that very file, unchanged since (device, inode, size, mtime). The index checks run in full.
    ckpt = Checkpoint.open(path, strict=True, reuse=quant)
    wrong_total = [p.message for p in ckpt.problems if p.code == "total_size"]
    if wrong_total:
        raise fail(wrong_total[0])
    checks = ["headers+index"]
    present = {e.name: e.shape for e in ckpt.mtp_tensors()}
    if set(present) != set(expected):
        missing = sorted(set(expected) - set(present))
        raise fail(f"MTP tensor set differs from what config.json implies (missing {missing[:1]})")
    bad = [n for n, s in expected.items() if present[n] != s]
    if bad:
        raise fail(f"{bad[0]} has shape {list(present[bad[0]])}, expected {list(expected[bad[0]])}")
    if src_hashes is not None:
        if set(src_hashes) != set(expected):
            raise fail("not every MTP tensor was read from SRC exactly once per byte range")
        for name in sorted(src_hashes):
            entry = ckpt.tensors[name]
            extent = ckpt.local_range(entry)  # the result is local: checksummed in the file, not copied out
            got = checksum_file(*extent) if extent is not None else checksum(ckpt.read_raw(entry))
            if got != src_hashes[name]:
                raise fail(f"{entry.name} in {entry.shard} is not byte-identical to SRC")
        checks.append("mtp-bytes")
    if ckpt.spec.mtp.layers != mtp_layers:
        raise fail(f"config.json declares {ckpt.spec.mtp.describe()}, the tensors hold {mtp_layers} MTP layers")
    leftover = plan_metadata(ckpt.spec, ckpt.hf_quant_config, ckpt.tensors, mtp_layers=mtp_layers)
    if leftover.changes:
        raise fail(f"metadata still incomplete ({leftover.changes[0]})")
    checks.append("exclusions")
    report = inspect_checkpoint(path, checkpoint=ckpt)
    warnings = []
    if not report.healthy:
        baseline = set(inspect_checkpoint(quant.source, checkpoint=quant).failure_messages)
        new = [m for m in report.failure_messages if m not in baseline]
        if new:
            raise fail(f"inspect: {new[0]}")
        for m in report.failure_messages:
            warning = f"QUANT's own problem, not graft's to fix, remains: {m}"
            log.warning("%s", warning)
            warnings.append(warning)
    checks.append("inspect")
    return Verified(tuple(checks), tuple(warnings))
