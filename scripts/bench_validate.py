#!/usr/bin/env python3
"""Benchmark ``mtpquant validate`` on the trained tiny model: tokens/s on CPU and peak RSS.

    .venv/bin/python scripts/bench_validate.py                  # 3 runs per case, defaults below
    .venv/bin/python scripts/bench_validate.py --runs 1 --num-prompts 8 --no-write

Cases, each run ``--runs`` times as ``python -m mtpquant -q validate ... --json --device cpu`` in a
fresh process (wall time includes interpreter start-up and imports; peak RSS is the child's VmHWM):

1. single: the trained asset alone (one target run + MTP replay for k = 1..3);
2. pair: the asset vs its ``convert --keep-mtp`` quant (built once here, short calibration): two
   target runs, the candidate target also over the reference sequences, three MTP replays;
3. pair from hidden states: the same pair with ``--hidden`` (saved by case 2): MTP work only.

tokens/s = sequence tokens evaluated (prompt + greedy continuation, summed over the distinct target
runs, from report.json ``timing``) / validate's own total time; "process tok/s" divides by the whole
process wall time instead. Prints a Markdown table and replaces this benchmark's section of
docs/BENCHMARKS.md (other sections untouched).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import command_line, fmt_bytes, import_rss, machine, machine_line, run_python, today, write_section

from mtpquant.synth.train import TINY_MTP_ASSET

HEADING = "## validate on the trained tiny model"


def _case(name: str, argv: list[str], runs: int, report_dir: Path) -> dict[str, Any]:
    walls, rss, tps, totals = [], [], [], []
    data: dict[str, Any] = {}
    for _ in range(runs):
        run = run_python(["-m", "mtpquant", "-q", "validate", *argv, "--report-dir", str(report_dir)])
        if run.returncode not in (0, 1, 6):
            raise RuntimeError(f"{name}: validate failed (rc {run.returncode}): {run.stderr.strip()[-600:]}")
        data = json.loads((report_dir / "report.json").read_text())
        walls.append(run.wall)
        rss.append(run.max_rss)
        tps.append(data["timing"]["tokens_per_second"])
        totals.append(data["timing"]["total_s"])
    tokens = data["timing"]["sequence_tokens"]
    return {
        "case": name,
        "runs": runs,
        "tokens": int(tokens),
        "validate_s": statistics.median(totals),
        "tok_s": statistics.median(tps),
        "wall_s": statistics.median(walls),
        "proc_tok_s": tokens / statistics.median(walls),
        "rss": max(rss),
        "al": [round(r["mean_acceptance_length"], 3) for r in data["reference"]["acceptance"]["by_k"]],
        "status": data["verdict"]["status"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()

    from mtpquant.convert.run import ConvertOptions, convert

    with tempfile.TemporaryDirectory(prefix="bench-validate-") as tmp:
        root = Path(tmp)
        quant = root / "keep"
        convert(
            ConvertOptions(
                src=str(TINY_MTP_ASSET), out=quant, mtp="keep", device="cpu", calib_samples=8, calib_seq_len=128,
                progress=False,
            )
        )  # fmt: skip
        common = ["--device", "cpu", "--num-prompts", str(args.num_prompts), "--max-len", str(args.max_len)]
        hidden = root / "hidden.safetensors"
        asset = str(TINY_MTP_ASSET)
        pair = [asset, str(quant), *common]
        rows = [
            _case("single (asset alone)", [asset, *common], args.runs, root / "r1"),
            _case("pair (asset vs keep-mode quant)", [*pair, "--save-hidden", str(hidden)], args.runs, root / "r2"),
            _case("pair from --hidden (MTP work only)", [*pair, "--hidden", str(hidden)], args.runs, root / "r3"),
        ]
        m = machine(root)
    base = import_rss("mtpquant, torch, transformers")
    model_bytes = sum(p.stat().st_size for p in TINY_MTP_ASSET.glob("*.safetensors"))

    table = [
        "| case | runs | sequence tokens | validate s (median) | tokens/s | process wall s | process tok/s "
        "| peak RSS | AL k=1..3 | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['case']} | {r['runs']} | {r['tokens']} | {r['validate_s']:.1f} | {r['tok_s']:.1f} | "
            f"{r['wall_s']:.1f} | {r['proc_tok_s']:.1f} | {fmt_bytes(r['rss'])} | "
            f"{' / '.join(f'{a:.2f}' for a in r['al'])} | {r['status']} |"
        )
    section = "\n".join(
        [
            HEADING,
            "",
            f"`{command_line('bench_validate.py')}` on {today()}: `mtpquant validate` on the trained tiny "
            f"model (`mtpquant/assets/tiny-qwen3_5-mtp`, {fmt_bytes(model_bytes)} of BF16 weights), "
            f"{args.num_prompts} default held-out prompts, sequences of {args.max_len} tokens (half prompt, half "
            "greedy continuation), k = 1..3, `--device cpu` (float32 compute), each run a fresh process.",
            "",
            machine_line(m),
            "",
            *table,
            "",
            f"Peak RSS of a fresh interpreter importing mtpquant, torch and transformers: {fmt_bytes(base)}; the rest "
            "is the model(s), activations and the report. tokens/s counts every token of every evaluated sequence "
            "once per distinct target run (the pair runs two targets and the candidate target again over the "
            "reference sequences, which is not counted); most of the time is the targets' token-by-token greedy "
            "generation through transformers (Gated DeltaNet in its pure-torch fallback on CPU), as the "
            "`--hidden` row shows. Absolute times vary with the load of the shared machine (above).",
        ]
    )
    print(section)
    if not args.no_write:
        write_section(HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
