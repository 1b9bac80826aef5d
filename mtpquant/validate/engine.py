"""``validate`` through the engines users deploy: a running vLLM or SGLang server (``--server``, recognised by
its routes), or one started here (``--engine vllm|sglang``), measured by the engine's own speculative counters.

The prompts and lengths are the built-in path's (the default held-out prompts, or ``--prompts``; tokenized with
the checkpoint's ``tokenizer.json``, or by the server's ``/tokenize`` when only a URL is given; the first
``min(len, max_len / 2)`` tokens, then ``max_len`` minus that many generated with ``ignore_eos``) and so are the
sampling settings (greedy). vLLM's counters are server-wide, read before and after and subtracted (traffic from
other clients meanwhile is counted in and reported); SGLang's come with each request (exactly these requests)
and must describe the k-step MTP chain (NEXTN, topk 1): a tree is refused. ``--candidate-server`` pairs work
across engines. With ``--engine`` one server is started per k (the number of drafts is fixed per server) on
127.0.0.1, its memory sized for what validate sends (``engine/sizing.py``), its log written into the report
directory, and stopped afterwards (also on Ctrl-C or an error). ``--compare-reference`` also runs the built-in
prediction on the same prompts and reports both, with the difference per k.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtpquant import __version__
from mtpquant.engine.connect import client_for, connect
from mtpquant.engine.http import engine_api_key
from mtpquant.engine.launch import EngineProcess, free_port, sglang_args, vllm_args
from mtpquant.engine.sampling import GREEDY
from mtpquant.engine.server import ENGINE_NAMES, EngineServer, ServerInfo, SpecConfig, resolve_model
from mtpquant.engine.sizing import Machine, plan_engine_memory, probe_machine
from mtpquant.errors import EngineAnswerError
from mtpquant.public import public_args
from mtpquant.validate.measure import EngineMeasurement, measure
from mtpquant.validate.options import ValidateError, ValidateOptions
from mtpquant.validate.prompts import default_prompts, load_prompts, prompt_length, tokenize_prompts
from mtpquant.validate.schema import (
    Acceptance,
    AcceptanceRow,
    Comparison,
    EngineInfo,
    MtpInfo,
    Report,
    Settings,
    Side,
    ValidationReport,
)

__all__ = ["SAMPLING", "validate_engine"]

log = logging.getLogger(__name__)

SAMPLING = GREEDY  # until validate takes sampling settings (#26): what every engine request is sent with
GREEDY_NOTE = "Greedy only (temperature 0, ignore_eos): the same prompts and lengths as the built-in path."
COUNTER_NOTES = {
    "vllm": "vLLM's speculative-decoding counters are server-wide: its numbers are the difference of two snapshots.",
    "sglang": (
        "SGLang's speculative counters come with each request (meta_info: spec_verify_ct, "
        "spec_correct_drafts_histogram, ...): its numbers cover exactly these requests."
    ),
}


@dataclasses.dataclass(frozen=True)
class _Measured:
    """One side measured at one k: the engine's numbers and the server that gave them."""

    label: str
    checkpoint: str
    engine: EngineInfo
    measurement: EngineMeasurement
    notes: tuple[str, ...] = ()


def _prompts(opts: ValidateOptions) -> tuple[list[str], str]:
    if opts.prompts_file is not None:
        return load_prompts(opts.prompts_file, opts.num_prompts), str(opts.prompts_file)
    return default_prompts(
        opts.num_prompts
    ), "default: held-out pydoc topics and stdlib source (mtpquant.validate.prompts)"


def _token_prompts(
    opts: ValidateOptions, texts: Sequence[str], client: EngineServer | None, model: str | None
) -> list[list[int]]:
    """Token ids as the built-in path makes them: the local checkpoint's tokenizer, else the server's."""
    if opts.reference is not None:
        from mtpquant.checkpoint.source import open_source

        return tokenize_prompts(open_source(opts.reference), texts)
    assert client is not None and model is not None
    try:
        ids = [client.tokenize(model, t) for t in texts]
    except EngineAnswerError as exc:
        raise EngineAnswerError(
            f"{exc} (give the served checkpoint as CHECKPOINT: its tokenizer makes the prompts)"
        ) from None
    return [row for row in ids if len(row) >= 2]


