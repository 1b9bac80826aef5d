"""``mtpquant inspect PATH|REPO_ID``."""

from __future__ import annotations

import argparse
import json
import os

from mtpquant.errors import ExitCode
from mtpquant.render import inspect_text

EXIT_INDEX, EXIT_FORMAT = int(ExitCode.INSPECT_INDEX), int(ExitCode.INSPECT_FORMAT)
EXIT_DECLARED_MISSING, EXIT_EXCLUSIONS = int(ExitCode.INSPECT_MTP), int(ExitCode.INSPECT_EXCLUSIONS)

EPILOG = f"""exit codes: 0 healthy; {EXIT_INDEX} index corrupt; {EXIT_FORMAT} an engine refuses the quantization
format; {EXIT_DECLARED_MISSING} MTP declared but missing (or incomplete, or present but undeclared);
{EXIT_EXCLUSIONS} exclusions inconsistent with the tensors (the most severe FAIL finding decides). --strict also
counts warnings that carry one of these causes (e.g. an MTP that loads only through vLLM's mtp.fc workaround).
Errors reading the checkpoint (bad header, no config) exit 3. All exit codes: `mtpquant --help`."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``inspect`` subcommand."""
    p = sub.add_parser(
        "inspect",
        help="is MTP in the checkpoint, in what precision, and will vLLM/SGLang load it?",
        description="Reads only config.json, hf_quant_config.json, the index and safetensors headers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        print(inspect_text(report))
    return report.exit_code(strict=args.strict)
