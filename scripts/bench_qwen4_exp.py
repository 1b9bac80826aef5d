"""Benchmark ``mtpquant convert`` on Qwen3.8-Flash-Next (qwen4_exp): the full-size plan from headers, the tiny converts.

1. The full-size BF16 release as a header-only skeleton (``tests/support/qwen4_exp_skeleton.py``: hidden 2560, 48
   layers, 512 experts, the PLE n-gram tables; 461 GB of sparse files), ``convert --dry-run`` per MTP mode, uncapped
   (the plan refuses a machine that cannot hold one layer: exit 22) and with ``--max-memory``: wall time and peak RSS
   of the whole command, in a fresh process.
2. The trained tiny Qwen4-Exp (``mtpquant/assets/tiny-qwen4_exp-mtp``) converted in every MTP mode, and quantize
   again under a memory cap (disk offload, layer-wise calibration): wall, convert's own time split, peak RSS; the
   peer, measured in the same run: the trained tiny Qwen3.5 (``tiny-qwen3_5-mtp``, the same hidden size) converted
   with the same flags, and the ratio of the two converts' own times.

    .venv/bin/python scripts/bench_qwen4_exp.py --write-doc
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from _benchlib import BENCHMARKS as DOC
from _benchlib import REPO, command_line, machine, machine_line, run_python, write_section

HEADING = "## convert on Qwen3.8-Flash-Next (qwen4_exp): the full-size plan and the tiny converts"
ASSET = REPO / "mtpquant" / "assets" / "tiny-qwen4_exp-mtp"
PEER = REPO / "mtpquant" / "assets" / "tiny-qwen3_5-mtp"
CALIB = ["--calib-samples", "16", "--calib-seq-len", "128", "--device", "cpu"]


def dry_runs(root: Path, cap: str) -> list[dict[str, Any]]:
    from tests.support.qwen4_exp_skeleton import make_qwen4_exp_skeleton

    skel = make_qwen4_exp_skeleton(root / "src", "source")
    rows = []
    for mode in ("keep", "quantize"):
        for flags in ([], ["--max-memory", cap]):
            run = run_python(
                [
                    "-m",
                    "mtpquant",
                    "convert",
                    str(skel.path),
                    str(root / f"out-{mode}"),
                    "--mtp",
                    mode,
                    "--dry-run",
                    "--device",
                    "cpu",
                    *flags,
                ]
            )
            rows.append(
                {
                    "mode": mode,
                    "flags": " ".join(flags) or "(none)",
                    "wall": run.wall,
                    "rss": run.max_rss,
                    "rc": run.returncode,
                    "bytes": skel.file_bytes,
                    "tensors": skel.tensors,
                }
            )
            print(
                f"dry-run {mode:8s} {' '.join(flags) or '(none)':28s} wall {run.wall:5.2f}s  peak RSS "
                f"{run.max_rss / 2**20:6.0f} MiB  exit {run.returncode}",
                flush=True,
            )
    return rows


def tiny_converts(root: Path, cap: str) -> list[dict[str, Any]]:
    rows = []
    cases = [(m, []) for m in ("keep", "quantize", "extract", "drop")] + [("quantize", ["--max-memory", cap])]
    for mode, flags in cases:
        row = _tiny(ASSET, root / f"tiny-{mode}{'-capped' if flags else ''}", mode, flags)
        row["peer"] = _tiny(PEER, root / f"peer-{mode}{'-capped' if flags else ''}", mode, flags)
        rows.append(row)
    return rows


def _tiny(src: Path, out: Path, mode: str, flags: list[str]) -> dict[str, Any]:
    """One convert of a tiny checkpoint in a fresh process: wall, convert's own timings, peak RSS, sizes."""
    extra = ["--mtp-out", str(out) + "-mtp"] if mode == "extract" else []
    run = run_python(["-m", "mtpquant", "convert", str(src), str(out), "--mtp", mode, "--json", *CALIB, *flags, *extra])
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-3000:])
        raise SystemExit(f"convert {src.name} {mode} {flags} failed")
    t = run.output["timings"]
    print(
        f"{src.name:20s} {mode:9s} {' '.join(flags) or '':22s} wall {run.wall:5.1f}s  convert {t['total']:5.1f}s  "
        f"peak RSS {run.max_rss / 2**20:5.0f} MiB",
        flush=True,
    )
    return {
        "mode": mode,
        "flags": " ".join(flags) or "(none)",
        "wall": run.wall,
        "rss": run.max_rss,
        "t": t,
        "source": run.output["plan"]["source"]["bytes"],
        "output": run.output["output_bytes"],
        "layerwise": run.output["layerwise"],
        "offload": run.output["offload_bytes"],
    }


