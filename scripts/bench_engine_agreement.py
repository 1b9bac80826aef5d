"""validate's default built-in prediction against the real vLLM CPU engine, per k and draft position (issue 43).

For the trained tiny Qwen3.5 (``mtpquant/assets/tiny-qwen3_5-mtp``: the BF16 source) and its ``convert --keep-mtp``
and ``--mtp quantize`` outputs (NVFP4 W4A4 main model; the quantize output's MTP NVFP4 W4A4 too), on N held-out
prompts (validate's default prompts and lengths: 128-token sequences, the prompt at most half), greedy, k = 1 and 3:

- **engine**: vLLM 0.32 CPU's own counters (``validate --engine vllm``: one server per checkpoint and k, mtpquant's
  launcher, ``--concurrency 8``), AL and per-position acceptance;
- **prediction**: validate's built-in replay with its **default** settings (``--compare-reference``: the same
  prompts; activations emulated; the last steps counted as vLLM counts them);
- **old default**: the built-in replay as validate ran it before issue 43 (``--activations off`` and the last steps
  drafting only the tokens left to verify), for the record of what the bias was.

Options: ``--sampled`` adds T = 0.8 at k = 2 (one more server per checkpoint); ``--glm`` adds the trained tiny
GLM-4.5-layout model (source, and its keep / quantize converts with the routed experts left BF16: vLLM's CPU build
has no NVFP4 MoE kernel). ``--write`` replaces this benchmark's section of docs/BENCHMARKS.md. Engine runs are
heavy: run them under ``flock /tmp/mtpquant-heavy.lock``. The built-in predictions are deterministic CPU work with no
server: ``--predict-only`` computes them first (kept in ``--work``; a shared machine's lock then covers only the
servers), and the run reads them from there.

    .venv/bin/python scripts/bench_engine_agreement.py --work /tmp/agree --predict-only
    flock /tmp/mtpquant-heavy.lock .venv/bin/python scripts/bench_engine_agreement.py --work /tmp/agree --write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _benchlib import command_line, machine, machine_line, today, write_section

HEADING = "## validate's prediction against vLLM CPU, per draft position (issue 43)"
CPU_MOE = 'quantization.exclude=["*mlp.experts*"]'  # vLLM's CPU build has no NVFP4 MoE kernel


@contextmanager
def old_accounting() -> Iterator[None]:
    """validate's built-in replay as it was before issue 43: no lookahead past max_tokens (the last steps draft only
    the tokens left to verify)."""
    import mtpquant.validate.builtin as builtin

    original = builtin.capture

    def capture(*args: Any, **kwargs: Any) -> Any:
        kwargs["lookahead"] = 0
        return original(*args, **kwargs)

    builtin.capture = capture
    try:
        yield
    finally:
        builtin.capture = original


def checkpoints(work: Path, glm: bool) -> dict[str, Path]:
    """The served checkpoints by label, converted into ``work`` once."""
    from mtpquant.convert.run import ConvertOptions, convert
    from mtpquant.synth.train import TINY_MTP_ASSETS

    out: dict[str, Path] = {}
    families = [("qwen3_5", "Qwen3.5", ())] + ([("glm4_moe", "GLM-4.5 layout", (CPU_MOE,))] if glm else [])
    for family, name, overrides in families:
        asset = TINY_MTP_ASSETS[family]
        out[f"{name} source (BF16)"] = asset
        for mode in ("keep", "quantize"):
            path = work / f"{family}-{mode}"
            if not (path / "config.json").exists():
                convert(ConvertOptions(src=str(asset), out=path, mtp=mode, calib_samples=16, calib_seq_len=128,
                                       device="cpu", progress=False, overrides=overrides))  # fmt: skip
            out[f"{name} {mode}" + (", experts BF16" if overrides else "")] = path
    return out


def _per_k(acceptance: Any) -> dict[int, dict[str, Any]]:
    """One acceptance's rows by k: AL, acceptance rate, per-position acceptance and steps."""
    return {
        r.k: {
            "al": r.mean_acceptance_length,
            "rate": r.acceptance_rate,
            "per_position": list(r.acceptance_per_position),
            "steps": r.num_steps,
        }
        for r in acceptance.by_k
    }