def _lengths(ids: Sequence[Sequence[int]], max_len: int) -> tuple[list[list[int]], list[int]]:
    prompts, new = [], []
    for row in ids:
        p = prompt_length(len(row), max_len)
        prompts.append(list(row[:p]))
        new.append(max_len - p)
    return prompts, new


def _engine_info(
    info: ServerInfo,
    model: str,
    m: EngineMeasurement,
    args: Sequence[str],
    label: str,
    spec: SpecConfig | None,
    requested_k: int,
) -> EngineInfo:
    """``requested_k``: the k to report when the server counted no draft positions (a vLLM without per-position
    counters)."""
    k = m.k or requested_k
    return EngineInfo(
        name=info.engine,
        version=info.version,
        url=info.url,
        model=model,
        k=k,
        k_source="server" if m.k else "--k",
        sampling=SAMPLING.to_json(),
        server_args=public_args(args),  # the report goes public with OUT: no key, paths by base name
        other_requests=m.other_requests,
        side=label,
        speculative=(spec or SpecConfig("mtp", k)).to_json(),
        counters="server-wide" if m.run.others_counted else "per-request",
    )


def _running(
    opts: ValidateOptions, url: str, label: str, texts: Sequence[str], ids: list[list[int]] | None
) -> tuple[_Measured, list[list[int]]]:
    """Measure a server someone else runs (vLLM or SGLang, recognised by its routes)."""
    server, info = connect(url, generate_timeout=opts.request_timeout, api_key=engine_api_key(opts.api_key_file))
    log.info("%s: %s serving %s", info.url, info.display, ", ".join(info.models))
    model = resolve_model(info, opts.served_model)
    if ids is None:
        ids = _token_prompts(opts, texts, server, model)
    prompts, new = _lengths(ids, opts.max_len)
    m = measure(server, info, model, prompts, new, SAMPLING)
    args = server.server_args()
    engine_info = _engine_info(info, model, m, args, label, info.speculative, max(opts.k_values))
    return _Measured(label, model, engine_info, m, _draft_notes(info, model)), ids


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
    label: str,
    k: int,
    ids: list[list[int]],
    logs: Path,
    machine: Machine,
) -> _Measured:
    """Start the engine for ``checkpoint`` with ``k`` MTP drafts, its memory sized for validate, measure, stop."""
    import os

    from mtpquant.checkpoint.table import Checkpoint

    engine = opts.engine
    python = opts.engine_python
    assert engine is not None and python is not None
    ckpt = Checkpoint.open(checkpoint)
    cpu = machine.device == "cpu"
    memory = plan_engine_memory(
        engine,
        ckpt.spec,
        ckpt.total_bytes,
        max_len=opts.max_len,
        k=k,
        machine=machine,
        tensor_parallel_size=opts.tensor_parallel_size,
        user_args=opts.engine_args,
        user_env=(*os.environ, *opts.env),
    )
    port = free_port()
    tp, extra = opts.tensor_parallel_size, opts.engine_args
    if engine == "sglang":
        args = sglang_args(checkpoint, port, k=k, tensor_parallel_size=tp, cpu=cpu, memory=memory.args(), extra=extra)
    else:
        text_only = ckpt.spec.family.has_vision
        args = vllm_args(
            checkpoint,
            port,
            k=k,
            tensor_parallel_size=tp,
            text_only=text_only,
            cpu=cpu,
            memory=memory.args(),
            extra=extra,
        )
    log_path = logs / f"{engine}-{label}-k{k}.log"
    with EngineProcess(
        engine, python, args, log_path, port=port, startup_timeout=opts.startup_timeout, env=opts.env
    ) as process:
        client = client_for(engine, process.url, generate_timeout=opts.request_timeout)
        info = client.info()
        model = resolve_model(info, opts.served_model or checkpoint)
        prompts, new = _lengths(ids, opts.max_len)
        m = measure(client, info, model, prompts, new, SAMPLING)
        if m.k != k:
            raise EngineAnswerError(f"{process.url}: drafted {m.k} tokens per step, started with {k} (log: {log_path})")
        engine_info = _engine_info(info, model, m, args, label, info.speculative, k)
        return _Measured(label, checkpoint, engine_info, m, (memory.describe(),))


