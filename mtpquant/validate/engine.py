"""``validate`` through the engines users deploy: a running vLLM or SGLang server (``--server``, recognised by
its routes), or one started here (``--engine vllm|sglang``), measured by the engine's own speculative counters.

The prompts, lengths and sampling are the built-in path's (the default held-out prompts, or ``--prompts``;
tokenized with the checkpoint's ``tokenizer.json``, or by the server's ``/tokenize`` when only a URL is given;
planned as ``prompts.plan_sequences`` plans them, context buckets included; sent with ``ignore_eos`` at every
``--temperature`` with ``--top-p`` / ``--top-k``, prompt i with seed ``--seed + i``), in groups of
``--concurrency`` requests (``validate.measure``; each group a unit of the intervals). vLLM's counters are
server-wide, read around each group and subtracted (traffic from other clients meanwhile is counted in and
reported); SGLang's come with each request (exactly these requests) and must describe the k-step MTP chain (NEXTN,
topk 1): a tree is refused. ``--candidate-server`` pairs work across engines. With ``--engine`` one server is
started per k (the number of drafts, and vLLM's verification rule, are fixed per server) on 127.0.0.1 and measures
every setting; its memory is sized for what validate sends (``engine/sizing.py``), its log written into a temporary
directory (``server_logs``: moved into the report's ``logs/``, removed, or kept and named when the run fails), and it
is stopped afterwards (also on Ctrl-C or an error). ``--compare-reference`` also runs the built-in
prediction on the same prompts and settings and reports both, per setting and k, per position too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from itertools import groupby
from pathlib import Path

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.engine.connect import client_for, connect
from mtpquant.engine.http import engine_api_key
from mtpquant.engine.launch import EngineProcess, free_port, server_args
from mtpquant.engine.server import EngineServer, ServerInfo, SpecConfig, resolve_model
from mtpquant.engine.sizing import Machine, plan_engine_memory, probe_machine
from mtpquant.engine.table import display as engine_display
from mtpquant.engine.table import engine as engine_row
from mtpquant.errors import EngineAnswerError, ValidateError
from mtpquant.public import public_args, public_checkpoint
from mtpquant.records.acceptance import Acceptance, AcceptanceRow, ContextBucket
from mtpquant.records.evidence import Bootstrap
from mtpquant.records.sampling import rule
from mtpquant.records.validation import Comparison, EngineInfo, MtpInfo, Predicted, PredictedRow, Side
from mtpquant.text.prompts import PlannedSequence, plan_sequences, tokenize_prompts
from mtpquant.validate.assemble import Measured, report_settings
from mtpquant.validate.measure import EngineMeasurement, measure
from mtpquant.validate.options import ValidateOptions
from mtpquant.validate.preflight import Opened

__all__ = ["server_logs", "validate_engine"]

log = logging.getLogger(__name__)

ENGINE_NOTE = "The same prompts, lengths and sampling settings as the built-in path (ignore_eos)."
@dataclasses.dataclass(frozen=True)
class _Measured:
    """One side measured at one k, at every sampling setting: the engine's numbers and the server that gave them."""

    label: str
    checkpoint: str
    engine: EngineInfo
    measurements: tuple[EngineMeasurement, ...]
    notes: tuple[str, ...] = ()

    @property
    def measurement(self) -> EngineMeasurement:
        """The headline setting's measurement."""
        return self.measurements[0]


