"""Benchmark mtpquant's NVFP4 quantizer against modelopt's ``NVFP4QTensor.quantize`` on one CPU tensor.

Both must produce the same bytes (packed codes, fp8 block scales, global scale); the script fails
otherwise. Prints a Markdown table and writes it into docs/BENCHMARKS.md under
``## NVFP4 quantization of MTP-sized tensors`` (replacing an earlier copy of that section only).

    .venv/bin/python scripts/bench_nvfp4.py            # 5120 x 17408 bf16, the shape of an MTP MLP
    .venv/bin/python scripts/bench_nvfp4.py --no-write --rows 1024 --cols 4096
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import resource
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _benchlib import machine, write_section  # noqa: E402

from mtpquant.formats.nvfp4 import NVFP4Weight, quantize_nvfp4  # noqa: E402

HEADING = "## NVFP4 quantization of MTP-sized tensors"


def _modelopt_quantize() -> Callable[[torch.Tensor], NVFP4Weight]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.opt  # noqa: F401  (first, or modelopt warns about circular imports)
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    def run(w: torch.Tensor) -> NVFP4Weight:
        q, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
        return NVFP4Weight(q._quantized_data, scale, scale_2.float())

    return run


def _ours(w: torch.Tensor) -> NVFP4Weight:
    return quantize_nvfp4(w)


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    # Filled in slices: a one-shot randn would leave a float32 temporary in the RSS high-water mark.
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(rows, cols, dtype=torch.bfloat16)
    step = max(1, (1 << 22) // max(1, cols))
    for start in range(0, rows, step):
        w[start : start + step].normal_(0.0, 0.02, generator=gen)
    return w


def _time_interleaved(
    fns: list[Callable[[torch.Tensor], NVFP4Weight]], w: torch.Tensor, runs: list[int]
) -> tuple[list[list[float]], list[NVFP4Weight]]:
    """Warm each up once, then alternate timed calls, so both see the same machine load."""
    results = [fn(w) for fn in fns]
    times: list[list[float]] = [[] for _ in fns]
    for i in range(max(runs)):
        for k, fn in enumerate(fns):
            if i < runs[k]:
                t0 = time.perf_counter()
                results[k] = fn(w)
                times[k].append(time.perf_counter() - t0)
    return times, results


def _same(a: NVFP4Weight, b: NVFP4Weight) -> bool:
    return (
        torch.equal(a.packed, b.packed)
        and torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
        and torch.equal(a.weight_scale_2.reshape(()).view(torch.int32), b.weight_scale_2.reshape(()).view(torch.int32))
    )


def _peak_child(impl: str, rows: int, cols: int, seed: int) -> None:
    """Child mode: print the peak RSS growth (MiB) of one call, measured in a fresh process."""
    fn = _modelopt_quantize() if impl == "modelopt" else _ours
    w = _weight(rows, cols, seed)
    before = _high_water_kib()
    fn(w)
    print(json.dumps({"peak_growth_mib": (_high_water_kib() - before) / 1024}))


def _high_water_kib() -> int:
    """This process's peak RSS in KiB: VmHWM of its own address space where Linux has it.

    ru_maxrss would not do for a child of a big process: Linux carries the forked parent's RSS into
    it across exec.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _peak(impl: str, args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--peak-child", impl, "--rows", str(args.rows), "--cols", str(args.cols)]
    cmd += ["--seed", str(args.seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_growth_mib"])


def _machine() -> dict[str, Any]:
    import importlib.metadata as md

    m = machine()
    return {
        **m,
        "torch": torch.__version__,
        "modelopt": md.version("nvidia-modelopt"),
        "torch_threads": torch.get_num_threads(),
    }


def _section(args: argparse.Namespace, rows: list[tuple[str, list[float], float | None]], m: dict[str, Any]) -> str:
    ref_median = statistics.median(rows[0][1])
    command = " ".join([".venv/bin/python", "scripts/bench_nvfp4.py", *map(shlex.quote, sys.argv[1:])])
    load = ", ".join(f"{x:.2f}" for x in m["load"]) if m["load"] else "n/a"
    lines = [
        HEADING,
        "",
        f"`{command}` on {_dt.date.today().isoformat()}: one {args.rows} x {args.cols} bf16 tensor "
        f"(normal, std 0.02), block 16, weight_scale_2 from max|W|. One warm-up call each, then timed "
        f"calls alternating between the two (same machine load for both); peak RSS growth of one call "
        f"measured in a fresh process.",
        "",
        f"Machine: nproc {m['nproc']}, RAM {m['ram_gib']:.1f} GiB, CPU {m['cpu']}, torch {m['torch']} "
        f"({m['torch_threads']} intra-op threads), nvidia-modelopt {m['modelopt']}, load average {load}.",
        "",
        "| implementation | runs | median s | min s | peak RSS growth MiB | speed-up (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, times, peak in rows:
        peak_s = f"{peak:.0f}" if peak is not None else "n/a"
        lines.append(
            f"| {name} | {len(times)} | {statistics.median(times):.3f} | {min(times):.3f} | {peak_s} "
            f"| {ref_median / statistics.median(times):.1f}x |"
        )
    lines += ["", "Outputs bit-identical (packed codes, fp8 block scales, weight_scale_2): yes."]
    if m["load"] and m["load"][0] > m["nproc"]:
        lines += [
            "",
            "The machine was shared with other jobs (1-minute load above nproc): timings are noisy, and "
            "modelopt's few whole-tensor multi-threaded ops lose more to contention than mtpquant's "
            "single-threaded chunk workers, so the ratio is higher than on an idle machine.",
        ]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=5120)
    p.add_argument("--cols", type=int, default=17408)
    p.add_argument("--runs", type=int, default=7, help="timed calls of mtpquant's path")
    p.add_argument("--ref-runs", type=int, default=5, help="timed calls of modelopt's path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    p.add_argument("--peak-child", choices=["modelopt", "mtpquant"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peak_child:
        _peak_child(args.peak_child, args.rows, args.cols, args.seed)
        return 0

    w = _weight(args.rows, args.cols, args.seed)
    (ref_times, our_times), (ref, ours) = _time_interleaved(
        [_modelopt_quantize(), _ours], w, [args.ref_runs, args.runs]
    )
    if not _same(ours, ref):
        print("FAIL: mtpquant and modelopt outputs differ", file=sys.stderr)
        return 1
    peaks: list[float | None] = [None, None]
    if not args.no_memory:
        peaks = [_peak("modelopt", args), _peak("mtpquant", args)]
    rows = [
        ("modelopt `NVFP4QTensor.quantize`", ref_times, peaks[0]),
        ("mtpquant `quantize_nvfp4`", our_times, peaks[1]),
    ]
    section = _section(args, rows, _machine())
    print(section)
    if not args.no_write:
        write_section(HEADING, section, args.output)
        print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
