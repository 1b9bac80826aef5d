#!/usr/bin/env python3
"""Benchmark ``graft`` into full-size skeleton quants: bytes written, time vs ``cp``, peak RSS.

    .venv/bin/python scripts/bench_skeleton_graft.py                  # Qwen3.5-4B and Qwen3.5-35B-A3B layouts
    .venv/bin/python scripts/bench_skeleton_graft.py --layout Qwen3.5-4B --mode out --runs 5 --profile

For each layout: a skeleton BF16 source whose ``mtp.*`` tensors hold real (pseudo-random) bytes and
whose other tensors are holes, a flat file with the same MTP bytes, and, fresh for every run, the
sparse skeleton of the naive modelopt NVFP4 quant (main weights NVFP4, MTP absent while config.json
declares it). Each run drops the page cache of the source files, times ``cp`` + ``sync FILE`` of the
flat file, drops the cache again, then runs ``graft`` in a fresh process (``--out`` or
``--in-place``) that reports the graft() call's time and its /proc/self/io counters; the parent
takes the child's peak RSS from ``wait4``. Targets: bytes written / MTP bytes <= 1.05; graft time /
``cp`` time <= 2; peak RSS <= RSS of a process that only imports mtpquant and torch + largest MTP
tensor + 256 MiB. ``--profile`` adds one cProfile'd graft per layout and reports where the time went.

Disk: the MTP bytes exist up to three times while a layout runs (source, flat file, one copy or
graft output): 0.7 GB for Qwen3.5-4B, 5.1 GB for Qwen3.5-35B-A3B, all removed at the end. Prints a
Markdown table and replaces this benchmark's section of docs/BENCHMARKS.md (others untouched).
"""

from __future__ import annotations

import argparse
import json
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
    import_rss,
    machine,
    machine_line,
    proc_io,
    run_python,
    timed_cp,
    today,
    write_flat,
    write_section,
)

HEADING = "## graft into full-size skeleton quants"
TARGET_WRITTEN = 1.05
TARGET_TIME = 2.0
RSS_MARGIN = 256 * 2**20

# Attributed in --profile runs: (label, file suffix or "~" for built-ins, function name, or for
# built-ins "|"-separated substrings of it).
PROFILE_SPLIT = (
    ("Checkpoint.open", "checkpoint/table.py", "open"),
    ("MTP copy (write_mtp_shards)", "surgery/shards.py", "write_mtp_shards"),
    ("inspect verification", "inspect/report.py", "inspect_checkpoint"),
    ("checksums", "~", "crc32|_hashlib"),
    ("JSON parse", "json/decoder.py", "raw_decode"),
    ("fsync", "~", "posix.fsync"),
)


# ---------------------------------------------------------------------------------------------- child


