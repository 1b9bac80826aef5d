"""``mtpquant demo``: the main job on an embedded checkpoint.

Converts a shipped tiny model whose MTP is trained (``--family qwen3_5``, the default: tiny Qwen3.5;
``--family qwen4_exp``: tiny Qwen3.8-Flash-Next) to NVFP4 with ``--keep-mtp``, validates the quant's MTP drafts
against the source, writes the report into the output, and inspects it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mtpquant.cli import exit_codes_epilog
from mtpquant.errors import ExitCode

EXAMPLES = """\
examples:
  mtpquant demo
  mtpquant demo --family qwen4_exp --workdir /tmp/mtpquant-demo

"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="convert --keep-mtp, validate and inspect the embedded tiny model",
        description=__doc__,
        epilog=EXAMPLES
        + exit_codes_epilog(
            ExitCode.OUTPUT_BUSY, ExitCode.MEMORY, ExitCode.VERIFICATION, ExitCode.VALIDATE_FAIL, ExitCode.INSPECT_MTP
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where outputs go (default runs/demo)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--num-prompts", type=int, default=16, help="validation prompts (default 16)")
    p.add_argument(
        "--family", choices=("qwen3_5", "qwen4_exp"), default="qwen3_5", help="which embedded model (default qwen3_5)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert, validate, inspect; print each step's summary."""
    from mtpquant.api import (
        TINY_MTP_ASSETS,
        ConvertOptions,
        ValidateOptions,
        convert,
        inspect_checkpoint,
        validate,
    )
    from mtpquant.render import convert_text, inspect_text, validate_text

    asset = TINY_MTP_ASSETS[args.family]
    out = args.workdir / f"tiny-{args.family}-nvfp4"
    print(f"== convert {asset.name} -> {out} (NVFP4, --keep-mtp)")
    result = convert(
        ConvertOptions(
            src=str(asset),
            out=out,
            mtp="keep",
            calib_samples=16,
            calib_seq_len=128,
            device=args.device,
            overwrite=True,
            progress=not args.quiet,
            command=("mtpquant", "convert", str(asset), str(out), "--keep-mtp"),
        )
    )
    print(convert_text(result))
    report_dir = out / "validation"
    print(f"\n== validate {asset.name} (reference) vs {out.name} (candidate)")
    report = validate(
        ValidateOptions(
            reference=str(asset),
            candidate=str(out),
            num_prompts=args.num_prompts,
            report_dir=report_dir,
            device=args.device,
            progress=not args.quiet,
        )
    )
    print(validate_text(report.report, report_dir))
    print(f"\n== inspect {out}")
    inspection = inspect_checkpoint(out)
    print(inspect_text(inspection))
    if not inspection.healthy:
        return inspection.exit_code()
    return report.report.verdict.exit_code if report.status == "fail" else 0