def _cached(cache: Path, compute: Callable[[], dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """``compute()``'s rows, kept in ``cache`` (JSON) so that a rerun, or the engine half of a run split with
    ``--predict-only``, reads them instead of recomputing them (the prediction is deterministic)."""
    if cache.exists():
        return {int(k): v for k, v in json.loads(cache.read_text()).items()}
    rows = compute()
    cache.write_text(json.dumps(rows, indent=1))
    return rows


def predict(
    path: Path, prompts: int, ks: tuple[int, ...], temperature: float, cache: Path
) -> dict[int, dict[str, Any]]:
    """validate's built-in prediction with its **default** settings (what ``--compare-reference`` runs beside the
    engine: the same options, no engine), per k."""
    from mtpquant.api import ValidateOptions, validate

    def compute() -> dict[int, dict[str, Any]]:
        report = validate(ValidateOptions(path, num_prompts=prompts, ks=ks, device="cpu", temperatures=(temperature,),
                                          progress=False)).report  # fmt: skip
        assert report.settings.activations == "emulate" and report.reference.acceptance is not None
        return _per_k(report.reference.acceptance)

    return _cached(cache, compute)


def engine(
    path: Path, prompts: int, ks: tuple[int, ...], temperature: float
) -> tuple[dict[int, dict[str, Any]], str, float]:
    """validate --engine vllm (defaults otherwise): vLLM's own counters per k, the setting's label, the seconds."""
    from mtpquant.api import ValidateOptions, validate
    from tests.support.engine import CONCURRENCY, CPU_ENV
    from tests.support.vllm_env import vllm_python

    t0 = time.perf_counter()
    report = validate(ValidateOptions(path, num_prompts=prompts, ks=ks, device="cpu", engine="vllm",
                                      vllm_python=vllm_python(), env=CPU_ENV, concurrency=CONCURRENCY,
                                      temperatures=(temperature,), progress=False)).report  # fmt: skip
    assert report.reference.acceptance is not None and all(e.other_requests == 0 for e in report.engine)
    sampling = report.reference.acceptance.sampling
    label = sampling.label if sampling is not None else f"T={temperature:g}"
    return _per_k(report.reference.acceptance), label, time.perf_counter() - t0


def measure(path: Path, prompts: int, ks: tuple[int, ...], temperature: float, cache: Path) -> list[dict[str, Any]]:
    """The engine beside the prediction on the same prompts and settings: one row per k (``PredictedRow``'s keys).
    The engine's rows are kept in ``--work`` too (``engine-*.json``), so a run that adds settings or checkpoints
    (``--sampled``, ``--glm``) starts only the servers it has not run; delete them to measure again."""
    predicted = predict(path, prompts, ks, temperature, cache)
    kept = cache.with_name(cache.name.replace("predicted-", "engine-", 1))
    if kept.exists():
        data = json.loads(kept.read_text())
        measured, label, seconds = {int(k): v for k, v in data["by_k"].items()}, data["label"], data["seconds"]
    else:
        measured, label, seconds = engine(path, prompts, ks, temperature)
        kept.write_text(json.dumps({"by_k": measured, "label": label, "seconds": seconds}, indent=1))
    return [{"sampling": {"temperature": temperature}, "label": label, "k": k, "predicted_al": predicted[k]["al"],
             "engine_al": e["al"], "difference": e["al"] - predicted[k]["al"],
             "predicted_acceptance_rate": predicted[k]["rate"], "engine_acceptance_rate": e["rate"],
             "predicted_per_position": predicted[k]["per_position"], "engine_per_position": e["per_position"],
             "engine_steps": e["steps"], "seconds": seconds} for k, e in sorted(measured.items())]  # fmt: skip


def old_prediction(path: Path, prompts: int, ks: tuple[int, ...], cache: Path) -> dict[int, dict[str, Any]]:
    """The built-in prediction as validate made it by default before issue 43, per k."""
    from mtpquant.api import ValidateOptions, validate

    def compute() -> dict[int, dict[str, Any]]:
        with old_accounting():
            report = validate(ValidateOptions(path, num_prompts=prompts, ks=ks, device="cpu", activations="off",
                                              progress=False)).report  # fmt: skip
        assert report.reference.acceptance is not None
        return _per_k(report.reference.acceptance)

    return _cached(cache, compute)


CAUSE = [
    "**The cause of the old bias.** Two things, one per sign. (1) The old default left the W4A4 activations in full "
    "precision (`--activations off`) where vLLM quantizes them: the prediction read *above* vLLM on the keep and "
    "quantize outputs (issue 43: up to +0.105 at k = 3). (2) With activations emulated the prediction read *below* "
    "vLLM in every cell, most at k = 3 and on short sequences, on the BF16 source too: validate's replay let a "
    "request's last steps draft only the tokens left before `max_tokens`, while vLLM 0.32 schedules the full k "
    "drafts at every step (`v1/core/sched/scheduler.py`: it does not schedule partial drafts) and counts what "
    "verification accepts before the output is cut at `max_tokens` (`num_accepted = len(generated_token_ids) - 1`, "
    "counted before `_update_request_with_output` truncates). That is about one step's extra acceptances per "
    "request, so it shrinks with the sequence's length and vanishes at k = 1. The replay now drafts k at every step, "
    "verified by the target's own tokens past the request's end (a k - 1 token lookahead, "
    "`measure.replay.replay_greedy`). Ruled out on the same inputs: vLLM's NVFP4 activation quantize-dequantize "
    "(`ref_nvfp4_quant_dequant`, the CPU path of `EmulationNvFp4LinearKernel`) equals mtpquant's "
    "`quantize_activation_nvfp4` bit for bit on bf16 inputs (20 random 64 x 512 blocks with outliers; in float32 "
    "they differ by at most 6e-5, the order in which the two scales multiply), and convert's fused groups (q/k/v, "
    "gate/up, in_proj_qkv/z) carry one input scale, so vLLM's max over a fused group changes nothing; the compute "
    "dtype (the prediction in float32, vLLM in bf16) leaves the BF16 source's cells within noise (the table). "
    "`--check-emulation` reruns the emulation comparison.",
]


EMULATION_CHECK = """
import torch
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant
from mtpquant.formats.nvfp4 import quantize_activation_nvfp4

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    worst, differing, total = 0.0, 0, 0
    for _ in range(20):
        x = (torch.randn(64, 512) * torch.exp(torch.randn(64, 1))).to(dtype)
        x[:, ::37] *= 20  # outliers
        input_scale = torch.tensor(float(x.float().abs().max()) / (6 * 448), dtype=torch.float32)
        ours = quantize_activation_nvfp4(x, input_scale)
        theirs = ref_nvfp4_quant_dequant(x, (1.0 / input_scale).to(torch.float32), 16)
        d = (ours.float() - theirs.float()).abs()
        worst, differing, total = max(worst, float(d.max())), differing + int((d > 0).sum()), total + d.numel()
    print(f"{dtype}: max |mtpquant - vLLM| {worst:.3g}, {differing} of {total} elements differ")
"""


def check_emulation() -> str:
    """mtpquant's NVFP4 activation quantize-dequantize against vLLM's own (``ref_nvfp4_quant_dequant``, the CPU path
    of ``EmulationNvFp4LinearKernel``) on the same inputs, in the vLLM environment's python."""
    import os
    import subprocess

    from tests.support.vllm_env import vllm_python

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([str(vllm_python()), "-c", EMULATION_CHECK], env=env, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return out.strip()


def _pct(values: list[float]) -> str:
    return " / ".join(f"{100 * v:.1f}" for v in values)


def markdown(rows: list[dict[str, Any]], prompts: int, facts: dict[str, Any], seconds: float) -> str:
    greedy = [r for r in rows if r["sampling"]["temperature"] == 0]
    qwen = [r for r in greedy if r["which"].startswith("Qwen3.5")]
    diffs = [r["difference"] for r in qwen]
    old = [r["engine_al"] - r["old_al"] for r in qwen if r.get("old_al") is not None]
    lines = [
        HEADING,
        "",
        f"Command: `flock /tmp/mtpquant-heavy.lock {command_line('bench_engine_agreement.py')}` on {today()} "
        f"({seconds / 60:.1f} min; the engine runs, one validate per checkpoint and setting: "
        f"{sum({(r['which'], r['label']): r['seconds'] for r in rows}.values()) / 60:.1f} min); the built-in "
        "predictions that `--work` already held (from an earlier `--predict-only` run of the same script: no server, "
        "outside the lock) were read from there, the rest computed by this run.",
        "",
        machine_line(facts),
        "",
        f"{prompts} held-out prompts (validate's defaults: 128-token sequences, the prompt at most half), greedy "
        "unless stated; engine: vLLM 0.32.0 CPU (bf16, the project's engine environment, `validate --engine vllm "
        "--concurrency 8`, one server per checkpoint and k), its own counters; prediction: `validate`'s built-in "
        "replay with its **default** settings on the same prompts (`--compare-reference`); old default: the "
        "built-in replay as validate ran by default before issue 43 (`--activations off`, and the last steps drafting "
        "only the tokens left to verify). Difference = engine - prediction. Per position: acceptance % at each draft "
        "position (vLLM's `accepted_per_pos / drafts`).",
        "",
        "| checkpoint | setting | k | engine AL | prediction AL | difference | old default AL | engine - old "
        "| engine per position % | predicted per position % | engine steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in rows:
        old_al = r.get("old_al")
        old_cells = ("", "") if old_al is None else (f"{old_al:.3f}", f"{r['engine_al'] - old_al:+.3f}")
        lines.append(
            f"| {r['which']} | {r['label']} | {r['k']} | {r['engine_al']:.3f} | {r['predicted_al']:.3f} | "
            f"{r['difference']:+.3f} | {old_cells[0]} | {old_cells[1]} | {_pct(r['engine_per_position'])} | "
            f"{_pct(r['predicted_per_position'])} | {r['engine_steps']} |"
        )
    worst, mean = max(abs(d) for d in diffs), sum(diffs) / len(diffs)
    within = worst <= 0.05 and abs(mean) <= 0.02
    lines += [
        "",
        f"Tiny Qwen3.5, greedy, k = 1 and 3 ({len(diffs)} cells): largest |difference| "
        f"{worst:.3f}, mean signed difference {mean:+.3f}"
        + (f" (old default: largest {max(abs(d) for d in old):.3f}, mean {sum(old) / len(old):+.3f})" if old else "")
        + ". Issue 43's target (every cell within 0.05 AL, the mean signed difference within +-0.02): "
        + ("**met**." if within else "**not met**."),
        "",
        *CAUSE,
    ]
    src = {r["k"]: r for r in qwen if "source" in r["which"] and r.get("old_al") is not None}
    if 3 in src:
        s3 = src[3]
        lines += [
            "",
            f"On the BF16 source (nothing to quantize, so the old and new defaults differ only in the last "
            f"steps' accounting) vLLM's AL at k = 3 is {s3['engine_al']:.3f}: the old replay predicted "
            f"{s3['old_al']:.3f} ({s3['engine_al'] - s3['old_al']:+.3f}), the new one {s3['predicted_al']:.3f} "
            f"({s3['difference']:+.3f}).",
        ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="where the converts go (kept for reruns)")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--sampled", action="store_true", help="also T = 0.8 at k = 2")
    p.add_argument("--glm", action="store_true", help="also the GLM-4.5-layout tiny model")
    p.add_argument("--no-old", action="store_true", help="skip the old-default built-in runs")
    p.add_argument("--write", action="store_true", help="replace this section of docs/BENCHMARKS.md")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--from-json", type=Path, help="render (and --write) the rows a run wrote with --json; run nothing")
    p.add_argument("--seconds", type=float, default=0.0, help="with --from-json: that run's wall time")
    p.add_argument(
        "--predict-only",
        action="store_true",
        help="only compute (and keep in --work) the built-in predictions: no engine runs, no lock needed",
    )
    p.add_argument(
        "--check-emulation",
        action="store_true",
        help="only compare mtpquant's NVFP4 activation emulation with vLLM's on the same inputs",
    )
    args = p.parse_args()
    if args.check_emulation:
        print(check_emulation())
        return 0
    if args.from_json:
        text = markdown(json.loads(args.from_json.read_text()), args.prompts, machine(args.work), args.seconds)
        print(text)
        if args.write:
            write_section(HEADING, text)
        return 0
    t0 = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    settings = [((1, 3), 0.0)] + ([((2,), 0.8)] if args.sampled else [])
    for which, path in checkpoints(args.work, args.glm).items():
        tag = f"{path.name}-{args.prompts}"
        old = {} if args.no_old else old_prediction(path, args.prompts, (1, 3), args.work / f"old-{tag}.json")
        for ks, temperature in settings:
            cache = args.work / f"predicted-{tag}-k{'_'.join(map(str, ks))}-T{temperature:g}.json"
            if args.predict_only:
                predict(path, args.prompts, ks, temperature, cache)
                print(f"{which}: predicted {ks} at T = {temperature:g} ({cache})")
                continue
            for r in measure(path, args.prompts, ks, temperature, cache):
                old_al = old.get(r["k"], {}).get("al") if temperature == 0 else None
                rows.append({"which": which, **r, "old_al": old_al})
                print(json.dumps(rows[-1]), flush=True)
        if args.json and rows:
            args.json.write_text(json.dumps(rows, indent=1))
    if args.predict_only:
        return 0
    text = markdown(rows, args.prompts, machine(args.work), time.perf_counter() - t0)
    print(text)
    if args.write:
        write_section(HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
