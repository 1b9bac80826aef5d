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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.digest import checksum
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.diagnose.verify import verify_result
from mtpquant.errors import OutputVerificationError
from mtpquant.heal.check import AlChange, CheckResult
from mtpquant.heal.data import HealData
from mtpquant.heal.plan import Schedule
from mtpquant.heal.precision import MtpStorage, export_mtp
from mtpquant.public import public_args, public_ref, public_text
from mtpquant.records.provenance import PROVENANCE_FILE, HealAl, HealCheck, HealRecord, Step, source_provenance
from mtpquant.surgery.metadata import MetadataPlan
from mtpquant.surgery.plan import plan_change
from mtpquant.surgery.shards import write_planned_mtp
from mtpquant.surgery.write import Built, Destination, NewMtp, Verified, build

__all__ = ["heal_step", "record_step", "write_healed"]

log = logging.getLogger(__name__)


def heal_step(command: tuple[str, ...], src: Checkpoint, record: HealRecord | None) -> Step:
    """The provenance step of this heal (local directories by their base name: the file goes public with OUT)."""
    ref = src.source.ref()
    return Step("heal", public_args(command, ref), source=public_ref(ref), heal=record)


def _verify(quant: Checkpoint, hashes: dict[str, str], layers: int) -> Callable[[Path], Verified]:
    from mtpquant.diagnose.report import inspect_checkpoint

    expected = {e.name: e.shape for e in quant.mtp_tensors()}
    dtypes = {e.name: e.dtype for e in quant.mtp_tensors()}
    baseline = inspect_checkpoint(quant.source, checkpoint=quant)

    def verify(path: Path) -> Verified:
        def fail(reason: str) -> OutputVerificationError:
            return OutputVerificationError(f"the healed result failed verification and was not put in place: {reason}")

        verified = verify_result(path, expected, hashes, layers, quant)
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
        report = inspect_checkpoint(path, checkpoint=out)
        if report.verdicts != baseline.verdicts or report.mtp_precision != baseline.mtp_precision:
            raise fail(f"inspect verdicts changed: {report.verdicts} (QUANT: {baseline.verdicts})")
        return Verified((*verified.checks, "rest-bytes", "same-verdicts"), verified.warnings)

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
    quant: Checkpoint,
    src: Checkpoint,
    storage: MtpStorage,
    healed: dict[str, Any],
    dest: Destination,
    *,
    command: tuple[str, ...],
    max_shard_bytes: int,
    link: bool,
) -> Built:
    """Build the healed quant (``healed``: the trained weights, written in QUANT's ``storage``) in ``dest``'s
    temporary directory and verify it (``src``: the checkpoint QUANT was made from, whose dtypes a quantized MTP is
    quantized from). The provenance gains the heal step of ``command``, without its record yet (``record_step`` adds
    it once the check has run)."""
    step = heal_step(command, src, None)
    tensors = export_mtp(quant, src, storage, healed)
    hashes = {t.name: checksum(t.produce()) for t in tensors}
    names = sorted(t.name for t in tensors)
    layers = quant.spec.mtp_depth(names) or quant.spec.mtp.layers
    plan = plan_change(quant, MetadataPlan(), add=names, removed=names, mtp_layers=layers)
    new_mtp = NewMtp(tuple(names), lambda od: write_planned_mtp(od, tensors, max_shard_bytes))
    return build(dest, plan, new_mtp, step, _verify(quant, hashes, layers), link=link)


def _al(changes: tuple[AlChange, ...]) -> tuple[HealAl, ...]:
    return tuple(HealAl(c.k, c.before, c.after, c.low, c.high) for c in changes)


def record_step(
    quant: Checkpoint,
    src: Checkpoint,
    dest: Destination,
    command: tuple[str, ...],
    precision: str,
    schedule: Schedule,
    data: HealData,
    check: CheckResult,
) -> HealRecord:
    """Rewrite the built result's provenance with the heal's step, its record included (before the commit): the
    MTP's ``precision``, the training ``schedule`` on ``data``, the held-out ``check``. Returns the record."""
    record = HealRecord(
        precision=precision,
        data=public_text(data.source),  # the record goes public with OUT: local paths by base name
        sequences=data.sequences,
        tokens=data.tokens,
        sampled=data.sampled,
        temperature=data.temperature,
        steps=schedule.steps,
        lr=schedule.lr,
        batch_size=schedule.batch_size,
        chain=schedule.chain,
        seed=schedule.seed,
        check_sequences=check.sequences,
        by_k=_al(check.by_k),
        better=check.better,
        forced=not check.better,
        served_k=check.decision.served(check.by_k),
        strict=check.decision.strict,
        checks=() if check.greedy_only else tuple(
            HealCheck(s.sampling, check.rule, _al(s.by_k), s.better, s.worse) for s in check.settings
        ),
    )
    step = heal_step(command, src, record)
    provenance = source_provenance(quant.source).then(step)
    dest.od.write_text(PROVENANCE_FILE, provenance.to_bytes().decode("utf-8"))
    return record
