"""graft: repair a quant that lost its MTP by adding SRC's MTP tensors, writing only the MTP bytes.

Plan from headers, refuse early, then act:

1. open QUANT and SRC header-first; check lineage (family, dimensions, MTP shapes) before any write;
2. read only SRC's ``mtp.*`` tensors (byte ranges from the header table, locally or by ranged Hub
   reads, falling back to downloading just the shards that hold them) and write them into new
   ``mtp-*.safetensors`` shards through convert's keep mode (``surgery.modes``), the same code;
3. hard-link every untouched file (copy where links fail, reported), rewrite the index (existing
   entries unchanged, MTP entries added, ``total_size`` updated), restore the MTP declaration and
   add the exclusions in ``config.json`` and ``hf_quant_config.json``;
4. verify the result (headers, index, MTP bytes against SRC, the inspect checks) before it is put
   in place: ``--out`` by renaming a temp sibling, ``--in-place`` by an atomic directory exchange
   (see ``mtpquant.surgery.inplace``).

``--fix-metadata`` runs step 3's metadata part alone and touches no tensor file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from mtpquant.checkpoint.digest import checksum
from mtpquant.checkpoint.dtypes import planned_copy
from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.lock import OutputLock
from mtpquant.checkpoint.source import CheckpointSource, read_text
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir
from mtpquant.diagnose.verify import verify_result
from mtpquant.errors import CheckpointError, OutputExistsError, RecipeError, UsageError
from mtpquant.families import surgery_refusal
from mtpquant.graft.options import GraftOptions
from mtpquant.graft.source import TrackedSource
from mtpquant.public import public_args, public_name, public_ref
from mtpquant.recipes.recipe import RECIPE_FILE, grafted_recipe
from mtpquant.records.provenance import Step
from mtpquant.surgery import inplace
from mtpquant.surgery.lineage import GraftError, LineageError, LineageReport, check_lineage
from mtpquant.surgery.metadata import plan_metadata
from mtpquant.surgery.modes import MODES, WriteContext
from mtpquant.surgery.plan import Plan, plan_change
from mtpquant.surgery.shards import write_planned_mtp
from mtpquant.surgery.write import NewMtp, Verified, WriteLog, build, commit, open_destination
from mtpquant.units import format_bytes

__all__ = [
    "GraftError",
    "GraftOptions",
    "GraftResult",
    "LineageError",
    "fix_metadata",
    "graft",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GraftResult(WriteLog):
    """What graft did (or, with ``dry_run``, would do); what it wrote in ``WriteLog``'s fields."""

    quant: str
    source: str | None
    destination: str | None = None  # the directory that holds the result (None for a no-op / dry run)
    mode: str  # "out" | "in-place"
    action: str  # "grafted" | "replaced" | "metadata" | "noop" | "planned"
    message: str
    mtp_tensors: int = 0
    mtp_bytes: int = 0
    src_bytes_fetched: int = 0
    quant_bytes_fetched: int = 0
    src_requests: int = 0  # network requests to SRC (a Hub repo), redirects included
    quant_requests: int = 0
    metadata_changes: list[str] = field(default_factory=list)
    src_shards_downloaded: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------- writing


