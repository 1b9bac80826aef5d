"""The healed MTP written back the way graft writes (``graft.write``): only the MTP bytes, everything else linked.

QUANT's ``mtp.*`` tensors are replaced by the healed ones under the same names, dtypes and shapes, in new
``mtp-*`` shards (a shard that mixed the MTP with other tensors is rewritten without it, its other tensors copied
byte for byte); the index points at the new shards; config.json and hf_quant_config.json are not touched; the
provenance gains a ``heal`` step. Before anything is put in place the result is verified where it was built:
graft's checks (headers, index, the MTP tensor set and shapes, every written MTP byte against the healed tensors,
the metadata), plus every MTP dtype as QUANT's, every other tensor QUANT's own bytes, and the same inspect verdicts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.digest import checksum
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.verify import verify_result
from mtpquant.errors import OutputVerificationError
from mtpquant.heal.plan import HealPlan
from mtpquant.heal.precision import export_mtp
from mtpquant.public import public_args, public_ref
from mtpquant.records.provenance import PROVENANCE_FILE, HealRecord, Step, source_provenance
from mtpquant.surgery.plan import Plan, plan_index_fix, plan_shards, weight_map_of
from mtpquant.surgery.shards import write_planned_mtp
from mtpquant.surgery.write import NewMtp, Target, WriteLog, build

__all__ = ["heal_step", "record_step", "write_healed"]

log = logging.getLogger(__name__)


def heal_step(plan: HealPlan, src: Checkpoint, record: HealRecord | None) -> Step:
    """The provenance step of this heal (local directories by their base name: the file goes public with OUT)."""
    ref = src.source.ref()
    return Step("heal", public_args(plan.options.command, ref), source=public_ref(ref), heal=record)


def _verify(quant: Checkpoint, hashes: dict[str, str], layers: int, warnings: list[str]) -> Any:
    from mtpquant.diagnose.report import inspect_checkpoint

    expected = {e.name: e.shape for e in quant.mtp_tensors()}
    dtypes = {e.name: e.dtype for e in quant.mtp_tensors()}
    baseline = inspect_checkpoint(quant.source, checkpoint=quant)

    def verify(path: Path) -> list[str]:
        def fail(reason: str) -> OutputVerificationError:
            return OutputVerificationError(f"the healed result failed verification and was not put in place: {reason}")

        checks = verify_result(path, expected, hashes, layers, quant, warnings)
        out = Checkpoint.open(path, strict=True, reuse=quant)
        odd = sorted(n for n, d in dtypes.items() if out.tensors[n].dtype != d)
        if odd:
            raise fail(f"{odd[0]} is {out.tensors[odd[0]].dtype}, QUANT has {dtypes[odd[0]]}")
        others = sorted(n for n in quant.tensors if n not in expected)
        if sorted(n for n in out.tensors if n not in expected) != others:
            raise fail("the tensors outside the MTP are not QUANT's")
        for name in others:
            a, b = out.tensors[name], quant.tensors[name]
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise fail(f"{name} is not QUANT's")
            if not _same_file(path / a.shard, quant, b.shard) and out.read_raw(a) != quant.read_raw(b):
                raise fail(f"{name} is not byte-identical to QUANT's")
        checks.append("rest-bytes")
        report = inspect_checkpoint(path, checkpoint=out)
        if report.verdicts != baseline.verdicts or report.mtp_precision != baseline.mtp_precision:
            raise fail(f"inspect verdicts changed: {report.verdicts} (QUANT: {baseline.verdicts})")
        checks.append("same-verdicts")
        return checks

    return verify


def _same_file(path: Path, quant: Checkpoint, shard: str) -> bool:
    """Whether ``path`` is QUANT's shard itself (a hard link to it: same device and inode)."""
    root = quant.source.local_root
    if root is None:
        return False
    try:
        a, b = path.stat(), (root / shard).stat()
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def write_healed(
    plan: HealPlan, quant: Checkpoint, src: Checkpoint, healed: dict[str, Any], target: Target, result: WriteLog
) -> list[str]:
    """Build the healed quant in ``target``'s temporary directory and verify it; returns the JSON files to commit.
    The provenance step carries no record yet (``record_step`` adds it once the check has run)."""
    tensors = export_mtp(quant, src, plan.storage, healed)
    hashes = {t.name: checksum(t.produce()) for t in tensors}
    names = sorted(t.name for t in tensors)
    gplan = Plan(quant, quant.hf_quant_config, weight_map_of(quant))
    gplan.removed = list(names)
    gplan.add = list(names)
    gplan.mtp_layers = quant.spec.mtp_depth(names) or quant.spec.mtp.layers
    plan_shards(gplan, set(names))
    plan_index_fix(gplan)
    max_bytes = plan.options.max_shard_bytes
    new_mtp = NewMtp(tuple(names), lambda od: write_planned_mtp(od, tensors, max_bytes))
    verify = _verify(quant, hashes, gplan.mtp_layers, result.warnings)
    return build(target, gplan, new_mtp, heal_step(plan, src, None), result, verify, link=plan.options.link)


def record_step(plan: HealPlan, quant: Checkpoint, src: Checkpoint, record: HealRecord, target: Target) -> None:
    """Rewrite the built result's provenance with the heal's record (before the commit)."""
    provenance = source_provenance(quant.source).then(heal_step(plan, src, record))
    target.od.write_text(PROVENANCE_FILE, provenance.to_bytes().decode("utf-8"))