def child(quant: str, source: str, out: str, mode: str, profile: str | None) -> int:
    """Run one graft in this (fresh) process and print its measurements as one JSON line."""
    t_import = time.perf_counter()
    from mtpquant.graft.run import GraftOptions, graft

    import_s = time.perf_counter() - t_import
    opts = (
        GraftOptions(quant=quant, source=source, out=out)
        if mode == "out"
        else GraftOptions(quant=quant, source=source, in_place=True)
    )
    io0 = proc_io()
    t0 = time.perf_counter()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        result = prof.runcall(graft, opts)
        prof.dump_stats(profile)
    else:
        result = graft(opts)
    seconds = time.perf_counter() - t0
    io1 = proc_io()
    print(
        json.dumps(
            {
                "graft_s": seconds,
                "import_s": import_s,
                "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
                "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
                "write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
                "action": result.action,
                "bytes_written": result.bytes_written,
                "mtp_bytes": result.mtp_bytes,
                "mtp_tensors": result.mtp_tensors,
                "linked": len(result.linked),
                "copied": len(result.copied),
                "commit": result.commit,
                "destination": result.destination,
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------- parent


def _inodes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in path.iterdir() if p.is_file()}


def _profile_split(stats_path: str) -> dict[str, Any]:
    import pstats

    st = pstats.Stats(stats_path)
    out: dict[str, Any] = {"calls": {}}
    total = 0.0
    for (fname, _line, func), (_cc, nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        if func == "graft" and fname.endswith("graft/run.py"):
            total = max(total, ct)
        for label, suffix, name in PROFILE_SPLIT:
            exact = func == name if suffix != "~" else any(part in func for part in name.split("|"))
            if exact and fname.endswith(suffix):
                out[label] = out.get(label, 0.0) + ct
                out["calls"][label] = out["calls"].get(label, 0) + nc
    out["graft total"] = total
    return out


def bench_layout(name: str, root: Path, modes: list[str], runs: int, profile: bool) -> dict[str, Any]:
    """cp vs graft for one layout: ``runs`` per mode, each on a fresh skeleton quant."""
    from mtpquant.checkpoint.table import Checkpoint
    from tests.support.skeleton import find_layout, make_skeleton

    layout = find_layout(name, LAYOUTS)
    src = make_skeleton(layout, root / "src", mtp_data="random")
    ckpt = Checkpoint.open(src.path)
    names = [e.name for e in ckpt.mtp_tensors()]
    flat = root / "mtp.bin"
    write_flat(flat, (raw for _, raw in ckpt.iter_raw(names)))
    sources = [flat, *(src.path / s for s in sorted({ckpt.tensors[n].shard for n in names}))]
    row: dict[str, Any] = {
        "layout": layout.name,
        "mtp_tensors": len(names),
        "mtp_bytes": src.mtp_bytes,
        "largest": src.largest_mtp_tensor,
        "source_bytes": src.total_bytes,
        "modes": {},
    }
    for mode in modes:
        runs_data: list[dict[str, Any]] = []
        for i in range(runs + (1 if profile and mode == modes[0] else 0)):
            profiling = profile and mode == modes[0] and i == runs
            quant = make_skeleton(layout, root / f"quant-{mode}-{i}", quant=True)
            row["quant_tensors"], row["quant_bytes"] = quant.tensors, quant.total_bytes
            before = _inodes(quant.path)
            out = root / f"out-{mode}-{i}"
            os.sync()
            drop_cache(sources)
            cp_s, cp_sync_s = timed_cp(flat, root / "copy.bin")
            (root / "copy.bin").unlink()
            os.sync()
            drop_cache(sources)
            stats = str(root / "graft.prof") if profiling else None
            cmd = [__file__, "--child", str(quant.path), str(src.path), str(out), mode]
            run = run_python(cmd + (["--profile-to", stats] if stats else []))
            if run.returncode != 0 or not run.output:
                raise RuntimeError(f"graft child failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
            dest = out if mode == "out" else quant.path
            after = _inodes(dest)
            new_files = [n for n, ino in after.items() if before.get(n) != ino]
            data = dict(run.output)
            data.update(
                cp_s=cp_s,
                cp_sync_s=cp_sync_s,
                wall_s=run.wall,
                max_rss=run.max_rss,
                new_file_bytes=sum((dest / n).stat().st_size for n in new_files),
                relinked=sorted(set(before) & {n for n, ino in after.items() if before.get(n) == ino}),
            )
            if profiling and stats:
                row["profile"] = _profile_split(stats)
                row["profile_wall"] = data["graft_s"]
            else:
                runs_data.append(data)
            shutil.rmtree(quant.path, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
        row["modes"][mode] = runs_data
    shutil.rmtree(src.path)
    flat.unlink()
    return row


def section(rows: list[dict[str, Any]], runs: int, base_rss: int, m: dict[str, Any]) -> str:
    """The Markdown section for docs/BENCHMARKS.md."""
    lines = [
        HEADING,
        "",
        f"`{command_line('bench_skeleton_graft.py')}` on {today()}: graft of a skeleton BF16 source's MTP (real "
        "pseudo-random bytes; every other tensor a hole) into a fresh sparse skeleton of the naive modelopt "
        f"NVFP4 quant (MTP absent, still declared), {runs} runs per mode, each in a fresh process. Per run: page "
        "cache of the source files dropped, `cp` + `sync FILE` of a flat file holding the same MTP bytes "
        'timed, cache dropped again, then the graft. "written" is every byte the graft process handed '
        'to write(2) during the graft() call (/proc/self/io wchar: shards, index, JSON); "graft()" is the '
        'call itself, "process" the whole command including interpreter start-up and imports. RSS target = '
        f"RSS of `python -c 'import mtpquant, torch'` ({fmt_bytes(base_rss)}) + largest MTP tensor + 256 MiB. "
        "Medians; peak RSS is the max over runs.",
        "",
        machine_line(m),
        "",
        "| layout | mode | MTP tensors | MTP bytes | quant (tensors, bytes) | written | written / MTP | cp + fsync s "
        "| graft() s | graft() / cp+fsync: ratio to the limit | process s | process / cp+fsync "
        "| graft() / cp (no fsync) | peak RSS | RSS target |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    misses: list[str] = []
    for r in rows:
        rss_target = base_rss + r["largest"] + RSS_MARGIN
        for mode, data in r["modes"].items():
            if not data:
                continue
            med = {
                k: statistics.median(d[k] for d in data) for k in ("wchar", "cp_s", "cp_sync_s", "graft_s", "wall_s")
            }
            peak = max(d["max_rss"] for d in data)
            w_ratio = med["wchar"] / r["mtp_bytes"]
            t_ratio = med["graft_s"] / med["cp_sync_s"]
            p_ratio = med["wall_s"] / med["cp_sync_s"]
            lines.append(
                f"| {r['layout']} | {mode} | {r['mtp_tensors']} | {fmt_bytes(r['mtp_bytes'])} "
                f"| {r['quant_tensors']:,}, {fmt_bytes(r['quant_bytes'])} | {fmt_bytes(med['wchar'])} "
                f"| {w_ratio:.4f} | {med['cp_sync_s']:.2f} | {med['graft_s']:.2f} | {t_ratio:.2f} "
                f"| {med['wall_s']:.2f} | {p_ratio:.2f} | {med['graft_s'] / med['cp_s']:.2f} "
                f"| {fmt_bytes(peak)} | {fmt_bytes(rss_target)} |"
            )
            where = f"{r['layout']} {mode}"
            if w_ratio > TARGET_WRITTEN:
                misses.append(f"{where}: written / MTP {w_ratio:.3f} > {TARGET_WRITTEN}")
            if t_ratio > TARGET_TIME:
                misses.append(
                    f"{where}: graft() / (cp + fsync) {t_ratio:.2f} > {TARGET_TIME} (by {t_ratio / TARGET_TIME:.1f}x)"
                )
            if p_ratio > TARGET_TIME:
                misses.append(f"{where}: process / (cp + fsync) {p_ratio:.2f} > {TARGET_TIME}")
            if peak > rss_target:
                misses.append(f"{where}: peak RSS {fmt_bytes(peak)} > {fmt_bytes(rss_target)}")
            linked = {len(d["relinked"]) for d in data}
            lines_note = f"{where}: pre-existing files kept as the same inode: {sorted(linked)}"
            misses.append("(info) " + lines_note)
    lines += ["", "Targets: written / MTP <= 1.05; graft / cp <= 2; peak RSS <= target."]
    real = [x for x in misses if not x.startswith("(info)")]
    lines += ["", "Missed: " + ("none." if not real else "")]
    lines += [f"- {x}" for x in real]
    info = [x[len("(info) ") :] for x in misses if x.startswith("(info)")]
    if info:
        lines += ["", "Untouched files (hard links with --out, untouched with --in-place): " + "; ".join(info) + "."]
    prof = [r for r in rows if r.get("profile")]
    if prof:
        lines += [
            "",
            "Where graft's time goes (one extra cProfile'd `--out` run per layout, so Python-heavy parts are "
            "inflated; cumulative seconds (calls), overlapping: the inspect verification includes a "
            "Checkpoint.open):",
            "",
        ]
        labels = [p[0] for p in PROFILE_SPLIT]
        lines += ["| layout | graft total s | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]
        for r in prof:
            p = r["profile"]
            lines.append(
                f"| {r['layout']} | {p.get('graft total', 0):.2f} | "
                + " | ".join(f"{p.get(label, 0.0):.2f} ({p['calls'].get(label, 0)})" for label in labels)
                + " |"
            )
        why = []
        for r in prof:
            p = r["profile"]
            total, copy = p.get("graft total", 0.0), p.get("MTP copy (write_mtp_shards)", 0.0)
            if total <= 0:
                continue
            why.append(
                f"{r['layout']}: {100 * (total - copy) / total:.0f} % of the profiled graft is not the MTP copy; "
                f"{p.get('Checkpoint.open', 0.0):.1f} s go to {p['calls'].get('Checkpoint.open', 0)} "
                f"`Checkpoint.open` calls (QUANT, SRC and the result: the {r['quant_tensors']:,}-tensor "
                "quant's headers are parsed once, the result re-parses only what graft wrote and validates "
                f"its whole index) and {p.get('inspect verification', 0.0):.1f} s to the inspect verification"
            )
        if why:
            time_missed = any("graft() / (cp + fsync)" in x for x in real)
            lead = (
                "Why the time target is missed: the bytes are O(MTP) (written / MTP ~1.00), but the time is not. "
                if time_missed
                else "graft() is within the time target on every layout here; where the time beyond the copy goes: "
            )
            lines += [
                "",
                lead + "; ".join(why) + ". That work grows with the quant's tensor count, not with "
                "the MTP bytes (a fine-grained MoE quant has 4 header entries per expert Linear), and for a "
                "small MTP fixed costs (opens, the verification's checksums, fsyncs) weigh against a "
                "sub-second `cp`; the process column adds interpreter start-up and graft's imports (~0.15 s, "
                "no torch). graft opens QUANT once and reuses its table for the lineage check, the "
                "plan and the verification (a hard-linked shard keeps its parsed header only while it is "
                "the same inode, size and mtime); a local SRC's MTP tensors are checksummed in their file and "
                "copied in the kernel (`copy_file_range`, as `cp`), and the verification checksums the bytes "
                "in the written shards in 1 MiB pieces; what remains per tensor is the index validation, the "
                "exclusion check and the inspect verdict over every module. The `cp` baseline itself varies "
                "between runs on this shared disk (the ratios are per run, then the median).",
            ]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", action="append", help="layout name (repeatable)")
    p.add_argument("--mode", action="append", choices=("out", "in-place"), help="graft mode (repeatable)")
    p.add_argument("--runs", type=int, default=3, help="runs per layout and mode")
    p.add_argument("--profile", action="store_true", help="one extra cProfile'd run per layout")
    p.add_argument("--tmp", type=Path, default=None, help="parent of the temp directory (default: system temp)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    p.add_argument("--child", nargs=4, metavar=("QUANT", "SRC", "OUT", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        quant, source, out, mode = args.child
        return child(quant, source, out, mode, profile=args.profile_to)
    try:
        import mtpquant.graft.run  # noqa: F401
    except ImportError as exc:
        print(f"mtpquant.graft.run is not available yet ({exc}); nothing to benchmark", file=sys.stderr)
        return 3
    base_rss = import_rss("mtpquant, torch")
    rows = []
    m: dict[str, Any] = {}
    for name in args.layout or ["Qwen3.5-4B", "Qwen3.5-35B-A3B"]:
        with tempfile.TemporaryDirectory(prefix="bench-graft-", dir=args.tmp) as tmp:
            row = bench_layout(name, Path(tmp), args.mode or ["out", "in-place"], args.runs, args.profile)
            m = machine(Path(tmp))
        rows.append(row)
        for mode, data in row["modes"].items():
            print(
                f"{row['layout']} {mode}: graft {statistics.median(d['graft_s'] for d in data):.2f} s", file=sys.stderr
            )
    text = section(rows, args.runs, base_rss, m)
    print(text)
    if not args.no_write:
        write_section(HEADING, text)
        print("written to docs/BENCHMARKS.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