def _write(
    options: GraftOptions,
    plan: Plan,
    src: Checkpoint | None,
    verify: Callable[[Path], Verified],
    warnings: list[str],
    lineage: LineageReport | None = None,
) -> tuple[WriteLog, str]:
    """Write ``plan`` (SRC's MTP when ``src`` is given, else the metadata alone) and put it in place; returns what
    the write did and the directory that holds the result."""
    new_mtp = None
    if plan.add and src is not None and lineage is not None and (lineage.renamed or lineage.from_quant):
        renamed, from_quant, quant, origin = lineage.renamed, lineage.from_quant, plan.quant, src

        def write_renamed(od: OutputDir) -> list[str]:
            # a standalone NextN export: its layer 0 under QUANT's MTP layer, the copies it dropped from QUANT's own
            # head and embedding (bytes as stored, through the same MTP shard layout keep mode writes)
            planned = [
                dataclasses.replace(planned_copy(origin, e), name=renamed.get(e.name, e.name))
                for e in origin.mtp_tensors()
            ]
            planned += [
                dataclasses.replace(planned_copy(quant, quant.tensors[q]), name=n) for n, q in from_quant.items()
            ]
            return write_planned_mtp(od, planned, options.max_shard_bytes)

        new_mtp = NewMtp(plan.add, write_renamed)
    elif plan.add and src is not None:
        source = src

        def write_keep(od: OutputDir) -> list[str]:
            # graft puts the MTP back the way convert's keep mode writes it (the same code: extract + graft == keep)
            keep = MODES["keep"].write(WriteContext(od, source, options.max_shard_bytes))
            if keep.names != list(plan.add):
                raise GraftError("internal: keep mode wrote other MTP tensors than graft planned")
            return keep.shards

        new_mtp = NewMtp(plan.add, write_keep)
    ref = src.source.ref() if src is not None else None
    # the provenance goes public with OUT: local directories by their base name
    step = Step("graft", public_args(options.command, ref), source=public_ref(ref), mode="keep")
    texts = _grafted_recipe(plan.quant, public_name(src.label, ref), warnings) if new_mtp and src else {}
    out = Path(options.out) if options.out is not None else None
    dest = open_destination(plan.quant, out, replaces=bool(plan.drop or plan.rewrite))
    with dest.od:
        built = build(dest, plan, new_mtp, step, verify, link=options.link, texts=texts)
        return commit(dest, built), str(dest.path)


_RECIPE_LIMIT = 1 << 20  # a resolved recipe is a few hundred bytes


def _grafted_recipe(quant: Checkpoint, mtp_from: str, warnings: list[str]) -> dict[str, str]:
    """QUANT's resolved recipe file rewritten to say what the output is now (``convert.recipes.grafted_recipe``);
    none when QUANT has none. One that is not a recipe this mtpquant reads is carried as it is, with a warning."""
    if RECIPE_FILE not in quant.source.list_files():
        return {}
    where = f"{quant.label}: {RECIPE_FILE}"
    try:
        text = read_text(quant.source, RECIPE_FILE, limit=_RECIPE_LIMIT, what="recipe file")
        return {RECIPE_FILE: grafted_recipe(text, where, mtp_from)}
    except (CheckpointError, RecipeError) as exc:
        said = str(exc) if isinstance(exc, RecipeError) else f"{quant.label}: {exc}"
        warnings.append(f"{said}; carried unchanged (its mtp.mode does not say the MTP was grafted)")
        return {}


# ---------------------------------------------------------------------------------------------- entry points


def _check_options(options: GraftOptions) -> None:
    if (options.out is None) == (not options.in_place):
        raise UsageError("give exactly one of --out OUT or --in-place")
    if options.fix_metadata and options.source is not None:
        raise UsageError("--fix-metadata takes no --from: it repairs metadata only and touches no tensor file")
    if not options.fix_metadata and options.source is None:
        raise UsageError("give --from SRC (the checkpoint that still has the MTP), or --fix-metadata")
    options.check_fields(UsageError)


def _check_out(options: GraftOptions, quant: Checkpoint) -> None:
    if options.out is None:
        return
    out = Path(options.out).absolute()
    if os.path.lexists(out):
        raise OutputExistsError(f"{out}: output already exists; graft never overwrites (choose a new --out)")
    if quant.source.local_root is not None:
        root = quant.source.local_root.resolve()
        if out.resolve() == root or root in out.resolve().parents:
            raise GraftError(f"{out}: --out must not be inside QUANT")


