#!/usr/bin/env python3
"""heal: (a) the default heal of the trained tiny model, CPU time and what it recovers; (b) the peak RSS of a heal of
the full-size random Qwen3.5-4B under ``--max-memory cpu=3GiB``.

    python scripts/bench_heal.py --work /root/bench-heal              # both; the 4B source is built if missing
    python scripts/bench_heal.py --work /root/bench-heal --skip-4b    # (a) only
    python scripts/bench_heal.py --work /root/bench-heal --skip-4b --family qwen4_exp   # (a) on Qwen3.8-Flash-Next

(a) converts the trained tiny model (``--family``: Qwen3.5, or Qwen3.8-Flash-Next, ``qwen4_exp``) (``--keep-mtp``:
BF16 MTP; ``--mtp quantize``: NVFP4 MTP; 16 x 128 calibration tokens) and heals each with the default schedule in a
fresh process: its CPU time (goal: about 2 CPU-minutes on this 2-core machine), wall time, peak RSS, and the
held-out AL per k before and after with the paired 95 % interval; beside them the BF16 source model's AL on the same
held-out prompts (its own target and MTP), so the table shows what quantization cost and what heal gives back (on
the tiny model more than it cost: its MTP is undertrained, and self-distillation on the target's own text improves
it beyond the source's). (b) converts the full-size Qwen3.5-4B skeleton with random-normal weights
(``scripts/make_skeleton_checkpoint.py --mtp-data normal``) with ``--keep-mtp`` under the cap, then heals it under
the same cap with a small schedule (the point is memory: the quantized target partly on disk, dequantized when each
layer runs) and ``--force`` (random weights cannot improve); goal: peak RSS <= cap + 2 GB.
(a) runs the ``mtpquant`` command as users run it (``python -m mtpquant heal ... --json``, the calling shell's
OpenMP settings removed: the CLI chooses its own); (b) calls the API (its schedule is smaller than the CLI's flags
allow) under the same settings the CLI chooses. Each part rewrites its own section of docs/BENCHMARKS.md with
``--write``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _benchlib import command_line, machine, machine_line, run_python, today, write_section  # noqa: E402

from mtpquant.units import format_bytes, parse_bytes  # noqa: E402

os.environ.setdefault("TQDM_DISABLE", "1")
# a user's shell: no OpenMP / MKL settings of the benchmark's own (the CLI, and (b)'s child, choose them)
for _name in [k for k in os.environ if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))]:
    del os.environ[_name]

_HEAL = """
import json, sys, time
from mtpquant.runtime.machine import tune_cpu_runtime
tune_cpu_runtime()
from pathlib import Path
from mtpquant.heal.options import HealOptions, HealSizes
from mtpquant.heal.run import heal
options = json.loads(sys.argv[1])
r = heal(HealOptions(**options | {"sizes": HealSizes(**options.get("sizes", {}))}))
print(json.dumps({
    "cpu_s": r.cpu_seconds, "timings": r.timings, "peak_rss": r.peak_rss_bytes, "action": r.action,
    "peak_rss_after": r.peak_rss_after,
    "data_bytes": r.data_bytes, "bytes_written": r.bytes_written,
    "check": [[c.k, c.before, c.after, c.low, c.high, c.better] for c in r.check.by_k],
    "kl": [r.training.first_loss, r.training.last_loss],
    "placement": r.plan.memory.to_json(),
}))
"""

_SOURCE_AL = """
import json, sys, torch
from mtpquant.heal.check import held_out_runs
from mtpquant.measure.drafter import load_mtp
from mtpquant.measure.target import load_target
from mtpquant.measure.weights import CheckpointWeights
from mtpquant.measure.replay import evaluate_acceptance
src, n, max_len, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
w = CheckpointWeights.open(src)
target = load_target(w, device=torch.device("cpu"), dtype=torch.float32)
run = held_out_runs(target, w.ckpt.source, int(w.shape(w.embed_name())[0]), n, max_len, batch_size=32,
                    progress=False)[0].run
