"""``mtpquant validate REFERENCE [CANDIDATE]``: MTP acceptance before/after quantization, with a report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mtpquant.errors import ExitCode
from mtpquant.validate import ACTIVATION_MODES

EXIT_BY_STATUS = {"pass": ExitCode.OK, "warn": ExitCode.VALIDATE_WARN, "fail": ExitCode.VALIDATE_FAIL}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand."""
    p = sub.add_parser(
        "validate",
        help="measure what speculative decoding with the MTP accepts (one checkpoint, or before vs after)",
        description=(
            "With one checkpoint: its MTP acceptance per draft position, acceptance rate and mean acceptance "
            "length for k = 1..K under greedy verification. With REFERENCE and CANDIDATE: both, plus MTP and "
            "main-model top-1 agreement and KL(ref || cand) on identical inputs, and a verdict. "
            f"Exit status: 0 pass, {int(ExitCode.VALIDATE_WARN)} warn, {int(ExitCode.VALIDATE_FAIL)} fail."
        ),
    )
    p.add_argument("reference", help="checkpoint directory or Hub repo id (alone: the checkpoint to evaluate)")
    p.add_argument("candidate", nargs="?", help="the quantized checkpoint to compare against REFERENCE")
    p.add_argument("--prompts", type=Path, help="prompt file: .jsonl ({'text': ...}) or text blocks")
    p.add_argument("--num-prompts", type=int, default=32, help="number of prompts (default 32)")
    p.add_argument(
        "--max-len", type=int, default=128, help="tokens per sequence: prompt (<= half) + greedy continuation"
    )
    p.add_argument("--k", type=int, default=3, help="evaluate k = 1..K drafts per step (default 3)")
    p.add_argument("--report-dir", type=Path, help="write report.json, report.md and plots here")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: fp32 CPU, bf16 CUDA)"
    )
    p.add_argument("--activations", choices=ACTIVATION_MODES, default="off", help="emulate: W4A4 activation fake-quant")
    p.add_argument(
        "--save-hidden", type=Path, metavar="FILE", help="save target hidden states and tokens (safetensors)"
    )
    p.add_argument("--hidden", type=Path, metavar="FILE", help="use saved target hidden states instead of the targets")
    p.add_argument("--warn-al-drop", type=float, default=0.1, help="warn when AL drops more than this (default 0.1)")
    p.add_argument("--json", action="store_true", help="print report.json to stdout instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run validate and print the acceptance table (or the JSON report)."""
    from mtpquant.api import ValidateOptions, validate
    from mtpquant.render import validate_text

    opts = ValidateOptions(
        reference=args.reference,
        candidate=args.candidate,
        prompts_file=args.prompts,
        num_prompts=args.num_prompts,
        max_len=args.max_len,
        k=args.k,
        report_dir=args.report_dir,
        device=args.device,
        dtype=args.dtype,
        activations=args.activations,
        save_hidden=args.save_hidden,
        hidden=args.hidden,
        warn_al_drop=args.warn_al_drop,
        progress=not args.quiet,
    )
    report = validate(opts)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(validate_text(report.report, args.report_dir))
    return int(EXIT_BY_STATUS[report.status])
