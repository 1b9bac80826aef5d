"""``heal``: re-align QUANT's MTP to QUANT's own (quantized) target, and write it back only if it is better.

Steps: plan from headers (``plan.py``; ``--dry-run`` stops there) -> the destination opened (``--out``: a temp sibling;
``--in-place``: QUANT locked, a mirror of it beside it) -> the quantized target, dequantized as validate loads it
(activations emulated as the engines run them), in memory or under the plan's caps -> its greedy continuations of
the held-out prompts (the check's sequences) -> its continuations of the calibration prompts and its hidden states,
in shards on disk (``data.py``) -> the target released -> the MTP's training weights (``precision.py``), modelopt's
fake quantization on the Linears QUANT stores quantized (``qat.py``), self-distillation (``train.py``) -> the
healed MTP in QUANT's format, written as new MTP shards with every other file linked, verified (``graft.write``)
-> the check: QUANT's MTP and the written one measured on the held-out sequences (``check.py``) -> nothing
written unless better beyond noise at every k (exit 24), else the provenance records the heal and the result is
put in place (rename, or atomic directory exchange).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.errors import HealNotBetterError, OutputVerificationError
from mtpquant.heal.check import CheckResult
from mtpquant.heal.options import HealOptions
from mtpquant.heal.plan import HealPlan, plan_heal
from mtpquant.heal.train import TrainLog
from mtpquant.public import public_text
from mtpquant.records.provenance import HealAl, HealRecord
from mtpquant.runtime.meter import Timer, peak_rss_bytes
from mtpquant.surgery.write import WriteLog

__all__ = ["HealOptions", "HealPlan", "HealResult", "heal", "plan_heal"]

log = logging.getLogger(__name__)

DATA_DIR = ".heal-data"


@dataclass(kw_only=True)
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


def _record(plan: HealPlan, data: Any, check: CheckResult, forced: bool) -> HealRecord:
    o = plan.options
    return HealRecord(
        precision=plan.storage.label,
        data=public_text(data.source),  # the record goes public with OUT: local paths by base name
        sequences=data.sequences,
        tokens=data.tokens,
        sampled=data.sampled,
        temperature=o.temperature,
        steps=o.steps,
        lr=o.lr,
        batch_size=o.batch_size,
        chain=o.chain,
        seed=o.seed,
        check_sequences=check.sequences,
        by_k=tuple(HealAl(c.k, c.before, c.after, c.low, c.high) for c in check.by_k),
        better=check.better,
        forced=forced,
    )


def _changes(check: CheckResult) -> str:
    return ", ".join(f"k={c.k}: {c.before:.3f} -> {c.after:.3f} ({c.change:+.3f} [{c.low:+.3f}, {c.high:+.3f}])"
                     for c in check.by_k)


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
    from mtpquant.runtime.memory import keep_freed_memory, return_freed_memory
    from mtpquant.surgery.write import open_target

    # layers streamed from disk: every large tensor returned when freed (convert's setting); a resident target:
    # freed memory kept for the next step's tensors (a third less CPU on the tiny model's heal)
    if plan.memory.disk_bytes:
        return_freed_memory()
    else:
        keep_freed_memory()
    out = Path(options.out).absolute() if options.out is not None else None
    target = open_target(quant, out, replaces=True)
    result = HealResult(plan=plan, action="healed", message="", cleaned=list(target.cleaned),
                        warnings=list(plan.notes))
    from mtpquant.runtime.libraries import library_output

    with target.od, library_output(options.progress):  # transformers' messages under our logging levels
        _heal(plan, quant, src, weights, target, result, timer)
    result.destination = str(target.destination)
    result.commit = target.commit
    result.timings = {**timer.timings, "total": time.perf_counter() - t_start}
    result.peak_rss_after = dict(timer.peak_rss_after)
    result.cpu_seconds = time.process_time() - c0
    result.peak_rss_bytes = peak_rss_bytes()
    assert result.check is not None
    verb = "wrote the healed MTP (--force: not better beyond noise)" if result.action == "forced" else "healed the MTP"
    result.message = f"{verb} into {result.destination}: held-out AL {_changes(result.check)}"
    log.info("%s", result.message)
    return result


def _heal(
    plan: HealPlan, quant: Checkpoint, src: Checkpoint, weights: Any, target: Any, result: HealResult, timer: Timer
) -> None:
    """Everything between opening the destination and committing it (nothing is put in place on an error)."""
    import torch

    from mtpquant.heal.check import check_prompts
    from mtpquant.heal.data import collect, training_prompts
    from mtpquant.heal.write import record_step, write_healed
    from mtpquant.measure.capture import capture
    from mtpquant.measure.load import CheckpointWeights, load_target
    from mtpquant.runtime.machine import resolve_device
    from mtpquant.surgery.write import commit
    from mtpquant.text.calibration import load_tokenizer
    from mtpquant.text.prompts import plan_sequences, tokenize_prompts

    options = plan.options
    torch.set_flush_denormal(True)  # denormals in tiny AdamW updates make CPU kernels crawl
    device = torch.device(resolve_device(plan.device))
    dtype = getattr(torch, plan.dtype)
    od = target.od
    scratch = od.path / DATA_DIR
    vocab = quant.spec.dim("vocab_size")

    # 1. the quantized target: the held-out sequences, then the training data
    with timer("target"):
        model = load_target(weights, device=device, dtype=dtype, activations=options.activations,
                            max_memory=plan.memory.caps.for_accelerate() if plan.memory.caps else None)
    with timer("check_target"):
        ids = tokenize_prompts(quant.source, check_prompts(options.check_prompts), vocab)
        held_out = capture(model, plan_sequences(ids, options.check_len), label="held-out", progress=options.progress,
                           batch_size=options.batch_prompts)
    with timer("data"):
        tokenizer = load_tokenizer(quant.source.local_dir(["*.safetensors", "*.bin", "*.pt", "*.pth"]))
        prompts, source = training_prompts(tokenizer, options.data, options.samples, options.prompt_len, vocab)
        data = collect(
            model, prompts, new_tokens=options.new_tokens, temperature=options.temperature, sampled=options.sampled,
            seed=options.seed, batch_size=options.batch_prompts, directory=scratch, source=source,
            progress=options.progress,
        )
        result.data_bytes = data.nbytes
    model.model = None
    del model
    gc.collect()

    # 2. training
    with timer("train"):
        shared = weights.embedding_and_head(getattr(torch, plan.head_dtype), device)
        healed, result.training = _train(plan, quant, src, data, device, shared)
    shutil.rmtree(scratch, ignore_errors=True)

    # 3. the healed MTP written the graft way and verified; measured; then committed, or dropped
    with timer("write"):
        json_files = write_healed(plan, quant, src, healed, target, result)
    del healed  # the float32 training copy: the check reads the written MTP back
    gc.collect()
    if shared[0].dtype != dtype:  # training held them in another dtype than the check computes in
        del shared
        gc.collect()
        shared = weights.embedding_and_head(dtype, device)
    with timer("check"):
        check = _check(weights, CheckpointWeights(Checkpoint.open(od.path, strict=True)), held_out, shared, options)
    result.check = check
    if not check.better and not options.force:
        raise HealNotBetterError(
            f"{plan.quant}: the healed MTP is not better beyond noise on {check.sequences} held-out prompts "
            f"(AL {_changes(check)}); nothing written"
        )
    result.action = "healed" if check.better else "forced"
    result.record = _record(plan, data, check, forced=not check.better)
    record_step(plan, quant, src, result.record, target)
    with timer("commit"):
        commit(target, result, json_files, what="healing")


def _check(before: Any, after: Any, held_out: Any, shared: tuple[Any, Any], options: HealOptions) -> CheckResult:
    """QUANT's MTP (``before``) and the healed one as written (``after``) measured on the held-out run.

    The check is heal's last phase and must not raise its peak memory above training's: it uses training's
    embedding and LM head (``shared``; reading them again takes twice their size for a moment, 2.5 GB on
    Qwen3.5-4B) and loads one MTP at a time.
    """
    from mtpquant.heal.check import compare, unit_counts
    from mtpquant.measure.load import load_mtp

    embed, head = shared
    counts = []
    for label, weights in (("QUANT's", before), ("the healed", after)):
        bundle, err = load_mtp(weights, dtype=embed.dtype, device=embed.device, activations=options.activations,
                               shared=(embed, head))
        if bundle is None:
            raise OutputVerificationError(f"{label} MTP does not load for evaluation: {err}")
        counts.append(unit_counts(bundle, held_out, options.k))
        del bundle
        gc.collect()
    return compare(counts[0], counts[1], held_out)


def _train(plan: HealPlan, quant: Checkpoint, src: Checkpoint, data: Any, device: Any,
           shared: tuple[Any, Any]) -> tuple[dict[str, Any], TrainLog]:
    """The healed MTP weights (float32, on the CPU) by checkpoint name, and how training went (``shared``: the
    embedding and LM head, frozen)."""
    import torch

    from mtpquant.heal.precision import master_weights
    from mtpquant.heal.qat import quantize_for_training
    from mtpquant.heal.train import Schedule, distill
    from mtpquant.mtp.module import MTP_PREFIX, MtpConfig, MtpLayer

    options = plan.options
    torch.manual_seed(options.seed)
    master, _ = master_weights(quant, src, plan.storage)
    layer = MtpLayer.from_state_dict(MtpConfig.from_text_config(quant.config), master, dtype=torch.float32,
                                     device=device)
    embed, head = shared

    def calibrate(module: Any) -> None:
        tokens, hidden = data.batch(range(min(options.batch_size, data.sequences)), device)
        module(hidden[:, :-1].float(), torch.nn.functional.embedding(tokens[:, 1:], embed).float())

    quantize_for_training(layer, plan.storage, calibrate)
    schedule = Schedule(steps=options.steps, lr=options.lr, batch_size=options.batch_size, chain=options.chain,
                        seed=options.seed)
    trained = distill(layer, data, embed, head, schedule, device=device, progress=options.progress)
    return {MTP_PREFIX + n: p.detach().float().cpu() for n, p in layer.named_parameters()}, trained