bundle, _ = load_mtp(w)
print(json.dumps({"al": [u.mean_acceptance_length for u in evaluate_acceptance(bundle, run, k, progress=False).units]}))
"""


def _convert(src: Path, out: Path, args: list[str]) -> None:
    if out.exists():
        return
    cmd = [sys.executable, "-m", "mtpquant", "-q", "convert", str(src), str(out), "--device", "cpu", *args]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)


def _heal(options: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    run = run_python(["-c", _HEAL, json.dumps(options)])
    if run.returncode != 0 or not run.output:
        raise SystemExit(f"heal failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return {**run.output, "wall_s": time.perf_counter() - t0, "max_rss": run.max_rss}


def _heal_cli(quant: Path, source: Path, out: Path) -> dict[str, Any]:
    """``mtpquant heal QUANT --from SRC --out OUT --json``, the default schedule, in a fresh process."""
    t0 = time.perf_counter()
    run = run_python(["-m", "mtpquant", "-q", "heal", str(quant), "--from", str(source), "--out", str(out),
                      "--device", "cpu", "--json"])
    if run.returncode != 0 or not run.output:
        raise SystemExit(f"heal failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    r = run.output
    return {"cpu_s": r["cpu_seconds"], "timings": r["timings"], "wall_s": time.perf_counter() - t0,
            "max_rss": run.max_rss, "kl": [r["training"]["first_loss"], r["training"]["last_loss"]],
            "action": r["action"], "bytes_written": r["bytes_written"], "new_shards": r["new_shards"],
            "check": [[c["k"], c["before"], c["after"], c["low"], c["high"]] for c in r["record"]["by_k"]]}


def tiny(work: Path, family: str = "qwen3_5") -> str:
    """(a): the default heal of the family's trained tiny model (keep and quantize), with the source's AL beside it."""
    from mtpquant.synth.train import TINY_MTP_ASSETS

    asset = TINY_MTP_ASSETS[family]
    stem = "tiny" if family == "qwen3_5" else f"tiny-{family}"
    calib = ["--calib-samples", "16", "--calib-seq-len", "128"]
    rows = []
    src_al = _last_json(run_python(["-c", _SOURCE_AL, str(asset), "64", "128", "3"]))["al"]
    for mode, flag in (("keep", ["--keep-mtp"]), ("quantize", ["--mtp", "quantize"])):
        quant = work / f"{stem}-{mode}"
        _convert(asset, quant, [*flag, *calib])
        out = work / f"{stem}-{mode}-healed"
        if out.exists():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        rows.append((mode, _heal_cli(quant, asset, out)))
    lines = [
        "| MTP | k | BF16 source AL | quant AL (before) | healed AL | change [95 % interval] | verdict "
        "| healed - source |",
        "|---|---:|---:|---:|---:|---|---|---:|",
    ]
    for mode, r in rows:
        for k, before, after, low, high in r["check"]:
            src = src_al[k - 1]
            label = "BF16 (`--keep-mtp`)" if mode == "keep" else "NVFP4 (`--mtp quantize`)"
            lines.append(f"| {label} | {k} | {src:.3f} | {before:.3f} | {after:.3f} | {after - before:+.3f} "
                         f"[{low:+.3f}, {high:+.3f}] | {_verdict(low, high)} | {after - src:+.3f} |")
    lines += [
        "",
        "| MTP | heal's action (exit 0) | new shards | bytes written | CPU time | ratio to the 120 CPU-s goal | wall "
        "| peak RSS | KL start -> end | phases (wall s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, r in rows:
        phases = ", ".join(f"{k} {v:.0f}" for k, v in r["timings"].items() if k not in ("total", "plan"))
        lines.append(f"| {mode} | {r['action']} | {', '.join(r['new_shards'])} | {format_bytes(r['bytes_written'])} | "
                     f"{r['cpu_s']:.0f} s | {r['cpu_s'] / 120:.2f}x | {r['wall_s']:.0f} s | "
                     f"{format_bytes(r['max_rss'])} | {r['kl'][0]:.3f} -> {r['kl'][1]:.3f} | {phases} |")
    return "\n".join(lines)


def _verdict(low: float, high: float) -> str:
    """A k's verdict from its paired 95 % interval of the change: better / worse beyond noise when the interval lies
    wholly above / below zero, else no change (``records.evidence``'s rule)."""
    return "better" if low > 0 else "worse" if high < 0 else "no change"


def _last_json(run: Any) -> Any:
    if run.returncode != 0:
        raise SystemExit(f"failed: {run.stderr.strip()[-2000:]}")
    return run.output


def big(work: Path, cap: str) -> str:
    """(b): the full-size random Qwen3.5-4B, converted and healed under the cap."""
    src = work / "qwen35-4b-normal"
    if not src.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_skeleton_checkpoint.py"), "--layout",
                        "Qwen3.5-4B", "--out", str(src), "--mtp-data", "normal"], check=True)
    quant = work / "qwen35-4b-keep"
    _convert(src, quant, ["--keep-mtp", "--max-memory", f"cpu={cap}", "--calib-samples", "4", "--calib-seq-len", "64"])
    out = work / "qwen35-4b-healed"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    # bfloat16: in float32 accelerate's reserve for the largest layer (the 2.5 GB embedding / LM head) leaves the
    # embedding on disk under a 3 GiB cap, which heal refuses (exit 22)
    options = {"quant": str(quant), "source": str(src), "out": str(out), "device": "cpu", "max_memory": f"cpu={cap}",
               "dtype": "bfloat16",
               "samples": 2, "steps": 2, "check_prompts": 5, "force": True, "progress": False,
               "sizes": {"prompt_len": 16, "new_tokens": 8, "batch_size": 2, "check_len": 16, "batch_prompts": 8}}
    r = _heal(options)
    limit = (parse_bytes(cap) or 0) + 2_000_000_000
    placement = r["placement"]
    resident = ", ".join(f"{d} {format_bytes(n)}" for d, n in placement["resident"].items())
    return "\n".join([
        "| peak RSS | limit (cap + 2 GB) | ratio | wall | placement (plan) | hidden states | written |",
        "|---:|---:|---:|---:|---|---:|---:|",
        f"| {format_bytes(r['max_rss'])} | {format_bytes(limit)} | {r['max_rss'] / limit:.2f}x | {r['wall_s']:.0f} s | "
        f"{resident}, disk {format_bytes(placement['disk_bytes'])} | {format_bytes(r['data_bytes'])} | "
        f"{format_bytes(r['bytes_written'])} |",
        "",
        "peak RSS when each phase ended: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in r.get("peak_rss_after", {}).items()),
        "",
        "heal options: " + json.dumps({k: v for k, v in options.items() if k not in ("quant", "source", "out")}),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="directory for the sources and outputs")
    parser.add_argument("--cap", default="3GiB", help="(b)'s --max-memory cpu= cap (default 3GiB)")
    parser.add_argument("--skip-tiny", action="store_true")
    parser.add_argument("--skip-4b", action="store_true")
    parser.add_argument("--family", choices=("qwen3_5", "qwen4_exp"), default="qwen3_5",
                        help="(a)'s trained tiny model (default qwen3_5; qwen4_exp writes its own section)")
    parser.add_argument("--write", action="store_true", help="rewrite the sections of docs/BENCHMARKS.md")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    parts = []
    if not args.skip_tiny:
        heading = ("## heal: the default heal of the trained tiny model" if args.family == "qwen3_5"
                   else "## heal on Qwen3.8-Flash-Next (qwen4_exp): the default heal of its trained tiny model")
        parts.append((heading, tiny(args.work, args.family)))
    if not args.skip_4b:
        parts.append(("## heal under a memory cap: the full-size random Qwen3.5-4B", big(args.work, args.cap)))
    about = " ".join((__doc__ or "").split("\n\n")[2].split())
    for heading, body in parts:
        section = "\n".join([heading, "", f"`{command_line('bench_heal.py')}` on {today()}. {about}", "",
                             machine_line(machine(args.work)), "", body, ""])
        print(section)
        if args.write:
            write_section(heading, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