def _open_quant(options: GraftOptions) -> Checkpoint:
    """QUANT, opened; an index defect is refused (as a strict open would) unless it is only a lost MTP: shards that
    do not exist and held nothing but MTP tensors, which ``--from SRC`` puts back."""
    quant = Checkpoint.open(
        options.quant, revision=options.revision, token=options.token, strict=False, name_errors=True
    )
    fatal = [p for p in quant.problems if p.fatal]
    if fatal and not quant.only_mtp_lost:
        not_mtp = [(s, [n for n in names if not quant.is_mtp(n)]) for s, names in quant.lost_tensors().items()]
        shard, names = next(((s, n) for s, n in not_mtp if n), ("", []))
        if names:
            raise CheckpointError(
                f"{quant.label}: {INDEX_NAME}: shard {shard!r} does not exist and held {len(names)} tensors that are "
                f"not MTP (first: {names[0]}); graft puts back only an MTP: restore that shard from where QUANT came"
            )
        raise CheckpointError(f"{quant.label}: {fatal[0].message}")
    if fatal and options.fix_metadata:
        shard, names = next(iter(quant.lost_tensors().items()))
        raise GraftError(
            f"{quant.label}: {INDEX_NAME}: shard {shard!r} does not exist (it held {len(names)} MTP tensors); "
            "--fix-metadata repairs metadata only: put the MTP back with --from SRC"
        )
    if options.in_place and quant.source.local_root is None:
        raise UsageError(f"{quant.label}: --in-place needs a local QUANT directory; for a Hub repo use --out")
    return quant


def _identical_mtp(quant: Checkpoint, src: Checkpoint) -> bool:
    """Whether QUANT's MTP is SRC's, byte for byte (compared tensor by tensor; stops at the first difference)."""
    q, s = {e.name: e for e in quant.mtp_tensors()}, {e.name: e for e in src.mtp_tensors()}
    if set(q) != set(s) or any((q[n].dtype, q[n].shape) != (s[n].dtype, s[n].shape) for n in q):
        return False
    quant.prefetch(q)
    src.prefetch(s)
    return all(quant.read_raw(q[n]) == src.read_raw(s[n]) for n in sorted(q))


def _result(
    options: GraftOptions,
    quant: Checkpoint,
    src: Checkpoint | None,
    t0: float,
    action: str,
    message: str,
    *,
    mtp: tuple[int, int],
    written: WriteLog | None = None,
    warnings: Sequence[str] = (),
    **facts: Any,
) -> GraftResult:
    """The result, made once: the facts, the MTP's tensors and bytes (``mtp``), what the write did (``written``),
    the network counts and the time."""
    log_ = written or WriteLog()
    done = {f.name: getattr(log_, f.name) for f in dataclasses.fields(WriteLog)}
    done["warnings"] = [*warnings, *log_.warnings]
    if action == "noop" and options.in_place:
        # an earlier run may have been killed after putting its result in place: tidy up after it
        assert quant.source.local_root is not None
        root = quant.source.local_root.resolve()
        with OutputLock.acquire(root):
            done["cleaned"] = inplace.clean_stale(root)
    log.info("%s", message)
    return GraftResult(
        **done,
        **facts,
        quant=quant.label,
        source=src.label if src is not None else None,
        mtp_tensors=mtp[0],
        mtp_bytes=mtp[1],
        mode="out" if options.out is not None else "in-place",
        action=action,
        message=message,
        quant_bytes_fetched=quant.source.bytes_read,
        quant_requests=quant.source.requests,
        src_bytes_fetched=src.source.bytes_read if src is not None else 0,
        src_requests=src.source.requests if src is not None else 0,
        seconds=round(time.perf_counter() - t0, 3),
    )


