"""``heal``: re-align QUANT's MTP to QUANT's own (quantized) target, and write it back only if it is better.

Steps: plan from headers (``plan.py``; ``--dry-run`` stops there) -> the destination opened (``--out``: a temp sibling;
``--in-place``: QUANT locked, a mirror of it beside it) -> the quantized target, dequantized as validate loads it
(activations emulated as the engines run them), in memory or under the plan's caps -> its greedy continuations of
the held-out prompts (the check's sequences) -> its continuations of the calibration prompts and its hidden states,
in shards on disk (``data.py``) -> the target released -> the MTP's training weights (``precision.py``), modelopt's
fake quantization on the Linears QUANT stores quantized (``qat.py``), self-distillation (``train.py``) -> the
healed MTP in QUANT's format, written as new MTP shards with every other file linked, verified (``surgery.write``)
-> the check: QUANT's MTP and the written one measured on the held-out sequences at each sampling setting
(``check.py``) -> nothing written unless better beyond noise at the served k (``--k``; every k with ``--strict``) of
the first setting and worse beyond noise at no k of any (``decision.py``; exit 24), else the provenance records the
heal and the result is put in place (rename, or atomic directory exchange).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import HealNotBetterError
from mtpquant.heal.options import HealOptions
from mtpquant.heal.plan import HealPlan, plan_heal
from mtpquant.records.provenance import HealRecord
from mtpquant.runtime.meter import Timer, peak_rss_bytes
from mtpquant.surgery.write import Destination, WriteLog

if TYPE_CHECKING:  # torch-side: imported where the work starts, after QUANT and SRC are open and planned
    from mtpquant.heal.check import CheckResult
    from mtpquant.heal.train import TrainLog
    from mtpquant.measure.weights import CheckpointWeights

__all__ = ["HealOptions", "HealPlan", "HealResult", "heal", "plan_heal"]

log = logging.getLogger(__name__)

DATA_DIR = ".heal-data"


@dataclass(frozen=True, kw_only=True)
class HealResult(WriteLog):
    """What heal did (or, with ``dry_run``, would do); what it wrote in ``WriteLog``'s fields."""

    plan: HealPlan
    action: str  # "planned" | "healed" | "forced" (written with --force although not better)
    message: str
    destination: str | None = None
    record: HealRecord | None = None
    check: CheckResult | None = None
    training: TrainLog | None = None
    data_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    peak_rss_bytes: int = 0
    peak_rss_after: dict[str, int] = field(default_factory=dict)  # the peak RSS when each phase ended

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("plan", "record", "check", "training")}
        out["plan"] = self.plan.to_json()
        out["record"] = self.record.to_json() if self.record else None
        out["training"] = dataclasses.asdict(self.training) if self.training else None
        return out


@dataclass(frozen=True)
class _Healed:
    """What ``_heal`` did: the write, the check, the training, the record, the data's bytes."""

    written: WriteLog
    check: CheckResult
    training: TrainLog
    record: HealRecord
    data_bytes: int


def _changes(check: CheckResult) -> str:
    """Every k's verdict, change and interval (per setting when the check ran at several)."""
    from mtpquant.heal.decision import changes_text

    if check.greedy_only:
        return changes_text(check.by_k)
    return " | ".join(f"{s.sampling.label} ({s.verdict}): {changes_text(s.by_k)}" for s in check.settings)


def _rule_text(check: CheckResult) -> str:
    return check.decision.text(max((c.k for c in check.by_k), default=0))


def heal(options: HealOptions) -> HealResult:
    """Heal QUANT's MTP against QUANT's target; see the module docstring. Raises ``HealNotBetterError`` (exit 24,
    nothing written) when the healed MTP is not better beyond noise, and other one-line ``MtpquantError``s."""

    c0 = time.process_time()
    timer = Timer()
    t_start = time.perf_counter()
    with timer("plan"):
        plan, quant, src, weights = plan_heal(options)
    if options.dry_run:
        return HealResult(plan=plan, action="planned",
                          message=f"would heal the MTP of {plan.quant} into {plan.destination}", timings=timer.timings)
    from mtpquant.runtime.libraries import library_output
    from mtpquant.runtime.memory import keep_freed_memory, return_freed_memory
    from mtpquant.surgery.write import open_destination

    # layers streamed from disk: every large tensor returned when freed (convert's setting); a resident target:
    # freed memory kept for the next step's tensors (a third less CPU on the tiny model's heal)
    if plan.memory.disk_bytes:
        return_freed_memory()
    else:
        keep_freed_memory()
    dest = open_destination(quant, options.out_path, replaces=True)
    with dest.od, library_output(options.progress):  # transformers' messages under our logging levels
        healed = _heal(plan, quant, src, weights, dest, timer)
    action = "healed" if healed.check.better else "forced"
    verb = "wrote the healed MTP (--force: not better beyond noise)" if action == "forced" else "healed the MTP"
    message = (f"{verb} into {dest.path}: {_rule_text(healed.check) if action == 'healed' else 'held-out AL'}: "
               f"{_changes(healed.check)}")
    log.info("%s", message)
    written = {f.name: getattr(healed.written, f.name) for f in dataclasses.fields(WriteLog)}
    return HealResult(
        **written | {"warnings": [*plan.notes, *healed.written.warnings]},
        plan=plan,
        action=action,
        message=message,
        destination=str(dest.path),
        record=healed.record,
        check=healed.check,
        training=healed.training,
        data_bytes=healed.data_bytes,
        timings={**timer.timings, "total": time.perf_counter() - t_start},
        cpu_seconds=time.process_time() - c0,
        peak_rss_bytes=peak_rss_bytes(),
        peak_rss_after=dict(timer.peak_rss_after),
    )