def _side(label_checkpoint: str, family: str, measured: Sequence[_Measured], ids: Sequence[Sequence[int]]) -> Side:
    rows = tuple(AcceptanceRow.of(x.engine.k, x.measurement.stats) for x in sorted(measured, key=lambda x: x.engine.k))
    first = measured[0]
    generated = sum(len(c.tokens) for c in first.measurement.completions)
    prompt_tokens = sum(len(c.prompt) for c in first.measurement.completions)
    return Side(
        checkpoint=label_checkpoint,
        family=family,
        precision={},
        target_source=f"engine {ENGINE_NAMES.get(first.engine.name, first.engine.name)} {first.engine.version} at "
        f"{first.engine.url}",
        sequences=len(ids),
        tokens=prompt_tokens + generated,
        generated_tokens=generated,
        mtp=MtpInfo(present=True),
        acceptance=Acceptance(rows, None),
    )


def _family(checkpoint: str | Path | None) -> str:
    if checkpoint is None:
        return ""
    try:
        from mtpquant.checkpoint.table import Checkpoint

        return Checkpoint.open(checkpoint, strict=False).spec.family.key
    except Exception:  # a remote name, an unreadable path: the family is only a label here
        return ""


def _device_is_cpu(opts: ValidateOptions) -> bool:
    if opts.device == "cpu":
        return True
    from mtpquant.validate.weights import resolve_device

    return resolve_device(opts.device).type == "cpu"


def _compare(opts: ValidateOptions, report: Report) -> tuple[dict[str, Any], list[str]]:
    """The built-in prediction on the same prompts, beside what the engine measured, per side and k."""
    from mtpquant.validate.builtin import validate_builtin

    builtin = validate_builtin(
        dataclasses.replace(
            opts, engine=None, server=None, candidate_server=None, compare_reference=False, report_dir=None
        )
    ).report
    out: dict[str, Any] = {"method": "built-in replay (transformers, dequantized weights) on the same prompts"}
    notes = []
    for label, engine_side, predicted_side in (
        ("reference", report.reference, builtin.reference),
        ("candidate", report.candidate, builtin.candidate),
    ):
        if engine_side is None or predicted_side is None or predicted_side.acceptance is None:
            continue
        predicted = {r.k: r for r in predicted_side.acceptance.by_k}
        rows = []
        assert engine_side.acceptance is not None
        for r in engine_side.acceptance.by_k:
            p = predicted.get(r.k)
            if p is None:
                continue
            rows.append(
                {
                    "k": r.k,
                    "predicted_al": p.mean_acceptance_length,
                    "engine_al": r.mean_acceptance_length,
                    "difference": r.mean_acceptance_length - p.mean_acceptance_length,
                    "predicted_acceptance_rate": p.acceptance_rate,
                    "engine_acceptance_rate": r.acceptance_rate,
                }
            )
        out[label] = rows
        worst = max((abs(x["difference"]) for x in rows), default=0.0)
        notes.append(f"{label}: the engine's AL differs from the built-in prediction by at most {worst:.3f}")
    return out, notes