def graft(options: GraftOptions) -> GraftResult:
    """Add SRC's MTP to QUANT (or, with ``fix_metadata``, repair QUANT's MTP metadata only).

    Raises a one-line ``MtpquantError`` (nothing written) for a lineage mismatch, an SRC without MTP,
    an existing OUT, a QUANT that is not a checkpoint, a hostile index in either, or an MTP already
    present in QUANT that differs from SRC's without ``replace``.
    """
    t0 = time.perf_counter()
    _check_options(options)
    quant = _open_quant(options)
    what = "graft --fix-metadata" if options.fix_metadata else "graft"
    refusal = surgery_refusal(quant.spec.family, quant.label, what)
    if refusal is not None:
        raise refusal
    _check_out(options, quant)
    if options.fix_metadata:
        return _fix_metadata(options, quant, t0)

    assert options.source is not None
    src = Checkpoint.open(options.source, revision=options.source_revision, token=options.token, name_errors=True)
    refusal = surgery_refusal(src.spec.family, src.label, what)  # an SRC of a family graft does not repair
    if refusal is not None:
        raise refusal
    src_mtp = src.mtp_tensors()
    tracked = TrackedSource(src.source, src_mtp)
    src = dataclasses.replace(src, source=cast(CheckpointSource, tracked))
    lineage: LineageReport = check_lineage(quant, src)
    warnings = list(lineage.warnings)
    sizes = (len(src_mtp) + len(lineage.from_quant), lineage.mtp_bytes)
    hfq = quant.hf_quant_config

    existing = quant.mtp_tensors()
    removed: list[str] = []
    if existing:
        if _identical_mtp(quant, src):
            metadata = plan_metadata(
                quant.spec, hfq, quant.tensors, mtp_layers=lineage.mtp_layers, reference_config=src.config
            )
            plan = plan_change(quant, metadata)
            if not plan.metadata.changes:
                same = f"{quant.label} already has this MTP ({len(existing)} tensors, byte-identical to SRC's)"
                if options.out is not None and not options.dry_run:
                    # the output asked for is made all the same: QUANT as it is, its files linked
                    return _metadata_only(options, plan, src, t0, lineage.mtp_layers, f"{same}; nothing to change",
                                          warnings, sizes)
                message = f"{same} and its metadata is complete: nothing to do, nothing written"
                return _result(options, quant, src, t0, "noop", message, warnings=warnings, mtp=sizes)
            return _metadata_only(options, plan, src, t0, lineage.mtp_layers,
                                  "MTP already present and identical to SRC's", warnings, sizes)
        if not options.replace:
            lost = sum(len(names) for names in quant.lost_tensors().values())
            what = (
                f"part of an MTP ({len(existing)} MTP tensors; {lost} more were in shards that do not exist)"
                if lost
                else f"an MTP ({len(existing)} MTP tensors) that differs from SRC's"
            )
            raise GraftError(f"{quant.label}: already has {what}; pass --replace to replace it")
        removed = sorted(e.name for e in existing)
    gone = set(removed)
    renamed = [e._replace(name=lineage.renamed.get(e.name, e.name)) for e in src_mtp]  # SRC's under QUANT's names
    table: dict[str, Any] = {n: e for n, e in quant.tensors.items() if n not in gone}
    table.update({e.name: e for e in renamed})
    table.update({n: quant.tensors[q]._replace(name=n) for n, q in lineage.from_quant.items()})
    metadata = plan_metadata(quant.spec, hfq, table, mtp_layers=lineage.mtp_layers, reference_config=src.config)
    add = sorted({*(e.name for e in renamed), *lineage.from_quant})
    plan = plan_change(quant, metadata, add=add, removed=removed, mtp_layers=lineage.mtp_layers)
    warnings += plan.metadata.warnings
    changes = list(plan.metadata.changes)
    if options.dry_run:
        message = (
            f"would graft {len(plan.add)} MTP tensors ({format_bytes(lineage.mtp_bytes)}) from {src.label} "
            f"into {quant.label}; link {len(plan.link)} shard(s), rewrite {len(plan.rewrite)}, "
            f"drop {len(plan.drop)}; {len(plan.metadata.changes)} metadata change(s)"
        )
        return _result(options, quant, src, t0, "planned", message, warnings=warnings, metadata_changes=changes,
                       mtp=sizes)

    def verify(path: Path) -> Verified:
        # SRC's bytes as read (under their names in the result), QUANT's copies read now
        read = {lineage.renamed.get(n, n): h for n, h in tracked.hashes.items()}
        hashes = read | {n: checksum(quant.read_raw(quant.tensors[q])) for n, q in lineage.from_quant.items()}
        return verify_result(path, lineage.expected, hashes, lineage.mtp_layers, quant)

    written, destination = _write(options, plan, src, verify, warnings, lineage)
    verb = "replaced the MTP of" if plan.removed else "grafted the MTP into"
    message = (
        f"{verb} {destination}: {len(plan.add)} tensors, {format_bytes(lineage.mtp_bytes)} in "
        f"{len(written.new_shards)} new shard(s); wrote {format_bytes(written.bytes_written)}"
    )
    return _result(options, quant, src, t0, "replaced" if plan.removed else "grafted", message, written=written,
                   warnings=warnings, destination=destination, metadata_changes=changes,
                   src_shards_downloaded=list(tracked.downloaded), mtp=sizes)


