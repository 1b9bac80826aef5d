"""``mtpquant graft``: repair a quant that lost its MTP (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mtpquant.cli import MTP_COPY_CODES, add_command, add_report_flags, add_shard_size_argument, options_from
from mtpquant.errors import ExitCode

__all__ = ["register"]

_EXAMPLES = """\
examples:
  mtpquant graft ./Qwen3.5-27B-NVFP4 --from Qwen/Qwen3.5-27B --out ./Qwen3.5-27B-NVFP4-MTP
  mtpquant graft ./Qwen3.5-27B-NVFP4 --from ./Qwen3.5-27B --in-place
  mtpquant graft ./Qwen3.5-397B-A17B-NVFP4 --fix-metadata --in-place

"""
_EXIT_CODES = (
    *MTP_COPY_CODES,
    ExitCode.LINEAGE,
    ExitCode.GRAFT_REFUSED,
    ExitCode.OUTPUT_BUSY,
)


def register(subparsers: Any) -> None:
    """Add the ``graft`` subcommand."""
    p = add_command(
        subparsers,
        "graft",
        summary="add SRC's MTP to a quant that lost it, writing only the MTP bytes",
        description=(
            "Repair an existing quant whose MTP was dropped or mis-declared: copy SRC's mtp.* tensors "
            "byte for byte into new shard(s), hard-link every other file, rewrite the index and the MTP "
            "declaration and exclusions. --fix-metadata repairs declaration and exclusions only."
        ),
        examples=_EXAMPLES,
        codes=_EXIT_CODES,
    )
    p.add_argument("quant", metavar="QUANT", help="the quant to repair: a local directory or a Hub repo id")
    p.add_argument(
        "--from",
        dest="source",
        metavar="SRC",
        help="the checkpoint that still has the MTP (the BF16 original): directory or Hub repo id",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="OUT", help="write the repaired checkpoint here (must not exist)")
    where.add_argument(
        "--in-place",
        action="store_true",
        help="repair QUANT itself: built beside it, verified, then swapped in atomically "
        "(a kill leaves QUANT as it was, or repaired)",
    )
    p.add_argument("--replace", action="store_true", help="replace an MTP QUANT already has")
    p.add_argument(
        "--fix-metadata",
        action="store_true",
        help="repair the MTP declaration and exclusions only; touches no tensor file",
    )
    p.add_argument("--revision", metavar="REV", help="QUANT's Hub revision (branch, tag or commit)")
    p.add_argument("--from-revision", dest="source_revision", metavar="REV", help="SRC's Hub revision")
    add_shard_size_argument(p)
    p.add_argument("--copy", action="store_true", help="copy untouched files instead of hard-linking them")
    add_report_flags(p, "check and plan, print the plan, write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the options, call the API, print the summary."""
    from mtpquant.api import GraftOptions, graft  # graft.options: torch-free
    from mtpquant.render import graft_text

    options = options_from(GraftOptions, args, max_shard_bytes=args.max_shard_size, link=not args.copy)
    result = graft(options)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(graft_text(result))
    return 0
