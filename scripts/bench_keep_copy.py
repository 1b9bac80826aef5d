#!/usr/bin/env python3
"""Benchmark the keep-mode MTP copy (``write_mtp_shards``) against ``cp`` of the same bytes.

    .venv/bin/python scripts/bench_keep_copy.py                      # Qwen3.5-4B and Qwen3.5-35B-A3B layouts
    .venv/bin/python scripts/bench_keep_copy.py --layout Qwen3.5-4B --runs 5 --warm

For each layout: a skeleton of the BF16 source whose ``mtp.*`` tensors hold real (pseudo-random)
bytes and whose other tensors are holes; a flat file holding exactly the same MTP bytes. Then,
alternating which goes first: ``cp`` of the flat file (and ``cp`` + ``sync FILE``, since mtpquant's
writer fsyncs every shard), and ``write_mtp_shards`` (the copy convert's keep mode and graft share:
read each tensor's byte range from the source shards, stream it into ``mtp-*.safetensors``). By
default the page cache is dropped for the source files before every timed copy
(``posix_fadvise(DONTNEED)``), so both read from disk. Target: throughput >= 0.5x ``cp``.

Disk: the MTP bytes exist three times while a layout runs (source, flat file, one copy): 0.7 GB for
Qwen3.5-4B, 5.1 GB for Qwen3.5-35B-A3B, all removed at the end. Prints a Markdown table and
replaces this benchmark's section of docs/BENCHMARKS.md (other sections untouched).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support (skeletons)

from _benchlib import (
    LAYOUTS,
    command_line,
    drop_cache,
    fmt_bytes,
    machine,
    machine_line,
    timed_cp,
    today,
    write_flat,
    write_section,
)

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
from tests.support.skeleton import find_layout, make_skeleton

HEADING = "## keep-mode MTP copy vs cp"
TARGET = 0.5
MAX_SHARD_BYTES = 5 * 10**9


def copier() -> tuple[str, Any]:
    """convert's shared ``write_mtp_shards`` if present, else the same copy through the writer."""
    try:
        from mtpquant.surgery.shards import write_mtp_shards

        return "mtpquant.surgery.shards.write_mtp_shards", write_mtp_shards
    except ImportError:

        def fallback(od: OutputDir, ckpt: Checkpoint, names: list[str], max_bytes: int) -> list[str]:
            entries = sorted((ckpt.tensors[n] for n in names), key=lambda e: e.name)
            planned = [PlannedTensor(e.name, e.dtype, e.shape, functools.partial(ckpt.read_raw, e)) for e in entries]
            return od.write_shards(planned, max_bytes=max_bytes, pattern="mtp-{index:05d}-of-{count:05d}.safetensors")

        return "OutputDir.write_shards + Checkpoint.read_raw (fallback)", fallback


def buffered_copy(ckpt: Checkpoint, root: Path, names: list[str], dst: Path) -> None:
    """Reference: the same byte ranges copied through one reused 16 MiB buffer (readinto), fsynced."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    entries = sorted((ckpt.tensors[n] for n in names), key=lambda e: (e.shard, e.start))
    with dst.open("wb") as out:
        for e in entries:
            with (root / e.shard).open("rb", buffering=0) as fh:
                fh.seek(e.start)
                left = e.nbytes
                while left:
                    n = fh.readinto(view[: min(left, len(buf))])
                    out.write(view[:n])
                    left -= n
        out.flush()
        os.fsync(out.fileno())


def bench_layout(name: str, root: Path, runs: int, warm: bool) -> dict[str, Any]:
    """cp vs keep-mode copy of one layout's MTP, ``runs`` times each, alternating."""
    layout = find_layout(name, LAYOUTS)
    src = make_skeleton(layout, root / "src", mtp_data="random")
    ckpt = Checkpoint.open(src.path)
    names = [e.name for e in ckpt.mtp_tensors()]
    flat = root / "mtp.bin"
    nbytes = write_flat(flat, (raw for _, raw in ckpt.iter_raw(names)))
    assert nbytes == src.mtp_bytes
    sources = [flat, *(src.path / s for s in sorted({ckpt.tensors[n].shard for n in names}))]
    label, copy = copier()
    cp_s, cp_sync_s, ours_s, ref_s, written, shards = [], [], [], [], 0, 0
    for i in range(runs):
        for which in ("cp", "ours", "ref") if i % 2 == 0 else ("ref", "ours", "cp"):
            os.sync()
            if not warm:
                drop_cache(sources)
            if which == "ref":
                t0 = time.perf_counter()
                buffered_copy(ckpt, src.path, names, root / "ref.bin")
                ref_s.append(time.perf_counter() - t0)
                (root / "ref.bin").unlink()
                continue
            if which == "cp":
                dst = root / "copy.bin"
                a, b = timed_cp(flat, dst)
                cp_s.append(a)
                cp_sync_s.append(b)
                dst.unlink()
                continue
            od = OutputDir(root / f"out-{i}")
            t0 = time.perf_counter()
            names_written = copy(od, ckpt, names, MAX_SHARD_BYTES)
            ours_s.append(time.perf_counter() - t0)
            written, shards = od.bytes_written, len(names_written)
            od.abort()
    shutil.rmtree(src.path)
    flat.unlink()
    return {
        "layout": layout.name,
        "tensors": len(names),
        "bytes": nbytes,
        "written": written,
        "shards": shards,
        "cp": cp_s,
        "cp_sync": cp_sync_s,
        "ours": ours_s,
        "ref": ref_s,
        "copier": label,
    }