def _server_prompts(client: EngineServer, model: str, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of ``texts`` from the server's own tokenizer (no local checkpoint to tokenize with)."""
    try:
        ids = [client.tokenize(model, t) for t in texts]
    except EngineAnswerError as exc:
        raise EngineAnswerError(
            f"{exc} (give the served checkpoint as CHECKPOINT: its tokenizer makes the prompts)"
        ) from None
    return [row for row in ids if len(row) >= 2]


def _plan(opts: ValidateOptions, ids: Sequence[Sequence[int]]) -> list[PlannedSequence]:
    """The sequences, those of one context bucket next to each other (so no request group mixes buckets)."""
    plan = plan_sequences(ids, opts.max_len, opts.context_buckets)
    if not plan:
        raise ValidateError("no prompt is long enough to measure")
    return plan


def _measure_all(
    opts: ValidateOptions, server: EngineServer, info: ServerInfo, model: str, plan: Sequence[PlannedSequence]
) -> tuple[EngineMeasurement, ...]:
    """Every sampling setting on one server: the same prompts, lengths and seeds; a bucket's prompts grouped."""
    prompts, new = [list(s.prompt) for s in plan], [s.new_tokens for s in plan]
    runs = [sum(1 for _ in group) for _, group in groupby(plan, key=lambda s: s.bucket)]
    return tuple(
        measure(server, info, model, prompts, new, s, concurrency=opts.concurrency, runs=runs)
        for s in opts.sampling_settings
    )


def _engine_info(
    opts: ValidateOptions,
    info: ServerInfo,
    model: str,
    ms: Sequence[EngineMeasurement],
    args: Sequence[str],
    label: str,
    spec: SpecConfig | None,
    requested_k: int,
    memory: str = "",
) -> EngineInfo:
    """``requested_k``: the k to report when the server counted no draft positions (a vLLM without per-position
    counters); ``memory``: what a server validate started was given."""
    m = ms[0]
    k = m.k or requested_k
    return EngineInfo(
        name=info.engine,
        version=info.version,
        url=info.url,
        model=public_checkpoint(model),  # a started engine serves the checkpoint's directory
        k=k,
        k_source="server" if m.k else "--k",
        sampling={
            "settings": [x.sampling.to_json() for x in ms],
            "rule": opts.rule,
            "ignore_eos": True,
            "concurrency": opts.concurrency,
        },
        server_args=public_args(args),  # the report goes public with OUT: no key, paths by base name
        other_requests=sum(x.other_requests for x in ms),
        side=label,
        speculative=(spec or SpecConfig("mtp", k)).to_json(),
        counters="server-wide" if m.run.others_counted else "per-request",
        memory=memory,
    )


def _running(
    opts: ValidateOptions, url: str, label: str, texts: Sequence[str], plan: list[PlannedSequence] | None
) -> tuple[_Measured, list[PlannedSequence]]:
    """Measure a server someone else runs (vLLM or SGLang, recognised by its routes), at every sampling setting."""
    server, info = connect(url, generate_timeout=opts.request_timeout, api_key=engine_api_key(opts.api_key_file))
    log.info("%s: %s serving %s", info.url, info.display, ", ".join(info.models))
    model = resolve_model(info, opts.served_model)
    if plan is None:
        plan = _plan(opts, _server_prompts(server, model, texts))
    ms = _measure_all(opts, server, info, model, plan)
    args = server.server_args()
    engine_info = _engine_info(opts, info, model, ms, args, label, info.speculative, max(opts.k_values))
    return _Measured(label, model, engine_info, ms, _draft_notes(info, model)), plan


def _draft_notes(info: ServerInfo, model: str) -> tuple[str, ...]:
    """A server that names a draft model other than the one it serves drafts with that model, not (necessarily)
    with the served checkpoint's own MTP: the numbers are that drafter's."""
    draft = info.speculative.draft_model if info.speculative else None
    if draft is None or draft in (model, info.model_path):
        return ()
    return (f"{info.url} drafts with {draft} (its draft model), not necessarily with the MTP of {model}",)


def _started(
    opts: ValidateOptions,
    checkpoint: str,
    ckpt: Checkpoint,
    label: str,
    k: int,
    plan: list[PlannedSequence],
    logs: Path,
    machine: Machine,
) -> _Measured:
    """Start the engine for ``checkpoint`` (``ckpt``: its header table, as preflight opened it) with ``k`` MTP drafts
    (and the rule), its memory sized for validate, measure every sampling setting, stop."""
    import os

    engine = opts.engine
    python = opts.engine_python
    assert engine is not None and python is not None
    cpu = machine.device == "cpu"
    memory = plan_engine_memory(
        engine,
        ckpt.spec,
        ckpt.total_bytes,
        max_len=max([opts.max_len, *(len(s.prompt) + s.new_tokens for s in plan)]),
        k=k,
        machine=machine,
        tensor_parallel_size=opts.tensor_parallel_size,
        user_args=opts.engine_args,
        user_env=(*os.environ, *opts.env),
        sequences=opts.concurrency,
    )
    port = free_port()
    args = server_args(
        engine,
        checkpoint,
        port,
        k=k,
        tensor_parallel_size=opts.tensor_parallel_size,
        text_only=ckpt.spec.family.has_vision,
        cpu=cpu,
        memory=memory.args(),
        extra=opts.engine_args,
        speculative=rule(opts.rule).vllm_config,
    )
    log_path = logs / f"{engine}-{label}-k{k}.log"
    with EngineProcess(
        engine, python, args, log_path, port=port, startup_timeout=opts.startup_timeout, env=opts.env
    ) as process:
        client = client_for(engine, process.url, generate_timeout=opts.request_timeout)
        info = client.info()
        model = resolve_model(info, opts.served_model or checkpoint)
        ms = _measure_all(opts, client, info, model, plan)
        if ms[0].k != k:
            raise EngineAnswerError(
                f"{process.url}: drafted {ms[0].k} tokens per step, started with {k} (log: {log_path})"
            )
        engine_info = _engine_info(opts, info, model, ms, args, label, info.speculative, k, memory.describe())
        return _Measured(label, checkpoint, engine_info, ms)


def _by_context(m: EngineMeasurement, plan: Sequence[PlannedSequence], edges: Sequence[int], k: int) -> tuple[
    ContextBucket, ...
]:  # fmt: skip
    """Per context bucket: the sum of the groups that filled it (a group never mixes buckets: ``_plan``)."""
    buckets = [plan[g[0]].bucket for g in m.groups]
    u = m.units
    out = []
    for b, (low, high) in enumerate(zip((0, *edges[:-1]), edges)):
        mine = [i for i, gb in enumerate(buckets) if gb == b]
        out.append(
            ContextBucket(
                low,
                high,
                round(sum(u.steps[i] for i in mine)),
                sum(u.accepted[i] for i in mine),
                tuple(round(sum(u.drafted_per_position[i][j] for i in mine)) for j in range(k)),
                tuple(sum(u.accepted_per_position[i][j] for i in mine) for j in range(k)),
            )
        )
    return tuple(out)


def _acceptance(
    opts: ValidateOptions, measured: Sequence[_Measured], index: int, plan: Sequence[PlannedSequence]
) -> Acceptance:
    """The acceptance at sampling setting ``index`` over the servers of one side (one per k), with AL's interval over
    the request groups; per context bucket when the prompts were planned into buckets."""
    rows = []
    for x in sorted(measured, key=lambda x: x.engine.k):
        m = x.measurements[index]
        interval = Bootstrap(m.units.units, level=opts.confidence).al(m.units)
        context = _by_context(m, plan, opts.context_buckets, x.engine.k) if opts.context_buckets else ()
        rows.append(AcceptanceRow.of(x.engine.k, m.stats, m.units, interval, context))
    return Acceptance(tuple(rows), None, measured[0].measurements[index].sampling, opts.rule)


def _side(
    opts: ValidateOptions,
    label_checkpoint: str,
    family: str,
    measured: Sequence[_Measured],
    plan: Sequence[PlannedSequence],
) -> Side:
    first = measured[0]
    generated = sum(c.generated for c in first.measurement.completions)
    prompt_tokens = sum(len(c.prompt) for c in first.measurement.completions)
    by_sampling = tuple(_acceptance(opts, measured, i, plan) for i in range(len(first.measurements)))
    return Side(
        checkpoint=public_checkpoint(label_checkpoint),  # one path style in the report: a directory by its name
        family=family,
        precision={},
        target_source=f"engine {engine_display(first.engine.name)} {first.engine.version} at "
        f"{first.engine.url}",
        sequences=len(plan),
        tokens=prompt_tokens + generated,
        generated_tokens=generated,
        mtp=MtpInfo(present=True),
        acceptance=by_sampling[0],
        acceptance_by_sampling=by_sampling,
    )


def _family(checkpoint: str | Path | None, opened: Checkpoint | None) -> str:
    if opened is not None:
        return opened.spec.family.key
    if checkpoint is None:
        return ""
    try:
        return Checkpoint.open(checkpoint, strict=False).spec.family.key
    except Exception:  # a remote name, an unreadable path: the family is only a label here
        return ""


def _device_is_cpu(opts: ValidateOptions) -> bool:
    if opts.device == "cpu":
        return True
    from mtpquant.runtime.machine import resolve_device

    return resolve_device(opts.device) == "cpu"


def _compare(
    opts: ValidateOptions, opened: Opened, reference: Side, candidate: Side | None
) -> tuple[Predicted, list[str]]:
    """The built-in prediction on the same prompts and settings, beside what the engine measured, per side, setting
    and k (AL and per-position acceptance)."""
    from mtpquant.validate.builtin import validate_builtin

    builtin = validate_builtin(
        dataclasses.replace(
            opts, engine=None, server=None, candidate_server=None, compare_reference=False, report_dir=None
        ),
        opened,
    )
    compared: dict[str, tuple[PredictedRow, ...]] = {}
    notes = []
    for label, engine_side, predicted_side in (
        ("reference", reference, builtin.reference),
        ("candidate", candidate, builtin.candidate),
    ):
        if engine_side is None or predicted_side is None or not predicted_side.acceptance_by_sampling:
            continue
        rows: list[PredictedRow] = []
        for measured, predicted_acc in zip(engine_side.acceptance_by_sampling, predicted_side.acceptance_by_sampling):
            predicted = {r.k: r for r in predicted_acc.by_k}
            for r in measured.by_k:
                p = predicted.get(r.k)
                if p is None:
                    continue
                rows.append(PredictedRow.of(measured.sampling, engine=r, predicted=p))
        compared[label] = tuple(rows)
        worst = max((abs(x.difference) for x in rows), default=0.0)
        worst_pos = max(
            (abs(a - b) for x in rows for a, b in zip(x.engine_per_position, x.predicted_per_position)),
            default=0.0,
        )
        notes.append(
            f"{label}: the engine's AL differs from the built-in prediction by at most {worst:.3f}, its per-position "
            f"acceptance by at most {worst_pos:.3f}"
        )
    method = f"built-in prediction (transformers, dequantized weights, rule {opts.rule}) on the same prompts"
    return Predicted(method, compared.get("reference"), compared.get("candidate")), notes


@contextlib.contextmanager
def server_logs(opts: ValidateOptions) -> Iterator[Path | None]:
    """The directory the servers ``--engine`` starts write their logs into (None without ``--engine``): a temporary
    one, removed when the run ends well (``write_report`` has put the logs into the report's ``logs/`` by then);
    when the run fails or is interrupted it is kept, and said where (an engine's error names its log)."""
    if opts.engine is None:
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix=f"mtpquant-{opts.engine}-logs-"))
    try:
        yield path
    except BaseException:
        if next(path.iterdir(), None) is None:
            shutil.rmtree(path, ignore_errors=True)
        else:
            log.warning("the engine's server logs are kept in %s (the run did not finish)", path)
        raise
    shutil.rmtree(path, ignore_errors=True)


