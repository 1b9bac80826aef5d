"""``mtpquant demo``: the product's whole story on an embedded checkpoint, ending in a decision.

Converts a shipped tiny model whose MTP is trained (``--family qwen3_5``, the default: tiny Qwen3.5;
``--family qwen4_exp``: tiny Qwen3.8-Flash-Next; ``--family glm4_moe``: tiny GLM-4.5 layout) to NVFP4 with
``--keep-mtp`` and validates the quant's MTP drafts against the source; heals the quant's MTP in place against its
own NVFP4 target (written only if better beyond noise) and validates it again; inspects it and ends with a decision:
whether the quant is ready to publish, and why.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from mtpquant.cli import add_device_argument, exit_codes_epilog
from mtpquant.errors import ExitCode

if TYPE_CHECKING:
    from mtpquant.records.validation import Report

# The demo's calibration: 16 rows of 128 tokens, so a CPU converts the tiny model in seconds.
CALIB_SAMPLES = 16
CALIB_SEQ_LEN = 128

_EPILOG = """\
examples:
  mtpquant demo
  mtpquant demo --family qwen4_exp --workdir /tmp/demo
  mtpquant demo --family glm4_moe --num-prompts 32
  mtpquant demo --no-heal --num-prompts 32

""" + exit_codes_epilog(
    ExitCode.OUTPUT_BUSY,
    ExitCode.MEMORY,
    ExitCode.VERIFICATION,
    ExitCode.VALIDATE_FAIL,
    ExitCode.VALIDATE_INCONCLUSIVE,
    ExitCode.INSPECT_MTP,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="convert --keep-mtp, validate, heal, validate again and inspect the embedded tiny model",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where outputs go (default runs/demo)")
    add_device_argument(p, "auto", indexed=False)
    p.add_argument("--num-prompts", type=int, default=64, help="validation prompts (default 64)")
    p.add_argument(
        "--family",
        choices=("qwen3_5", "qwen4_exp", "glm4_moe"),
        default="qwen3_5",
        help="which embedded model (default qwen3_5)",
    )
    p.add_argument("--no-heal", dest="heal", action="store_false", help="stop after the first validation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert, validate, heal, validate, inspect; print each step's summary and the decision."""
    from mtpquant.api import (
        TINY_MTP_ASSETS,
        ConvertOptions,
        HealOptions,
        ValidateOptions,
        convert,
        heal,
        inspect_checkpoint,
        validate,
    )
    from mtpquant.errors import HealNotBetterError, HealRefusedError
    from mtpquant.render import convert_text, decision_text, heal_text, inspect_text, validate_text

    asset = TINY_MTP_ASSETS[args.family]
    quant = args.workdir / f"tiny-{args.family}-nvfp4"
    progress = not args.quiet
    print(f"== convert {asset.name} -> {quant} (NVFP4, --keep-mtp)")
    result = convert(
        ConvertOptions(
            src=str(asset),
            out=quant,
            mtp="keep",
            calib_samples=CALIB_SAMPLES,
            calib_seq_len=CALIB_SEQ_LEN,
            device=args.device,
            overwrite=True,
            progress=progress,
            command=("mtpquant", "convert", str(asset), str(quant), "--keep-mtp"),
        )
    )
    print(convert_text(result))

    def validated() -> Report:
        print(f"\n== validate {asset.name} (reference) vs {quant.name} (candidate)")
        report = validate(
            ValidateOptions(
                reference=str(asset),
                candidate=str(quant),
                num_prompts=args.num_prompts,
                report_dir=quant / "validation",
                device=args.device,
                progress=progress,
            )
        )
        print(validate_text(report.report, quant / "validation"))
        return report.report

    steps = [("converted", validated())]
    if args.heal:
        print(f"\n== heal {quant} --in-place (its MTP re-aligned to its NVFP4 target)")
        try:
            healed = heal(
                HealOptions(
                    quant=str(quant),
                    source=str(asset),
                    in_place=True,
                    device=args.device,
                    progress=progress,
                    command=("mtpquant", "heal", str(quant), "--from", str(asset), "--in-place"),
                )
            )
        except (HealNotBetterError, HealRefusedError) as exc:
            print(f"heal wrote nothing: {exc}")
        else:
            print(heal_text(healed))
            steps.append(("healed", validated()))
    print(f"\n== inspect {quant}")
    inspection = inspect_checkpoint(quant)
    print(inspect_text(inspection))
    print("\n" + decision_text(quant, steps, inspection))
    final = steps[-1][1].verdict
    return final.exit_code if final.exit_code else (0 if inspection.healthy else inspection.exit_code())