def _fix_metadata(options: GraftOptions, quant: Checkpoint, t0: float) -> GraftResult:
    names = [e.name for e in quant.mtp_tensors()]
    adopted: dict[str, Any] = {}
    reindexed: list[str] = []
    if not names and quant.spec.mtp.declared:  # the MTP in a shard the index forgot (GLM-4.7's mtp.safetensors)
        for shard, tensors in quant.forgotten_mtp().items():
            adopted.update(tensors)
            reindexed.append(
                f"{INDEX_NAME}: {shard} indexed ({len(tensors)} MTP tensors the index did not list; loaders read only "
                "the shards the index names)"
            )
        names = sorted(adopted)
    if not names and (not quant.spec.mtp.declared or quant.spec.family.mtp_key is None):
        why = "and declares none" if not quant.spec.mtp.declared else "and its family has no key to un-declare it"
        raise GraftError(
            f"{quant.label}: has no MTP tensors {why}, so there is no MTP metadata to repair; graft one with "
            "--from SRC"
        )
    # no MTP at all but one declared (a publisher that never shipped it, Step-3.7-Flash-NVFP4): un-declared, so that
    # engines stop expecting it; --from SRC puts it back instead
    layers = quant.spec.mtp_depth(names) or (quant.spec.mtp.layers if names else 0)
    metadata = plan_metadata(quant.spec, quant.hf_quant_config, {**quant.tensors, **adopted}, mtp_layers=layers)
    metadata = dataclasses.replace(metadata, changes=(*reindexed, *metadata.changes))
    plan = plan_change(quant, metadata, adopted=adopted)
    warnings = list(plan.metadata.warnings)
    sizes = (len(names), sum((adopted.get(n) or quant.tensors[n]).nbytes for n in names))
    if not plan.metadata.changes:
        message = f"{quant.label}: MTP metadata is already complete; nothing written"
        return _result(options, quant, None, t0, "noop", message, warnings=warnings, mtp=sizes)
    if options.dry_run:
        message = f"would change: {'; '.join(plan.metadata.changes)}"
        return _result(options, quant, None, t0, "planned", message, warnings=warnings,
                       metadata_changes=list(plan.metadata.changes), mtp=sizes)
    return _metadata_only(options, plan, None, t0, layers, "repaired MTP metadata", warnings, sizes)


def _metadata_only(
    options: GraftOptions,
    plan: Plan,
    src: Checkpoint | None,
    t0: float,
    layers: int,
    what: str,
    warnings: list[str],
    sizes: tuple[int, int],
) -> GraftResult:
    """Write the JSON changes only; every tensor file is linked (--out) or left alone (--in-place)."""
    quant = plan.quant
    warnings = warnings + [w for w in plan.metadata.warnings if w not in warnings]
    expected = {e.name: e.shape for e in [*quant.mtp_tensors(), *plan.adopted.values()]}

    def verify(path: Path) -> Verified:
        return verify_result(path, expected, None, layers, quant)

    written, destination = _write(options, plan, None, verify, warnings)
    changes = "; ".join(plan.metadata.changes)
    message = f"{what} in {destination}: {changes}" if changes else f"{what}: wrote {destination}"
    return _result(options, quant, src, t0, "metadata", message, written=written, warnings=warnings,
                   destination=destination, metadata_changes=list(plan.metadata.changes), mtp=sizes)


def fix_metadata(
    quant: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    in_place: bool = False,
    revision: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
) -> GraftResult:
    """Repair QUANT's MTP declaration and exclusions only, touching no tensor file."""
    return graft(
        GraftOptions(
            quant=quant, out=out, in_place=in_place, fix_metadata=True, revision=revision, token=token, dry_run=dry_run
        )
    )
