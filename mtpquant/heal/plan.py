"""heal's plan, decided from configs and safetensors headers before any model loads; every early refusal.

The plan says what will be healed (QUANT's MTP, in its precision), from which weights, on what data and schedule,
where the result goes, and what it costs: memory for the quantized target (placed by the same plan as convert's,
``convert.memory``: in memory when it fits, else capped, with what does not fit read from QUANT's files and
dequantized when its layer runs), memory for training (the MTP with its optimizer state, the shared embedding and
LM head, one batch), and disk (the hidden-state shards, the new MTP shards). ``--dry-run`` prints it and stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.index import INDEX_NAME
from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.table import ENGINES
from mtpquant.errors import (
    CheckpointError,
    GraftError,
    HealRefusedError,
    MtpModeError,
    UsageError,
)
from mtpquant.heal.options import SAMPLED, HealOptions
from mtpquant.heal.precision import MtpStorage, mtp_storage
from mtpquant.heal.support import check_family, mtp_input_streams, plan_target_memory, training_bytes
from mtpquant.runtime.machine import DTYPE_BYTES, compute_dtype, resolve_device
from mtpquant.units import format_bytes

if TYPE_CHECKING:
    from mtpquant.measure.weights import CheckpointWeights
    from mtpquant.runtime.memory import MemoryPlan

__all__ = ["HEAD_FULL_PRECISION_LIMIT", "HealPlan", "Schedule", "plan_heal"]

# The shared LM head and embedding train in the compute dtype up to this size; above it (a 248k vocabulary) they
# stay in their stored dtype (BF16), which halves their memory (the logits are still computed into float32).
HEAD_FULL_PRECISION_LIMIT = 512 * 2**20


@dataclass(frozen=True)
class Schedule:
    """How the layer trains: AdamW, linear warm-up then cosine decay to ``min_lr_ratio`` x lr, clipped gradients."""

    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 8
    chain: int = 2
    seed: int = 0
    warmup_share: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    weight_decay: float = 0.0

    @property
    def warmup(self) -> int:
        """Steps of the linear warm-up (the learning rate then follows ``mtp.schedule.warmup_cosine``)."""
        return max(1, round(self.steps * self.warmup_share))


@dataclass(frozen=True)
class HealPlan:
    """What heal will do, decided from headers."""

    quant: str
    source: str
    destination: str
    mode: str  # "out" | "in-place"
    family: str
    storage: MtpStorage
    master: str  # where training starts: "QUANT" (its unquantized MTP) | "SRC" (the BF16 MTP QUANT was made from)
    mtp_tensors: int
    mtp_bytes: int
    device: str
    dtype: str  # compute dtype of the target and the training
    head_dtype: str  # dtype the shared embedding and LM head are held in during training
    memory: MemoryPlan  # where the quantized target goes (convert's memory plan)
    train_bytes: int  # estimated peak of the training phase
    data_bytes: int  # the hidden-state shards on disk
    sequences: int
    seq_len: int
    schedule: Schedule
    options: HealOptions = field(repr=False)
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The ``--dry-run`` lines."""
        o, t, sizes = self.options, self.schedule, self.options.sizes
        greedy = o.samples - round(o.samples * SAMPLED)
        settings = o.sampling_settings
        greedy_only = len(settings) == 1 and settings[0].greedy
        out = [
            f"heal       {self.quant} (MTP {self.storage.label}, {self.mtp_tensors} tensors, "
            f"{format_bytes(self.mtp_bytes)}) -> {self.destination} ({self.mode})",
            f"weights    training starts from {self.master}'s MTP"
            + ("; modelopt fake quantization in the loop, written back as " + self.storage.label
               if self.storage.kinds else "; written back as BF16"),
            f"data       {o.samples} prompts of {sizes.prompt_len} tokens ({o.data}) continued by QUANT's target for "
            f"{sizes.new_tokens} tokens: {greedy} greedy, {o.samples - greedy} at temperature {o.data_temperature:g}",
            f"schedule   {t.steps} steps x {t.batch_size} sequences, lr {t.lr:g}, chain {t.chain}, seed {t.seed}; "
            f"{self.device}, {self.dtype}",
            f"check      held-out AL at k = 1..{o.k} on {o.check_prompts} prompts of validate's held-out text, before "
            + ("and after" if greedy_only else f"and after, at {' and '.join(s.label for s in settings)} "
               f"(--rule {o.rule})")
            + "; nothing is written unless "
            + ("better beyond noise at every k" if o.strict else f"better beyond noise at the served k = {o.k}")
            + (" and worse beyond noise at no k" if greedy_only
               else f" at {settings[0].label} and worse at no k of any setting")
            + (" (--force: written anyway)" if o.force else ""),
            *self.memory.lines(
                "the quantized target, dequantized" + (": the layers on disk read from QUANT's files and "
                                                       "dequantized as they run" if self.memory.disk_bytes else "")
            ),
            f"training   ~{format_bytes(self.train_bytes)} (MTP + optimizer state, embedding and LM head in "
            f"{self.head_dtype}, one batch)",
            f"disk       {format_bytes(self.data_bytes)} of hidden states ({self.sequences} x {self.seq_len} tokens, "
            f"removed at the end), {format_bytes(self.mtp_bytes)} of new MTP shards",
        ]
        out += [f"note       {n}" for n in self.notes]
        return out

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return {
            "quant": self.quant,
            "source": self.source,
            "destination": self.destination,
            "mode": self.mode,
            "family": self.family,
            "precision": self.storage.label,
            "master": self.master,
            "mtp": {"tensors": self.mtp_tensors, "bytes": self.mtp_bytes},
            "device": self.device,
            "dtype": self.dtype,
            "head_dtype": self.head_dtype,
            "memory": self.memory.to_json(),
            "train_bytes": self.train_bytes,
            "data_bytes": self.data_bytes,
            "notes": list(self.notes),
        }