def markdown(
    dry: list[dict[str, Any]], tiny: list[dict[str, Any]], facts: dict[str, Any], cap: str, tiny_cap: str
) -> str:
    from mtpquant.runtime.memory import parse_max_memory

    limit = sum(n for _, n in parse_max_memory(cap).caps)
    ram = facts["ram_gib"] * 2**30
    lines = [
        HEADING,
        "",
        f"Command: `{command_line('bench_qwen4_exp.py')}`",
        "",
        machine_line(facts),
        "",
        f"Full-size `--dry-run` (headers only; {dry[0]['tensors']:,} tensors, {dry[0]['bytes'] / 1e9:.0f} GB of "
        "sparse files; the PLE n-gram tables are a block of their own, placed last, as transformers keeps them off "
        "the device). Each row is one fresh `mtpquant convert` process: wall time and peak RSS (VmHWM). Uncapped, "
        "the plan refuses this machine (exit 22: one layer and the buffers do not fit); with a cap it plans "
        "layer-wise calibration with the rest on disk. The limit is the cap where one is given, else the machine's "
        "RAM.",
        "",
        "| MTP mode | flags | wall s | peak RSS MiB | peak RSS / limit | exit |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['mode']} | {r['flags']} | {r['wall']:.2f} | {r['rss'] / 2**20:.0f} | "
        f"{r['rss'] / (limit if r['flags'] != '(none)' else ram):.4f} | {r['rc']} |"
        for r in dry
    ]
    lines += [
        "",
        f"Tiny converts of the trained tiny Qwen4-Exp ({tiny[0]['source'] / 2**20:.2f} MiB; `{' '.join(CALIB)}`); "
        f"the capped row forces disk offload and layer-wise calibration (`--max-memory {tiny_cap}`), and its output "
        "is the in-memory one byte for byte (tests/test_convert_qwen4_exp.py). convert s is convert's own total, "
        "imports (torch, transformers, modelopt) included; process wall adds interpreter start-up. "
        f"Peer: the trained tiny Qwen3.5 ({tiny[0]['peer']['source'] / 2**20:.2f} MiB, the same hidden size), "
        "converted with the same flags right after each row; ratio = Qwen4-Exp convert s / Qwen3.5 convert s.",
        "",
        "| MTP mode | flags | process wall s | convert s | imports s | load s | calibrate s | mtp s | export s | "
        "peak RSS MiB | "
        "output MiB | re-saved for offload | Qwen3.5 convert s | Qwen3.5 peak RSS MiB | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in tiny:
        t, peer = r["t"], r["peer"]
        lines.append(
            f"| {r['mode']} | {r['flags']} | {r['wall']:.1f} | {t['total']:.1f} | {t.get('imports', 0):.1f} | "
            f"{t.get('load', 0):.1f} | "
            f"{t.get('calibrate', 0):.1f} | {t.get('mtp', 0):.1f} | {t.get('export', 0):.1f} | "
            f"{r['rss'] / 2**20:.0f} | {r['output'] / 2**20:.2f} | {r['offload']} B | {peer['t']['total']:.1f} | "
            f"{peer['rss'] / 2**20:.0f} | {t['total'] / peer['t']['total']:.2f} |"
        )
    lines += [
        "",
        "The full-size plan reads headers only: its peak RSS is the interpreter and its imports, far below any cap. "
        "The tiny converts are mostly imports. `mtp` in quantize mode is one pass of the quantized target that "
        "captures the MTP's input (the multi-stream state; capped, through the offloaded layers), the MTP forward "
        "(transformers' Qwen4-Exp decoder layer with hyper-connections and QSA, fused experts observed per expert) "
        "and the MTP's quantization.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="cpu=16GiB", help="--max-memory of the full-size plan (default cpu=16GiB)")
    parser.add_argument("--tiny-cap", default="cpu=2MB", help="--max-memory of the capped tiny convert")
    parser.add_argument("--write-doc", action="store_true", help="replace this script's section of docs/BENCHMARKS.md")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="bench-qwen4-exp-") as tmp:
        dry = dry_runs(Path(tmp) / "full", args.cap)
        tiny = tiny_converts(Path(tmp) / "tiny", args.tiny_cap)
        facts = machine(Path(tmp))  # the load average at the end of the run
    if args.write_doc:
        write_section(HEADING, markdown(dry, tiny, facts, args.cap, args.tiny_cap))
        print(f"updated {DOC}")


if __name__ == "__main__":
    main()
