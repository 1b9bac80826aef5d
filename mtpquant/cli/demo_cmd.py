"""``mtpquant demo``: the main job on the embedded default checkpoint."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mtpquant.inspect.render import render_text
from mtpquant.inspect.report import inspect_checkpoint
from mtpquant.synth.tiny import make_tiny_checkpoint

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser("demo", help="run the main job on the embedded tiny checkpoint")
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="where outputs go (default runs/demo)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the tiny default checkpoint and inspect it."""
    src = args.workdir / "source"
    if not src.exists():
        make_tiny_checkpoint(src, "qwen3_5")
    report = inspect_checkpoint(src)
    print(render_text(report))
    return 0 if report.healthy else 1