def _heal(
    plan: HealPlan, quant: Checkpoint, src: Checkpoint, weights: CheckpointWeights, dest: Destination, timer: Timer
) -> _Healed:
    """Everything between opening the destination and committing it (nothing is put in place on an error)."""
    import torch

    from mtpquant.heal.check import check, held_out_runs
    from mtpquant.heal.data import training_data
    from mtpquant.heal.decision import HealRule
    from mtpquant.heal.train import train
    from mtpquant.heal.write import record_step, write_healed
    from mtpquant.measure.target import load_target
    from mtpquant.measure.weights import CheckpointWeights
    from mtpquant.runtime.machine import resolve_device
    from mtpquant.surgery.write import commit

    options, sizes = plan.options, plan.options.sizes
    torch.set_flush_denormal(True)  # denormals in tiny AdamW updates make CPU kernels crawl
    device = torch.device(resolve_device(plan.device))
    dtype = getattr(torch, plan.dtype)
    scratch = dest.od.path / DATA_DIR
    vocab = quant.spec.dim("vocab_size")

    # 1. the quantized target: the held-out sequences, then the training data
    with timer("target"):
        target = load_target(weights, device=device, dtype=dtype, activations=options.activations,
                             max_memory=plan.memory.caps.for_accelerate() if plan.memory.caps else None)
    with timer("check_target"):
        held_out = held_out_runs(target, quant.source, vocab, options.check_prompts, sizes.check_len,
                                 options.sampling_settings, batch_size=sizes.batch_prompts, progress=options.progress)
    with timer("data"):
        data = training_data(target, quant.source, vocab, options.data, options.samples, sizes,
                             temperature=options.data_temperature, seed=plan.schedule.seed, directory=scratch,
                             progress=options.progress)
    target.release()
    del target

    # 2. training
    with timer("train"):
        shared = weights.embedding_and_head(getattr(torch, plan.head_dtype), device)
        trained, training = train(quant, src, plan.storage, data, shared, plan.schedule, device=device,
                                  progress=options.progress)
    data_bytes = data.nbytes
    shutil.rmtree(scratch, ignore_errors=True)

    # 3. the healed MTP written the graft way and verified; measured; then committed, or dropped
    with timer("write"):
        built = write_healed(quant, src, plan.storage, trained, dest, command=options.command,
                             max_shard_bytes=options.max_shard_bytes, link=options.link)
    del trained  # the float32 training copy: the check reads the written MTP back
    gc.collect()
    if shared[0].dtype != dtype:  # training held them in another dtype than the check computes in
        del shared
        gc.collect()
        shared = weights.embedding_and_head(dtype, device)
    with timer("check"):
        after = CheckpointWeights(Checkpoint.open(dest.od.path, strict=True))
        result = check(weights, after, held_out, shared, activations=options.activations, k=options.k,
                       rule=options.rule, decision=HealRule(options.k, options.strict))
    if not result.better and not options.force:
        worse = [s.sampling.label for s in result.settings if s.worse]
        served = "at every k (--strict)" if result.decision.strict else (
            f"at the served k = {result.decision.served(result.by_k)}")
        if worse:
            what = "worse beyond noise" + ("" if result.greedy_only else f" at {' and '.join(worse)}")
        else:
            what = f"not better beyond noise {served}" + (
                "" if result.greedy_only else f" at {result.settings[0].sampling.label}")
        raise HealNotBetterError(
            f"{plan.quant}: the healed MTP is {what} on {result.sequences} held-out prompts (AL {_changes(result)}); "
            "nothing written"
        )
    record = record_step(quant, src, dest, options.command, plan.storage.label, plan.schedule, data, result)
    with timer("commit"):
        written = commit(dest, built, what="healing")
    return _Healed(written, result, training, record, data_bytes)
