"""``mtpquant families``: every family the registry knows, where its MTP lives, and what works on it."""

from __future__ import annotations

import argparse
import json

from mtpquant.cli import add_command

EXAMPLES = """\
examples:
  mtpquant families
  mtpquant families --json

"""


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``families`` subcommand."""
    p = add_command(
        sub,
        "families",
        summary="list the model families mtpquant knows: drafters, where the MTP lives, what works",
        description=(
            "Print the registry as a table: each family's model types, the vLLM and SGLang drafter classes of its\n"
            "MTP, where the MTP lives in published checkpoints, its depth key, and which commands work on it\n"
            "(inspect, graft, extract, graft --fix-metadata, convert, validate, heal, search). An architecture the\n"
            "registry does not know but whose config declares an MTP still gets inspect's generic checks."
        ),
        examples=EXAMPLES,
        codes=(),
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON (one object per family)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the catalogue."""
    from mtpquant.families.catalogue import catalogue, render_markdown

    if args.json:
        print(json.dumps([r.to_json() for r in catalogue()], indent=1))
    else:
        print(render_markdown(), end="")
    return 0