def validate_engine(opts: ValidateOptions) -> ValidationReport:
    """The engine path of ``validate`` (see the module docstring); writes the report directory when given."""
    from mtpquant.validate.verdict import verdict

    opts.check()
    t_start = time.perf_counter()
    texts, prompts_desc = _prompts(opts)
    notes = [GREEDY_NOTE]
    measured: dict[str, list[_Measured]] = {"reference": [], "candidate": []}
    checkpoints: dict[str, str] = {}
    ids: list[list[int]] | None = None
    if opts.server is not None:
        for label, url in (("reference", opts.server), ("candidate", opts.candidate_server)):
            if url is None:
                continue
            m, ids = _running(opts, url, label, texts, ids)
            measured[label].append(m)
            checkpoints[label] = str(opts.reference if label == "reference" and opts.reference else m.checkpoint)
    else:
        assert opts.reference is not None
        ids = _token_prompts(opts, texts, None, None)
        logs = (
            Path(opts.report_dir)
            if opts.report_dir is not None
            else Path(tempfile.mkdtemp(prefix=f"mtpquant-{opts.engine}-"))
        )
        machine = probe_machine(_device_is_cpu(opts))
        for label, ckpt in (("reference", opts.reference), ("candidate", opts.candidate)):
            if ckpt is None:
                continue
            checkpoints[label] = str(ckpt)
            for k in opts.k_values:
                measured[label].append(_started(opts, str(ckpt), label, k, ids, logs, machine))
    if not ids:
        raise ValidateError("no prompt has at least 2 tokens")
    if measured["candidate"] and opts.server is not None:
        ref_k, cand_k = (measured[side][0].engine.k for side in ("reference", "candidate"))
        if ref_k != cand_k:  # AL grows with k: the two sides would not be comparable
            raise ValidateError(
                f"{opts.server} drafts k={ref_k} per step and {opts.candidate_server} k={cand_k}: start both "
                "servers with the same number of draft tokens"
            )
    every = [x for side in measured.values() for x in side]
    for name in sorted({m.engine.name for m in every}):
        notes.append(COUNTER_NOTES[name])
    for note in dict.fromkeys(n for m in every for n in m.notes):
        notes.append(note)
    for m in every:
        if m.engine.other_requests:
            counted = "the counters include them" if m.measurement.run.others_counted else "not counted in"
            notes.append(
                f"{m.engine.other_requests} other request(s) finished on {m.engine.url} during the measurement "
                f"(k={m.engine.k}); {counted}"
            )
    reference = _side(checkpoints["reference"], _family(opts.reference), measured["reference"], ids)
    candidate = None
    comparison = None
    if measured["candidate"]:
        candidate = _side(checkpoints["candidate"], _family(opts.candidate), measured["candidate"], ids)
        assert reference.acceptance is not None and candidate.acceptance is not None
        ref_al = {r.k: r.mean_acceptance_length for r in reference.acceptance.by_k}
        comparison = Comparison(
            al_delta_by_k=tuple(
                r.mean_acceptance_length - ref_al[r.k] for r in candidate.acceptance.by_k if r.k in ref_al
            )
        )
    ks = sorted({m.engine.k for side in measured.values() for m in side})
    report = Report(
        mtpquant_version=__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        mode="pair" if candidate is not None else "single",
        settings=Settings(
            k=max(ks),
            num_prompts=len(ids),
            max_len=opts.max_len,
            prompts=prompts_desc,
            device="engine",
            dtype="as served",
            activations="as served",
            hidden_file=None,
            warn_al_drop=opts.warn_al_drop,
            broken_al=opts.broken_al,
        ),
        reference=reference,
        verdict=verdict(opts, reference, candidate),
        candidate=candidate,
        comparison=comparison,
        notes=tuple(notes),
        engine=tuple(m.engine for side in measured.values() for m in side),
    )
    if opts.compare_reference:
        predicted, compare_notes = _compare(opts, report)
        report = dataclasses.replace(report, predicted=predicted, notes=(*report.notes, *compare_notes))
    total = time.perf_counter() - t_start
    report = dataclasses.replace(report, timing={"total_s": round(total, 3)})
    result = ValidationReport(report)
    if opts.report_dir is not None:
        from mtpquant.validate.report import write_report

        write_report(result, opts.report_dir)
    log.info("validate (engine): %s (%s)", report.verdict.status, "; ".join(report.verdict.reasons))
    return result
