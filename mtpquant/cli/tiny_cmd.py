"""``mtpquant tiny OUT``: write a tiny random-weight checkpoint in a real Qwen layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from mtpquant.synth.tiny import TINY_VARIANTS  # torch-free: the choices at start-up


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``tiny`` subcommand."""
    p = sub.add_parser("tiny", help="write a tiny random-weight checkpoint in a real Qwen layout (for tests/demos)")
    p.add_argument("out", type=Path)
    p.add_argument("--variant", choices=sorted(TINY_VARIANTS), default="qwen3_5")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the checkpoint and print its path."""
    from mtpquant.api import make_tiny_checkpoint

    path = make_tiny_checkpoint(args.out, args.variant, overwrite=args.overwrite)
    print(path)
    return 0
