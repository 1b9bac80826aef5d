#!/usr/bin/env python3
"""Convert a full-size Qwen3.5-4B (random-normal weights, the real layout) (a) in memory and (b) under a CPU cap.

    python scripts/bench_convert_scale.py --work /root/bench            # builds the source there if missing
    python scripts/bench_convert_scale.py --work /root/bench --cap 3GiB --calib-samples 4 --calib-seq-len 64

Each run is a child process (``mtpquant convert SRC OUT --keep-mtp --device cpu ...``), sampled every
0.2 s from outside: peak RSS (the kernel's ``ru_maxrss`` of the child), bytes written (``/proc/PID/io``
wchar), peak extra disk (used bytes of OUT's filesystem above the start), wall time. Then (b)'s output
is compared with (a)'s tensor by tensor. The goal (issue #13): (b)'s peak RSS <= cap + 2 GB and under
half of (a)'s; bytes written <= 1.1x the output in both; peak extra disk <= output + one shard.
Prints a Markdown table (docs/BENCHMARKS.md) and, with ``--json``, the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mtpquant.checkpoint.table import Checkpoint  # noqa: E402
from mtpquant.units import format_bytes, parse_bytes  # noqa: E402

_CHILD = """
import logging, sys, time
t0 = time.monotonic()
class F(logging.Formatter):
    def format(self, r):
        return f"{time.monotonic() - t0:8.2f} {r.levelname} {r.name}: {r.getMessage()}"
h = logging.StreamHandler(sys.stderr); h.setFormatter(F())
logging.basicConfig(level=logging.INFO, handlers=[h])
from mtpquant.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in {"VmRSS", "RssAnon", "RssFile", "VmHWM"}:
                out[key] = int(value.split()[0]) * 1024
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                out["wchar"] = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return out


def _disk_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run_convert(
    src: Path, out: Path, args: list[str], log: Path, mtp: tuple[str, ...] = ("--keep-mtp",)
) -> dict[str, Any]:
    """One convert as a child process (``mtp``: its MTP flags), sampled from outside."""
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-c", _CHILD, "convert", str(src), str(out), *mtp, "--device", "cpu", *args]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(REPO)}
    disk0 = _disk_used(out.parent)
    samples: list[tuple[float, dict[str, int], int]] = []
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, _status(proc.pid), _disk_used(out.parent) - disk0))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, rusage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        stop.set()
        sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"convert failed ({proc.returncode}); see {log}")
    output_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shard = max(p.stat().st_size for p in out.glob("*.safetensors"))
    wchar = max((s.get("wchar", 0) for _, s, _ in samples), default=0)
    with log.open("a") as fh:  # the RSS timeline, beside the child's timestamped log
        for t, s, d in samples[::5]:
            fh.write(f"# {t:8.2f} rss {s.get('VmRSS', 0) / 1e9:.2f} GB (anon {s.get('RssAnon', 0) / 1e9:.2f}, "
                     f"file {s.get('RssFile', 0) / 1e9:.2f}) disk +{d / 1e9:.2f} GB\n")
    return {
        "command": " ".join(["mtpquant", *cmd[3:]]),
        "wall_s": round(wall, 1),
        "peak_rss": rusage.ru_maxrss * 1024,
        "bytes_written": wchar,
        "output_bytes": output_bytes,
        "largest_shard": shard,
        "peak_extra_disk": max((d for _, _, d in samples), default=0),
        # resident memory split as the kernel counts it: anonymous (what the process allocated) and file-backed
        # (pages of mapped files, e.g. the source shards read in place; the kernel can drop them under pressure)
        "peak_anon": max((s.get("RssAnon", 0) for _, s, _ in samples), default=0),
        "peak_file": max((s.get("RssFile", 0) for _, s, _ in samples), default=0),
    }


def same_tensors(a: Path, b: Path) -> tuple[bool, int]:
    """Whether two checkpoints hold the same tensors, byte for byte; and how many."""
    ca, cb = Checkpoint.open(a, strict=True), Checkpoint.open(b, strict=True)
    if sorted(ca.tensors) != sorted(cb.tensors):
        return False, len(ca.tensors)
    for name, e in ca.tensors.items():
        f = cb.tensors[name]
        if (e.dtype, e.shape) != (f.dtype, f.shape) or ca.read_raw(e) != cb.read_raw(f):
            return False, len(ca.tensors)
    return True, len(ca.tensors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="directory for the source and the outputs")
    parser.add_argument("--src", type=Path, help="the source (default WORK/qwen35-4b-normal, built if missing)")
    parser.add_argument("--cap", default="3GiB", help="(b)'s --max-memory cpu= cap (default 3GiB)")
    parser.add_argument("--calib-samples", default="4")
    parser.add_argument("--calib-seq-len", default="64")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    src = args.src or args.work / "qwen35-4b-normal"
    if not src.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_skeleton_checkpoint.py"), "--layout",
                        "Qwen3.5-4B", "--out", str(src), "--mtp-data", "normal"], check=True)
    calib = ["--calib-samples", args.calib_samples, "--calib-seq-len", args.calib_seq_len]
    a = run_convert(src, args.work / "bench-a-in-memory", calib, args.work / "bench-a.log")
    b = run_convert(src, args.work / "bench-b-capped", [*calib, "--max-memory", f"cpu={args.cap}"],
                    args.work / "bench-b.log")
    identical, count = same_tensors(args.work / "bench-a-in-memory", args.work / "bench-b-capped")
    cap = parse_bytes(args.cap) or 0
    limit = cap + 2_000_000_000
    rows = [
        ("peak RSS", format_bytes(a["peak_rss"]), format_bytes(b["peak_rss"]),
         f"(b) {b['peak_rss'] / limit:.2f}x the limit (cap + 2 GB = {format_bytes(limit)}); "
         f"(b)/(a) {b['peak_rss'] / a['peak_rss']:.2f} (goal < 0.5)"),
        ("wall", f"{a['wall_s']} s", f"{b['wall_s']} s", f"(b)/(a) {b['wall_s'] / a['wall_s']:.2f}"),
        ("bytes written", format_bytes(a["bytes_written"]), format_bytes(b["bytes_written"]),
         f"{a['bytes_written'] / a['output_bytes']:.3f}x / {b['bytes_written'] / b['output_bytes']:.3f}x the "
         "output (goal <= 1.1x)"),
        ("peak extra disk", format_bytes(a["peak_extra_disk"]), format_bytes(b["peak_extra_disk"]),
         f"{a['peak_extra_disk'] / (a['output_bytes'] + a['largest_shard']):.2f}x / "
         f"{b['peak_extra_disk'] / (b['output_bytes'] + b['largest_shard']):.2f}x of output + one shard (goal <= 1)"),
        ("output", format_bytes(a["output_bytes"]), format_bytes(b["output_bytes"]),
         f"(b) bit-identical to (a): {'yes' if identical else 'NO'} ({count} tensors)"),
    ]
    print(f"| | (a) in memory | (b) --max-memory cpu={args.cap} | ratio |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n(a): `{a['command']}`\n(b): `{b['command']}`")
    if args.json:
        print(json.dumps({"a": a, "b": b, "identical": identical}, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
