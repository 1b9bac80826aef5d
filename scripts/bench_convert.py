"""Benchmark ``mtpquant convert`` on the tiny real-layout checkpoints of each family (CPU).

Each conversion runs in a fresh child process, so its peak RSS (``ru_maxrss``) belongs to that one
conversion; the child reports convert's own wall-time split (imports included in the first step
that needs them). With ``--write-doc`` the results replace this script's section of
docs/BENCHMARKS.md (other sections are left alone).

    .venv/bin/python scripts/bench_convert.py --write-doc
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _benchlib import BENCHMARKS as DOC
from _benchlib import machine as host_facts
from _benchlib import write_section

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## convert (tiny checkpoints, CPU)"
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def child(src: str, out: str, mode: str, samples: int, seq_len: int) -> None:
    """Run one conversion and print its result as JSON on the last line."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    os.environ["TQDM_DISABLE"] = "1"
    t0 = time.perf_counter()
    from mtpquant.convert.run import ConvertOptions, convert

    imports = time.perf_counter() - t0
    result = convert(
        ConvertOptions(
            src=src,
            out=Path(out),
            mtp=mode,
            calib_samples=samples,
            calib_seq_len=seq_len,
            device="cpu",
            progress=False,
        )
    )
    data = {
        "timings": result.timings,
        "import_s": imports,
        "peak_rss": result.peak_rss_bytes,
        "source_bytes": result.plan.source_bytes,
        "output_bytes": result.output_bytes,
        "mtp_tensors": result.mtp_tensors,
        "quantized": result.quantized_linears,
        "tokens": result.calibration_tokens,
    }
    print(json.dumps(data))


def machine() -> dict[str, Any]:
    """Facts about this machine (scripts/_benchlib.py) and the library versions."""
    import importlib.metadata as md

    m = host_facts()
    return {
        "cpu": m["cpu"],
        "cores": m["nproc"],
        "memory": f"{m['ram_gib']:.0f} GiB",
        "python": m["python"],
        "load": m["load"][0] if m["load"] else None,
        **{p: md.version(p) for p in ("torch", "transformers", "nvidia-modelopt")},
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from mtpquant.synth.tiny import make_tiny_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        for family in args.families.split(","):
            src = make_tiny_checkpoint(Path(tmp) / f"src-{family}", family)
            for mode in args.modes.split(","):
                out = Path(tmp) / f"out-{family}-{mode}"
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    str(src),
                    str(out),
                    mode,
                    str(args.calib_samples),
                    str(args.calib_seq_len),
                ]
                t0 = time.perf_counter()
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)}
                )
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr)
                    raise SystemExit(f"convert failed for {family} {mode}")
                data = json.loads(proc.stdout.strip().splitlines()[-1])
                data.update(family=family, mode=mode, wall=wall)
                rows.append(data)
                t = data["timings"]
                print(
                    f"{family:12s} {mode:9s} wall {wall:5.1f}s  load {t.get('load', 0):4.1f}  calibrate "
                    f"{t.get('calibrate', 0):4.1f}  export {t.get('export', 0):4.1f}  mtp {t.get('mtp', 0):4.2f}  "
                    f"peak RSS {data['peak_rss'] / 2**20:6.0f} MiB  model {data['source_bytes'] / 2**20:5.2f} MiB",
                    flush=True,
                )
    return rows


def markdown(rows: list[dict[str, Any]], facts: dict[str, Any], command: str, samples: int, seq_len: int) -> str:
    lines = [
        HEADING,
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {facts['cpu']}, {facts['cores']} cores available, {facts['memory']} RAM; Python {facts['python']}, "
        f"torch {facts['torch']}, transformers {facts['transformers']}, nvidia-modelopt {facts['nvidia-modelopt']}; "
        f"1-minute load average at start {facts['load']:.1f} (other jobs were running: wall times are noisy).",
        "",
        f"Each conversion runs in a fresh process (`--device cpu`, {samples} calibration rows x {seq_len} tokens of "
        "the offline text, 5GB shards). Columns are convert's own timings: `tokenize` includes importing "
        "transformers, `calibrate` importing modelopt and `mtq.quantize` with the forward loop, `export` "
        "`export_hf_checkpoint` into the scratch directory, `write` the output shards, configs and carried files, "
        "`mtp` the mode's MTP work (quantize mode: building the MTP layer and quantizing it; its calibration "
        "forward runs inside `calibrate`). Peak RSS is the child's `ru_maxrss`; most of it is the Python, torch, "
        "transformers and modelopt runtime, not the model.",
        "",
        "| family | MTP mode | process wall s | import s | tokenize s | load s | calibrate s | export s | write s | "
        "mtp s | verify s | peak RSS MiB | model MiB | output MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["timings"]
        lines.append(
            f"| {r['family']} | {r['mode']} | {r['wall']:.1f} | {r['import_s']:.1f} | {t.get('tokenize', 0):.1f} | "
            f"{t.get('load', 0):.2f} | {t.get('calibrate', 0):.1f} | {t.get('export', 0):.1f} | "
            f"{t.get('write', 0):.2f} | "
            f"{t.get('mtp', 0):.2f} | {t.get('verify', 0):.2f} | {r['peak_rss'] / 2**20:.0f} | "
            f"{r['source_bytes'] / 2**20:.2f} | {r['output_bytes'] / 2**20:.2f} |"
        )
    lines += [
        "",
        "What scales with the model: `load` and `export` with its bytes, `calibrate` with bytes x calibration "
        "tokens, `write` with the output bytes (one tensor in memory at a time), `mtp` with the MTP bytes. "
        "On CPU the peak memory of a real model is its BF16 size plus one quantized copy of the largest layer "
        "group during export; `--device cuda` uses accelerate's device_map with CPU/disk offload and modelopt's "
        "streaming export for models larger than memory.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        src, out, mode, samples, seq_len = sys.argv[2:7]
        child(src, out, mode, int(samples), int(seq_len))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--modes", default="keep,quantize")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--calib-seq-len", type=int, default=256)
    parser.add_argument("--write-doc", action="store_true", help="replace this script's section of docs/BENCHMARKS.md")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    facts = machine()
    rows = run(args)
    if args.write_doc:
        command = " ".join(["python scripts/bench_convert.py", *sys.argv[1:]])
        write_section(HEADING, markdown(rows, facts, command, args.calib_samples, args.calib_seq_len))
        print(f"updated {DOC}")


if __name__ == "__main__":
    main()
