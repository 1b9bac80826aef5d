"""The repair commands inspect prints (its ``fix`` lines), each one only where it works on this checkpoint.

A command is offered when mtpquant's own plan for it, applied to this checkpoint's headers in memory, leaves a
checkpoint inspect finds clean (``--strict``): ``graft --fix-metadata`` gets the metadata graft would write
(``surgery.metadata.plan_metadata``, day-0 labels and ``quantized_layers`` included); ``graft --from SRC`` gets
SRC's MTP as the BF16 checkpoint this model was made from holds it (the names and shapes config.json implies,
which graft's lineage check demands of SRC) with that metadata, and an index without the entries of MTP shards
that do not exist. Where the MTP is declared and there is none at all, ``graft --fix-metadata`` (the declaration set
to 0: serve without MTP) is offered after it. Nothing is offered where neither works: a defect of the main model, a
format no engine loads, a shard of the main model missing, a family mtpquant does not repair.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

from mtpquant.checkpoint.header import TensorEntry, tensor_nbytes
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.families import SUPPORTED, ModelSpec
from mtpquant.surgery.metadata import plan_metadata

__all__ = ["fix_commands"]

_SRC_NOTE = "   (SRC: the BF16 checkpoint it was made from)"
_UNDECLARE_NOTE = "   (or serve it without MTP: un-declares the MTP it does not have)"


def _after(
    ckpt: Checkpoint,
    mtp: dict[str, TensorEntry] | None,
    layers: int,
    *,
    lost_dropped: bool,
    adopted: bool = False,
) -> Checkpoint:
    """``ckpt`` as graft leaves it with these MTP entries in place of its own (None: its own table): the metadata
    planned for it, (``lost_dropped``) the index rewritten without the entries of shards that do not exist,
    (``adopted``) with the MTP shards it forgot. The main model's entries are ``ckpt``'s, so are their classes and
    precisions (``Checkpoint.amended``): only the MTP's are worked out again."""
    problems = [p for p in ckpt.problems if not p.fatal] if lost_dropped else None
    table = ckpt.amended(ckpt.config, ckpt.hf_quant_config, mtp, problems, indexed_forgotten=adopted)
    plan = plan_metadata(
        ckpt.spec, ckpt.hf_quant_config, table.tensors, mtp_layers=layers, precision=table.linear_precisions()
    )
    config = plan.config if plan.config is not None else ckpt.config
    hfq = plan.hf_quant_config if plan.hf_quant_config is not None else ckpt.hf_quant_config
    return table.amended(config, hfq)


def _src_mtp(spec: ModelSpec) -> dict[str, TensorEntry]:
    """The MTP a BF16 SRC of this model holds (graft's lineage check refuses any other), as header entries."""
    out = {}
    for name, shape in spec.expected_mtp_shapes().items():
        out[name] = TensorEntry(name, "BF16", shape, "SRC", 0, tensor_nbytes("BF16", shape))
    return out


def fix_commands(ckpt: Checkpoint, clean: Callable[[Checkpoint], bool]) -> list[str]:
    """The ``mtpquant`` command that repairs ``ckpt`` (``clean``: whether inspect finds a checkpoint clean), or
    none where no command does."""
    if ckpt.mtp_only or ckpt.spec.family.status != SUPPORTED:
        return []
    # QUANT as graft takes it: the path, or the repo id and the revision asked for (the label says repo@revision)
    where, _, revision = ckpt.label.partition("@") if ckpt.source.local_root is None else (ckpt.label, "", "")
    label = shlex.quote(where) + (f" --revision {shlex.quote(revision)}" if revision else "")
    name = where.rstrip("/").rsplit("/", 1)[-1]
    fatal = any(p.fatal for p in ckpt.problems)
    present = [e.name for e in ckpt.mtp_tensors()]
    if present and not fatal:
        layers = ckpt.spec.mtp_depth(present) or ckpt.spec.mtp.layers
        if clean(_after(ckpt, None, layers, lost_dropped=False)):
            return [f"mtpquant graft {label} --fix-metadata --out {name}-fixed"]
    forgotten = ckpt.forgotten_mtp() if ckpt.spec.mtp.declared and not present and not fatal else {}
    if forgotten:  # the MTP is there, in a shard the index forgot: indexing it is the repair
        mtp = {n: e for shard in forgotten.values() for n, e in shard.items()}
        layers = ckpt.spec.mtp_depth({**ckpt.tensors, **mtp}) or ckpt.spec.mtp.layers
        if clean(_after(ckpt, mtp, layers, lost_dropped=False, adopted=True)):
            return [f"mtpquant graft {label} --fix-metadata --out {name}-fixed"]
    commands = []
    grafted_clean = False
    if ckpt.spec.mtp.declared and (not fatal or ckpt.only_mtp_lost):
        grafted_clean = clean(_after(ckpt, _src_mtp(ckpt.spec), ckpt.spec.mtp.layers, lost_dropped=True))
        if grafted_clean:
            # an MTP already there (part of one, or one that differs) is replaced only when asked to
            replace = " --replace" if present else ""
            commands.append(f"mtpquant graft {label} --from SRC{replace} --out {name}-mtp{_SRC_NOTE}")
    # declared, never shipped (or lost): --fix-metadata un-declares it, so engines stop waiting for it
    # (where the MTP put back leaves it clean, so does no MTP at all: the same model and metadata, nothing declared)
    undeclarable = not present and not fatal and ckpt.spec.mtp.declared and ckpt.spec.family.mtp_key is not None
    if undeclarable and (grafted_clean or clean(_after(ckpt, None, 0, lost_dropped=False))):
        commands.append(f"mtpquant graft {label} --fix-metadata --out {name}-no-mtp{_UNDECLARE_NOTE}")
    return commands