def section(rows: list[dict[str, Any]], runs: int, warm: bool, m: dict[str, Any]) -> str:
    """The Markdown section for docs/BENCHMARKS.md."""
    cache = "warm page cache" if warm else "page cache dropped for the source files before every timed copy"
    lines = [
        HEADING,
        "",
        f"`{command_line('bench_keep_copy.py')}` on {today()}: the MTP tensors of a skeleton source with real "
        f"(pseudo-random) MTP bytes, copied by `{rows[0]['copier'] if rows else 'n/a'}` into `mtp-*.safetensors` "
        f"(5 GB budget, fsynced) vs `cp` of a flat file holding the same bytes; {runs} runs each, alternating "
        f"which goes first; {cache}. Medians.",
        "",
        machine_line(m),
        "",
        "| layout | MTP tensors | MTP bytes | written | cp s | cp + fsync s | keep copy s | cp GB/s | "
        "keep copy GB/s | keep / cp | keep / (cp + fsync) | reused-buffer copy s (GB/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst_plain, worst_sync = float("inf"), float("inf")
    for r in rows:
        cp, cps, ours, ref = (statistics.median(r[k]) for k in ("cp", "cp_sync", "ours", "ref"))
        worst_plain, worst_sync = min(worst_plain, cp / ours), min(worst_sync, cps / ours)
        lines.append(
            f"| {r['layout']} | {r['tensors']} | {fmt_bytes(r['bytes'])} | {fmt_bytes(r['written'])} | {cp:.2f} "
            f"| {cps:.2f} | {ours:.2f} | {r['bytes'] / cp / 1e9:.2f} | {r['bytes'] / ours / 1e9:.2f} "
            f"| {cp / ours:.2f}x | {cps / ours:.2f}x | {ref:.2f} ({r['bytes'] / ref / 1e9:.2f}) |"
        )

    def verdict(x: float) -> str:
        return f"met (worst {x:.2f}x)" if x >= TARGET else f"MISSED (worst {x:.2f}x, {TARGET / x:.2f}x short)"

    lines += [
        "",
        f"Target (keep-copy throughput >= 0.5x `cp`): against `cp` + `sync FILE`, the like-for-like baseline "
        f"since mtpquant's writer fsyncs every shard: {verdict(worst_sync)}; against plain `cp`, whose copy "
        f'may still sit in dirty page cache when it returns: {verdict(worst_plain)}. "written" is every byte '
        "the writer put in the new shards (tensor bytes plus the safetensors header). `cp` (coreutils "
        "9.1) copies one flat file in the kernel with copy_file_range; the keep copy also uses "
        "copy_file_range for local sources, but tensor by tensor in name order (the deterministic MTP "
        "shard layout that makes extract + graft equal keep), so it reads the source in many ranges out "
        "of file order after the page cache was dropped, plus one fsync per shard. The last column is the "
        "same byte ranges copied through one reused 16 MiB buffer (`readinto`), fsynced.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", action="append", help="layout name (repeatable)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warm", action="store_true", help="keep the page cache (default: drop it per copy)")
    p.add_argument("--tmp", type=Path, default=None, help="parent of the temp directory (default: system temp)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = p.parse_args()
    rows = []
    m: dict[str, Any] = {}
    for name in args.layout or ["Qwen3.5-4B", "Qwen3.5-35B-A3B"]:
        with tempfile.TemporaryDirectory(prefix="bench-keep-copy-", dir=args.tmp) as tmp:
            row = bench_layout(name, Path(tmp), args.runs, args.warm)
            m = machine(Path(tmp))
        print(f"{row['layout']}: keep copy {statistics.median(row['ours']):.2f} s", file=sys.stderr)
        rows.append(row)
    text = section(rows, args.runs, args.warm, m)
    print(text)
    if not args.no_write:
        write_section(HEADING, text)
        print("written to docs/BENCHMARKS.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
