"""``mtpquant inspect PATH|REPO_ID``."""

from __future__ import annotations

import argparse
import json
import os

from mtpquant.cli import MTP_KIND_CODES, READ_CODES, add_command
from mtpquant.errors import ExitCode

EXAMPLES = """\
examples:
  mtpquant inspect nvidia/Qwen3.5-397B-A17B-NVFP4
  mtpquant inspect ./Qwen3.5-27B-NVFP4 --json
  mtpquant inspect my-org/Qwen3.5-4B-NVFP4-MTP --revision v2 --strict

The most severe FAIL finding decides the exit code (index, then format, then MTP, then exclusions);
--strict also counts warnings that carry one of these causes (e.g. an MTP that loads only through vLLM's mtp.fc
workaround). Errors reading the checkpoint (bad header, no config) are exit 3.

"""
EXIT_CODES = (
    *READ_CODES,
    *MTP_KIND_CODES,
    ExitCode.INSPECT_MTP,
    ExitCode.INSPECT_EXCLUSIONS,
    ExitCode.INSPECT_INDEX,
    ExitCode.INSPECT_FORMAT,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    p = add_command(
        sub,
        "inspect",
        summary="is MTP in the checkpoint, in what precision, and will vLLM/SGLang load it?",
        description="Reads only config.json, hf_quant_config.json, the index and safetensors headers.",
        examples=EXAMPLES,
        codes=EXIT_CODES,
    )
    p.add_argument("checkpoint", help="local directory or Hub repo id (org/name)")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    p.add_argument("--json", action="store_true", help="print the JSON report (schema: docs/inspect.md)")
    p.add_argument("--strict", action="store_true", help="warnings with a cause also set the exit code (see below)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Inspect and print."""
    from mtpquant.api import inspect_checkpoint

    report = inspect_checkpoint(args.checkpoint, revision=args.revision, token=os.environ.get("HF_TOKEN"))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        from mtpquant.render import inspect_text  # the text form only: --json and --help do not load it

        print(inspect_text(report))
    return report.exit_code(strict=args.strict)