def validate_engine(opts: ValidateOptions, opened: Opened, logs: Path | None = None) -> Measured:
    """The engine path of ``validate`` (see the module docstring): what the engine(s) measured (``opened``: what
    ``preflight(opts)`` opened and checked); the servers ``--engine`` starts write their logs into ``logs``
    (``server_logs``)."""
    t_start = time.perf_counter()
    assert opened.prompts is not None, "the engine path measures prompts, not a hidden-state file"
    texts, prompts_desc = opened.prompts
    plan: list[PlannedSequence] | None = None
    if opened.tokenizer is not None:  # the prompts as the built-in path makes them: the local checkpoint's tokenizer
        plan = _plan(opts, tokenize_prompts(opened.tokenizer, texts))
    notes = [ENGINE_NOTE]
    measured: dict[str, list[_Measured]] = {"reference": [], "candidate": []}
    checkpoints: dict[str, str] = {}
    if opts.server is not None:
        for label, url in (("reference", opts.server), ("candidate", opts.candidate_server)):
            if url is None:
                continue
            m, plan = _running(opts, url, label, texts, plan)
            measured[label].append(m)
            checkpoints[label] = str(opts.reference if label == "reference" and opts.reference else m.checkpoint)
    else:
        assert opts.reference is not None and plan is not None
        assert logs is not None, "--engine needs a directory for the servers' logs (server_logs)"
        cpu = _device_is_cpu(opts)
        cpu_note = engine_row(opts.engine).adapter.cpu_sampling_note() if opts.engine is not None else None
        if cpu and cpu_note is not None and any(not x.greedy for x in opts.sampling_settings):
            notes.append(cpu_note)
        machine = probe_machine(cpu)
        for label, name, opened_ckpt in (
            ("reference", opts.reference, opened.reference),
            ("candidate", opts.candidate, opened.candidate),
        ):
            if name is None:
                continue
            assert opened_ckpt is not None  # preflight opens what --engine serves
            checkpoints[label] = str(name)
            for k in opts.k_values:
                measured[label].append(_started(opts, str(name), opened_ckpt, label, k, plan, logs, machine))
    assert plan is not None
    if measured["candidate"] and opts.server is not None:
        ref_k, cand_k = (measured[side][0].engine.k for side in ("reference", "candidate"))
        if ref_k != cand_k:  # AL grows with k: the two sides would not be comparable
            raise ValidateError(
                f"{opts.server} drafts k={ref_k} per step and {opts.candidate_server} k={cand_k}: start both "
                "servers with the same number of draft tokens"
            )
    every = [x for side in measured.values() for x in side]
    for name in sorted({m.engine.name for m in every}):
        notes.append(engine_row(name).counter_note)
    for note in dict.fromkeys(n for m in every for n in m.notes):
        notes.append(note)
    for m in every:
        if m.engine.other_requests:
            counted = "the counters include them" if m.measurement.run.others_counted else "not counted in"
            notes.append(
                f"{m.engine.other_requests} other request(s) finished on {m.engine.url} during the measurement "
                f"(k={m.engine.k}); {counted}"
            )
    ref_family = _family(opts.reference, opened.reference)
    reference = _side(opts, checkpoints["reference"], ref_family, measured["reference"], plan)
    candidate = None
    comparison = None
    extra: list[tuple[str, Acceptance, Acceptance, Acceptance | None]] = []
    if measured["candidate"]:
        cand_family = _family(opts.candidate, opened.candidate)
        candidate = _side(opts, checkpoints["candidate"], cand_family, measured["candidate"], plan)
        extra = [
            (r.sampling.label, r, c, None)
            for r, c in list(zip(reference.acceptance_by_sampling, candidate.acceptance_by_sampling))[1:]
        ]
        assert reference.acceptance is not None and candidate.acceptance is not None
        ref_al = {r.k: r.mean_acceptance_length for r in reference.acceptance.by_k}
        comparison = Comparison(
            al_delta_by_k=tuple(
                r.mean_acceptance_length - ref_al[r.k] for r in candidate.acceptance.by_k if r.k in ref_al
            )
        )
    predicted = None
    if opts.compare_reference:
        predicted, compare_notes = _compare(opts, opened, reference, candidate)
        notes += compare_notes
    ks = sorted({m.engine.k for side in measured.values() for m in side})
    how = report_settings(
        opts,
        k=max(ks),
        num_prompts=len(plan),
        max_len=opts.max_len,
        prompts=prompts_desc,
        device="engine",
        dtype="as served",
        activations="as served",
    )
    return Measured(
        settings=how,
        reference=reference,
        candidate=candidate,
        comparison=comparison,
        notes=tuple(notes),
        timing={"total_s": time.perf_counter() - t_start},
        engine=tuple(m.engine for side in measured.values() for m in side),
        predicted=predicted,
        extra=extra,
    )
