"""``mtpquant extract``: a checkpoint's MTP into a sidecar of its own (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mtpquant.cli import MTP_COPY_CODES, add_command, add_report_flags, add_shard_size_argument, options_from

__all__ = ["register"]

_EXAMPLES = """\
examples:
  mtpquant extract ./DeepSeek-V3-bf16 --out ./DeepSeek-V3-MTP
  mtpquant extract deepseek-ai/DeepSeek-V3 --out ./DeepSeek-V3-NextN --nextn

(graft puts either back: mtpquant graft ./DeepSeek-V3-NVFP4 --from ./DeepSeek-V3-NextN --out ./DeepSeek-V3-NVFP4-MTP)

"""


def register(subparsers: Any) -> None:
    """Add the ``extract`` subcommand."""
    p = add_command(
        subparsers,
        "extract",
        summary="write a checkpoint's MTP into a sidecar of its own (graft puts it back)",
        description=(
            "Copy a checkpoint's MTP tensors byte for byte into a directory of their own: mtpquant's form (original\n"
            "names, mtp-*.safetensors, the source's config) or, with --nextn, SGLang's standalone NextN export of a\n"
            "DeepSeek MTP (layer 0, num_hidden_layers 1, no head / embedding copies). Reads only the MTP bytes."
        ),
        examples=_EXAMPLES,
        codes=MTP_COPY_CODES,
    )
    p.add_argument("source", metavar="SRC", help="the checkpoint with the MTP: a local directory or a Hub repo id")
    p.add_argument("--out", required=True, metavar="OUT", help="the sidecar directory to write (must not exist)")
    p.add_argument("--nextn", action="store_true", help="SGLang's standalone NextN form (DeepSeek-V3 / V3.2)")
    p.add_argument("--revision", metavar="REV", help="SRC's Hub revision (branch, tag or commit)")
    add_shard_size_argument(p, "byte budget per MTP shard")
    add_report_flags(p, "check and plan, write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the options, call the API, print the summary."""
    from mtpquant.api import ExtractOptions, extract_mtp

    result = extract_mtp(options_from(ExtractOptions, args, max_shard_bytes=args.max_shard_size))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(result.message)
    if result.shards:
        print(f"  shards: {', '.join(result.shards)}")
    return 0