def _open_quant(options: HealOptions) -> Checkpoint:
    """QUANT, opened strictly; an index that names MTP shards that do not exist is heal's refusal (its MTP is
    incomplete), said with the checkpoint, the shard and graft's command that puts the MTP back."""
    quant = Checkpoint.open(
        options.quant, revision=options.revision, token=options.token, strict=False, name_errors=True
    )
    fatal = [p for p in quant.problems if p.fatal]
    if fatal and quant.only_mtp_lost:
        shard, names = next(iter(quant.lost_tensors().items()))
        replace = " --replace" if quant.mtp_tensors() else ""
        raise HealRefusedError(
            f"{quant.label}: {INDEX_NAME}: shard {shard!r} does not exist (it held {len(names)} mtp.* tensors), so "
            f"its MTP is incomplete; put it back first with `mtpquant graft {quant.label} --from SRC{replace} --out "
            "FIXED`"
        )
    if fatal:
        raise CheckpointError(f"{quant.label}: {fatal[0].message}")
    return quant


def plan_heal(options: HealOptions) -> tuple[HealPlan, Checkpoint, Checkpoint, CheckpointWeights]:
    """Check everything that can be checked from headers and build the plan; returns it, QUANT, SRC and QUANT's
    dequantizing reader (``measure.weights.CheckpointWeights``)."""
    from mtpquant.errors import ValidateLoadError
    from mtpquant.surgery.lineage import check_lineage
    from mtpquant.surgery.metadata import plan_metadata
    from mtpquant.text.calibration import check_calibration_source

    options.check()
    check_calibration_source(options.data)
    quant = _open_quant(options)
    if options.in_place and quant.source.local_root is None:
        raise UsageError(f"{quant.label}: --in-place needs a local QUANT directory; for a Hub repo use --out")
    out = Path(options.out).absolute() if options.out is not None else None
    if out is not None:  # options.check() refused an OUT that exists
        root = quant.source.local_root
        if root is not None and (out.resolve() == root.resolve() or root.resolve() in out.resolve().parents):
            raise UsageError(f"{out}: --out must not be inside QUANT")
    src = Checkpoint.open(options.source, revision=options.source_revision, token=options.token, name_errors=True)
    present = {e.name for e in quant.mtp_tensors()}
    if not present:
        raise HealRefusedError(
            f"{quant.label}: has no MTP (no mtp.* tensors), so there is nothing to heal; put it back first with "
            f"`mtpquant graft {quant.label} --from SRC`"
        )
    check_family(quant.spec.family, quant.label)
    # a quantized Linear keeps its .weight name (ModelOpt), or stores .weight_packed (compressed-tensors)
    missing = sorted(
        n for n in quant.spec.expected_mtp_shapes(present)
        if n not in present and not (n.endswith(".weight") and n[: -len("weight")] + "weight_packed" in present)
    )
    if missing:
        raise HealRefusedError(
            f"{quant.label}: its MTP is incomplete ({len(missing)} tensors missing, first {missing[0]}); repair it "
            "with `mtpquant graft --replace` first"
        )
    try:
        lineage = check_lineage(quant, src)
    except (GraftError, MtpModeError) as exc:
        raise HealRefusedError(f"{exc} (heal needs the BF16 checkpoint QUANT was made from as --from)") from None
    metadata = plan_metadata(quant.spec, quant.hf_quant_config, quant.tensors, mtp_layers=lineage.mtp_layers)
    if metadata.changes:
        raise HealRefusedError(
            f"{quant.label}: its MTP metadata is incomplete ({metadata.changes[0]}); repair it first with "
            "`mtpquant graft QUANT --fix-metadata`"
        )
    device = resolve_device(options.device, probe=False)  # the plan names the device; the run finds it
    dtype = compute_dtype(device, options.dtype)
    from mtpquant.measure.weights import CheckpointWeights  # torch: once QUANT and SRC are open and checked

    try:
        weights = CheckpointWeights(quant)
    except ValidateLoadError as exc:
        raise HealRefusedError(str(exc)) from None
    tied = weights.lm_head_name() == weights.embed_name()
    shapes = [(name, weights.shape(name)) for name in weights.names()]
    storage = mtp_storage(quant, weights.formats)
    spec = quant.spec
    H, V = spec.hidden_size, spec.dim("vocab_size")
    head_dtype = dtype if V * H * DTYPE_BYTES[dtype] <= HEAD_FULL_PRECISION_LIMIT else "bfloat16"
    seq_len = options.sizes.seq_len
    schedule = Schedule(options.steps, options.lr, options.sizes.batch_size, options.chain, options.seed)
    streams = mtp_input_streams(quant)
    train_bytes = training_bytes(quant, schedule.batch_size * seq_len * schedule.chain, V * H * DTYPE_BYTES[head_dtype],
                                 tied, streams)
    memory = plan_target_memory(shapes, quant.classify, DTYPE_BYTES[dtype], device, max_memory=options.max_memory,
                                shard_bytes=options.max_shard_bytes)
    data_bytes = options.samples * seq_len * (H * DTYPE_BYTES[dtype] * (1 + streams) + 8)
    notes: list[str] = list(lineage.warnings)
    if storage.kinds:  # what each engine makes of a quantized MTP (the table's rows say)
        notes += [n for e in ENGINES if (n := e.adapter.quantized_mtp_note()) is not None and n not in notes]
    mode = "out" if out is not None else "in-place"
    destination = str(out) if out is not None else str(quant.source.local_root)
    plan = HealPlan(
        quant=quant.label,
        source=src.label,
        destination=destination,
        mode=mode,
        family=spec.family.key,
        storage=storage,
        master="SRC" if storage.kinds else "QUANT",
        mtp_tensors=len(present),
        mtp_bytes=sum(e.nbytes for e in quant.mtp_tensors()),
        device=device,
        dtype=dtype,
        head_dtype=head_dtype,
        memory=memory,
        train_bytes=train_bytes,
        data_bytes=data_bytes,
        sequences=options.samples,
        seq_len=seq_len,
        schedule=schedule,
        options=options,
        notes=tuple(notes),
    )
    return plan, quant, src, weights

