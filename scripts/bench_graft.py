#!/usr/bin/env python3
"""Benchmark ``graft`` on generated checkpoints with real bytes: bytes written vs MTP bytes, time vs ``cp``.

    .venv/bin/python scripts/bench_graft.py                      # tiny + a synthetic ~1 GB checkpoint
    .venv/bin/python scripts/bench_graft.py --main-gb 4 --runs 7 --no-write

Two checkpoint pairs, generated in a temp directory (every byte real, no sparse holes):

- ``tiny``: the tiny real-layout Qwen3.5 checkpoint (SRC) and the same checkpoint with its MTP
  tensors stripped (QUANT, shards otherwise identical: what ``convert --mtp extract`` leaves);
- ``synthetic``: a Qwen3.5-shaped checkpoint (hidden 2048, MLP 6144) whose main weights fill
  ``--main-gb`` over 512 MB shards, with the exact MTP tensor set its config implies (~118 MB).

For each pair and each mode (``--out``, ``--in-place`` on a hard-linked copy of QUANT), every run
evicts the files involved from the page cache (``posix_fadvise(DONTNEED)``, this benchmark's files
only), times ``cp`` + ``sync`` of a flat file holding exactly the MTP bytes, evicts again, then runs
``graft`` in a fresh process that reports the graft() call's time and its /proc/self/io ``wchar``
(every byte handed to write(2)). Prints a Markdown table of medians and replaces this benchmark's
section of docs/BENCHMARKS.md (other sections untouched). The full-size layouts are
``scripts/bench_skeleton_graft.py``'s job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _benchlib import (
    command_line,
    fmt_bytes,
    machine,
    machine_line,
    proc_io,
    run_python,
    timed_cp,
    today,
    write_flat,
    write_section,
)

HEADING = "## graft on generated checkpoints: bytes written and time vs cp"
_BLOCK = os.urandom(1 << 20)  # tensor bytes: one random MiB, repeated (real bytes on disk, cheap to make)


# ---------------------------------------------------------------------------------------------- child


def child(quant: str, source: str, out: str, mode: str) -> int:
    """One graft in this fresh process; prints its measurements as one JSON line."""
    from mtpquant.graft.run import GraftOptions, graft

    opts = (
        GraftOptions(quant=quant, source=source, out=out)
        if mode == "out"
        else GraftOptions(quant=quant, source=source, in_place=True)
    )
    io0 = proc_io()
    t0 = time.perf_counter()
    result = graft(opts)
    seconds = time.perf_counter() - t0
    io1 = proc_io()
    print(
        json.dumps(
            {
                "graft_s": seconds,
                "wchar": io1.get("wchar", 0) - io0.get("wchar", 0),
                "bytes_written": result.bytes_written,
                "mtp_bytes": result.mtp_bytes,
                "linked": len(result.linked),
                "copied": len(result.copied),
                "commit": result.commit,
                "action": result.action,
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------- checkpoints


def _filler(nbytes: int) -> bytes:
    reps, rest = divmod(nbytes, len(_BLOCK))
    return _BLOCK * reps + _BLOCK[:rest]


def _strip(src: Path, dst: Path) -> Path:
    """``src`` without its MTP tensors (same shard names): the QUANT to graft into."""
    from mtpquant.checkpoint.table import Checkpoint
    from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
    from mtpquant.families import is_mtp_name

    ckpt = Checkpoint.open(src)
    with OutputDir(dst) as od:
        for shard in ckpt.shards:
            entries = sorted(
                (e for e in ckpt.headers[shard].tensors.values() if not is_mtp_name(e.name)), key=lambda e: e.start
            )
            od.write_shard(
                shard,
                [PlannedTensor(e.name, e.dtype, e.shape, lambda e=e: ckpt.read_raw(e)) for e in entries],
                ckpt.headers[shard].metadata,
            )
        od.write_index()
        for f in ckpt.source.list_files():
            if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
                od.link_file(src / f, f, link=False)
        return od.finalize()


def make_tiny(root: Path) -> tuple[Path, Path]:
    from mtpquant.synth.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(root / "tiny-src", "qwen3_5", tokenizer=False)
    return src, _strip(src, root / "tiny-quant")


def make_synthetic(root: Path, main_bytes: int) -> tuple[Path, Path]:
    """A Qwen3.5-shaped SRC of about ``main_bytes`` main weights plus its exact MTP, and its MTP-less twin."""
    from mtpquant.checkpoint.writer import OutputDir, PlannedTensor
    from mtpquant.families import resolve
    from mtpquant.synth.tiny import TinySpec, tiny_config

    config = tiny_config(TinySpec("qwen3_5", text_only=True, vocab_size=32768, hidden_size=2048))
    config |= {"intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256}
    spec = resolve(config)
    H, inter, V = 2048, 6144, 32768
    per_layer = {
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "self_attn.o_proj.weight": (H, 2048),
    }
    layer_bytes = sum(a * b * 2 for a, b in per_layer.values())
    layers = max(1, (main_bytes - 2 * V * H * 2) // layer_bytes)
    config["num_hidden_layers"] = int(layers)
    config["layer_types"] = ["full_attention"] * int(layers)
    spec = resolve(config)
    prefix = spec.main_prefix_for(["model.layers.0.x"])
    main = [(prefix + "embed_tokens.weight", (V, H)), ("lm_head.weight", (V, H)), (prefix + "norm.weight", (H,))]
    main += [(f"{prefix}layers.{i}.{n}", s) for i in range(int(layers)) for n, s in per_layer.items()]
    mtp = sorted(spec.expected_mtp_shapes().items())

    def planned(name: str, shape: tuple[int, ...]) -> PlannedTensor:
        n = 2
        for d in shape:
            n *= d
        return PlannedTensor(name, "BF16", shape, lambda n=n: _filler(n))

    budget = 512 * 10**6
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for name, shape in main:
        t = planned(name, shape)
        if groups[-1] and size + t.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    # like real checkpoints, the MTP is spread over the first and the last shard
    for name, shape in mtp:
        (groups[0] if ".mlp." in name else groups[-1]).append(planned(name, shape))
    with OutputDir(root / "synthetic-src") as od:
        count = len(groups)
        for i, group in enumerate(groups):
            od.write_shard(f"model-{i + 1:05d}-of-{count:05d}.safetensors", group, {"format": "pt"})
        od.write_index()
        od.write_json("config.json", config)
        src = od.finalize()
    return src, _strip(src, root / "synthetic-quant")


# ---------------------------------------------------------------------------------------------- measuring


def _evict(paths: list[Path]) -> None:
    """Drop these files (only) from the page cache, so each run reads from disk."""
    for p in paths:
        files = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]
        for f in files:
            with contextlib.suppress(OSError):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _mtp_bytes(src: Path) -> Iterator[bytes]:
    from mtpquant.checkpoint.table import Checkpoint

    ckpt = Checkpoint.open(src)
    for _, data in ckpt.iter_raw([e.name for e in ckpt.mtp_tensors()]):
        yield data


def bench_pair(name: str, src: Path, quant: Path, root: Path, runs: int, modes: list[str]) -> dict[str, Any]:
    from mtpquant.checkpoint.table import Checkpoint

    flat = root / f"{name}-mtp.bin"
    mtp_bytes = write_flat(flat, _mtp_bytes(src))
    row: dict[str, Any] = {
        "name": name,
        "mtp_bytes": mtp_bytes,
        "rest_bytes": Checkpoint.open(quant).total_bytes,
        "modes": {},
    }
    for mode in modes:
        data = []
        for i in range(runs):
            work = root / f"{name}-{mode}-{i}"
            work.mkdir()
            copy_dst = work / "cp-dst.bin"
            _evict([flat, src, quant])
            cp_s, cp_sync_s = timed_cp(flat, copy_dst)
            copy_dst.unlink()
            target_quant = quant
            if mode == "in-place":
                target_quant = work / "quant"
                subprocess.run(["cp", "-al", str(quant), str(target_quant)], check=True)  # links: instant
            out = work / "out"
            _evict([src, quant])
            run = run_python([__file__, "--child", str(target_quant), str(src), str(out), mode])
            if run.returncode != 0:
                raise RuntimeError(f"graft child failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
            data.append({**run.output, "cp_s": cp_s, "cp_sync_s": cp_sync_s, "wall_s": run.wall})
            shutil.rmtree(work)
        row["modes"][mode] = data
    flat.unlink()
    return row


def section(rows: list[dict[str, Any]], runs: int, m: dict[str, Any]) -> str:
    lines = [
        HEADING,
        "",
        f"`{command_line('bench_graft.py')}` on {today()}: graft of SRC's MTP into QUANT (SRC minus its MTP, "
        "same shards) for generated checkpoints whose every byte is real. Per run: this benchmark's files "
        "evicted from the page cache, `cp` + `sync` of a flat file holding exactly the MTP bytes timed, files "
        "evicted again, then `graft` in a fresh process (`--in-place` on a hard-linked copy of QUANT). "
        '"written" is every byte the graft process handed to write(2) during the graft() call '
        '(/proc/self/io wchar: MTP shards, index, JSON); "graft()" excludes interpreter start-up, '
        f'"process" includes it. Medians of {runs} runs.',
        "",
        machine_line(m),
        "",
        "| checkpoint | rest of model | MTP bytes | mode | written | written / MTP | cp+sync s | graft() s "
        "| graft() / cp+sync | process s | linked / copied |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        for mode, data in r["modes"].items():
            med = {k: statistics.median(d[k] for d in data) for k in ("wchar", "cp_sync_s", "graft_s", "wall_s")}
            lines.append(
                f"| {r['name']} | {fmt_bytes(r['rest_bytes'])} | {fmt_bytes(r['mtp_bytes'])} | {mode} "
                f"| {fmt_bytes(med['wchar'])} | {med['wchar'] / r['mtp_bytes']:.4f} | {med['cp_sync_s']:.3f} "
                f"| {med['graft_s']:.3f} | {med['graft_s'] / med['cp_sync_s']:.2f} | {med['wall_s']:.2f} "
                f"| {data[0]['linked']} / {data[0]['copied']} |"
            )
    lines += [
        "",
        "graft reads the MTP once from SRC, writes it once, then reads it back to verify it against SRC's "
        "bytes (length + CRC-32 per tensor) and runs the inspect checks before putting the result in place; "
        "the rest of the model is hard-linked (same inode), never read or written.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="runs per checkpoint and mode")
    p.add_argument("--main-gb", type=float, default=1.0, help="size of the synthetic checkpoint's main weights")
    p.add_argument("--only", choices=("tiny", "synthetic"), help="benchmark one checkpoint pair")
    p.add_argument("--mode", action="append", choices=("out", "in-place"), help="graft mode (repeatable)")
    p.add_argument("--tmp", type=Path, default=None, help="parent of the temp directory (default: system temp)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    p.add_argument("--child", nargs=4, metavar=("QUANT", "SRC", "OUT", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    rows = []
    modes = args.mode or ["out", "in-place"]
    with tempfile.TemporaryDirectory(prefix="bench-graft-", dir=args.tmp) as tmp:
        root = Path(tmp)
        pairs = []
        if args.only in (None, "tiny"):
            pairs.append(("tiny", *make_tiny(root)))
        if args.only in (None, "synthetic"):
            pairs.append(("synthetic", *make_synthetic(root, int(args.main_gb * 10**9))))
        for name, src, quant in pairs:
            row = bench_pair(name, src, quant, root, args.runs, modes)
            rows.append(row)
            for mode, data in row["modes"].items():
                print(
                    f"{name} {mode}: graft {statistics.median(d['graft_s'] for d in data):.3f} s, "
                    f"cp+sync {statistics.median(d['cp_sync_s'] for d in data):.3f} s",
                    file=sys.stderr,
                )
        m = machine(root)
    text = section(rows, args.runs, m)
    print(text)
    if not args.no_write:
        write_section(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
