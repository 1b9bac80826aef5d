#!/usr/bin/env python3
"""Benchmark ``mtpquant validate`` on the trained tiny model: tokens/s on CPU and peak RSS.

    .venv/bin/python scripts/bench_validate.py                  # 3 runs per case, defaults below
    .venv/bin/python scripts/bench_validate.py --runs 1 --num-prompts 8 --no-write

Cases, each run ``--runs`` times as ``python -m mtpquant -q validate ... --json --device cpu`` in a
fresh process (wall time includes interpreter start-up and imports; peak RSS is the child's VmHWM):

1. single: the trained asset alone (one target run + MTP replay for k = 1..3), greedy;
1b. the same with ``--batch-size 1``: one prompt at a time, as the targets generated before (the A/B of batching);
1c. the same sampled at temperature 0.8, and at 0.8 with top-p 0.9 (the target samples its sequences, the
    prediction adds the rule's acceptance probabilities; the intervals reuse the replay's counts);
2. pair: the asset vs its ``convert --keep-mtp`` quant (built once here, short calibration): two
   target runs, the candidate target also over the reference sequences, three MTP replays;
3. pair from hidden states: the same pair with ``--hidden`` (saved by case 2): MTP work only.

tokens/s = sequence tokens evaluated (prompt + greedy continuation, summed over the distinct target
runs, from report.json ``timing``) / validate's own time less the import of transformers' model code
(``imports_s``, shown apart); "process tok/s" divides by the whole process wall time instead. The cases run
in interleaved rounds; the ratio to the limit is tokens/s over #15's 1,000 tokens/s. Prints a Markdown table
and replaces this benchmark's section of docs/BENCHMARKS.md (other sections untouched).
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


TARGET_TOK_S = 1000.0  # #15: the built-in validate on the tiny model


def _run(name: str, argv: list[str], report_dir: Path) -> tuple[float, int, dict[str, Any]]:
    run = run_python(["-m", "mtpquant", "-q", "validate", *argv, "--report-dir", str(report_dir)])
    if run.returncode not in (0, 1, 6, 17, 23):
        raise RuntimeError(f"{name}: validate failed (rc {run.returncode}): {run.stderr.strip()[-600:]}")
    return run.wall, run.max_rss, json.loads((report_dir / "report.json").read_text())


def _summary(name: str, runs: list[tuple[float, int, dict[str, Any]]]) -> dict[str, Any]:
    data = runs[-1][2]
    timing = [r[2]["timing"] for r in runs]
    tokens = data["timing"]["sequence_tokens"]
    wall = statistics.median(r[0] for r in runs)
    tok_s = statistics.median(t["tokens_per_second"] for t in timing)
    return {
        "case": name,
        "runs": len(runs),
        "tokens": int(tokens),
        "imports_s": statistics.median(t.get("imports_s", 0.0) for t in timing),
        "validate_s": statistics.median(t["total_s"] for t in timing),
        "tok_s": tok_s,
        "ratio": tok_s / TARGET_TOK_S,
        "wall_s": wall,
        "proc_tok_s": tokens / wall,
        "rss": max(r[1] for r in runs),
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
        cases = [
            ("single (asset alone)", [asset, *common]),
            ("single, one prompt at a time (--batch-size 1)", [asset, *common, "--batch-size", "1"]),
            ("single, --temperature 0.8", [asset, *common, "--temperature", "0.8"]),
            ("single, --temperature 0.8 --top-p 0.9", [asset, *common, "--temperature", "0.8", "--top-p", "0.9"]),
            ("pair (asset vs keep-mode quant)", [*pair, "--save-hidden", str(hidden)]),
            ("pair from --hidden (MTP work only)", [*pair, "--hidden", str(hidden)]),
        ]
        results: dict[str, list[tuple[float, int, dict[str, Any]]]] = {name: [] for name, _ in cases}
        for _ in range(args.runs):  # interleaved rounds: every case sees the same machine load
            for i, (name, argv) in enumerate(cases):
                if "--hidden" in argv and not hidden.exists():
                    continue
                results[name].append(_run(name, argv, root / f"r{i}"))
        for name, argv in cases:  # the --hidden case in round 1 waited for the file the pair case saves
            if not results[name]:
                results[name].append(_run(name, argv, root / "rh"))
        rows = [_summary(name, results[name]) for name, _ in cases]
        m = machine(root)
    base = import_rss("mtpquant, torch, transformers")
    model_bytes = sum(p.stat().st_size for p in TINY_MTP_ASSET.glob("*.safetensors"))

    table = [
        "| case | runs | sequence tokens | validate s (median) | of it imports s | tokens/s | ratio to the limit "
        "(1,000 tok/s) | process wall s | process tok/s | peak RSS | AL k=1..3 | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['case']} | {r['runs']} | {r['tokens']} | {r['validate_s']:.2f} | {r['imports_s']:.2f} | "
            f"{r['tok_s']:.0f} | {r['ratio']:.2f} | {r['wall_s']:.1f} | {r['proc_tok_s']:.0f} | "
            f"{fmt_bytes(r['rss'])} | "
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
            "reference sequences, which is not counted). The targets generate the prompts of one length together "
            "(16 at a time by default: 64 decode steps of 16 rows instead of 1,024 of one row, each through "
            "transformers' model with its KV and Gated-DeltaNet cache) and the MTP drafts from every row of a "
            "sequence at once (`mtpquant.mtp.drafting.draft_rows`, k passes per sequence instead of k per visited "
            "row); the `--batch-size 1` row generates one prompt at a time (its MTP drafting is batched as in the "
            "other rows). Tokens and AL are those of one prompt at a time, and so are the hidden states, bit for bit, "
            "on this dense model (MoE experts: within float rounding; tests/test_validate.py). Absolute times vary "
            "with the load of the shared machine "
            "(above).",
        ]
    )
    print(section)
    if not args.no_write:
        write_section(HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
