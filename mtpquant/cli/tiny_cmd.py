"""``mtpquant tiny OUT``: write a tiny random-weight checkpoint in a real Qwen layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtpquant.cli import add_command
from mtpquant.errors import ExitCode
from mtpquant.synth.tiny import TINY_VARIANTS  # torch-free: the choices at start-up

EXAMPLES = """\
examples:
  mtpquant tiny ./tiny-qwen3_5
  mtpquant tiny ./tiny-moe --variant qwen3_5_moe --overwrite

"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``tiny`` subcommand."""
    p = add_command(
        sub,
        "tiny",
        summary="write a tiny random-weight checkpoint in a real Qwen layout (for tests/demos)",
        description=(
            "Write a tiny checkpoint (a few MB, random weights) with the tensor names, shapes, shards, configs\n"
            "and tokenizer of a real Qwen layout: something to try every command on in seconds. Prints its path."
        ),
        examples=EXAMPLES,
        codes=(ExitCode.OUTPUT_EXISTS,),
    )
    p.add_argument("out", type=Path, metavar="OUT", help="the directory to write (must not exist unless --overwrite)")
    p.add_argument(
        "--variant",
        choices=sorted(TINY_VARIANTS),
        default="qwen3_5",
        help="the family's layout (default qwen3_5); -tied: tied embeddings, -text: no vision tower, -alias: the "
        "day-0 architecture label",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it is a checkpoint directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the checkpoint and print its path."""
    from mtpquant.api import make_tiny_checkpoint

    path = make_tiny_checkpoint(args.out, args.variant, overwrite=args.overwrite)
    print(path)
    return 0
