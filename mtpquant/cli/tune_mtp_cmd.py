"""``mtpquant tune-mtp``: an existing quant's MTP re-quantized per precision group (parsing and printing only)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from mtpquant.cli import HUB_CODES, add_command, add_device_argument, add_shard_size_argument
from mtpquant.cli.heal_args import add_schedule_arguments, check_schedule_values, schedule_options
from mtpquant.cli.search_args import add_search_arguments, search_settings
from mtpquant.errors import ExitCode

__all__ = ["register"]

_EXAMPLES = """\
examples:
  mtpquant tune-mtp ./Qwen3.5-27B-NVFP4 --from Qwen/Qwen3.5-27B --out ./Qwen3.5-27B-NVFP4-small-mtp
  mtpquant tune-mtp ./Qwen3.5-27B-NVFP4 --from ./Qwen3.5-27B --in-place --al-budget 0.03 --engine any
  mtpquant tune-mtp ./Qwen3.5-27B-NVFP4 --from ./Qwen3.5-27B --out OUT --dry-run

QUANT's main model is the quantized target: the BF16 MTP of SRC and each precision group quantized (BF16, FP8,
NVFP4) draft on its hidden states over held-out prompts (the selection); the smallest candidates are confirmed on
other held-out prompts (Holm's procedure over them, family-wise error 5 %), and the smallest confirmed within
--al-budget of the BF16 MTP's AL at k = 1..3 that --engine loads is written in place of QUANT's MTP (only the MTP
bytes; the metadata's MTP entries replaced); --al-budget 0 writes SRC's BF16 MTP byte for byte. What QUANT's
recipe (or --recipe) leaves unquantized stays BF16 in the MTP too, as convert keeps it. The report goes to
mtp_search/ in the result. The same source, budget and calibration choose what `convert --mtp auto` chooses. With
--heal, each finalist is healed (heal's quantization-aware training, --heal-steps etc.) before it is confirmed, and
the chosen MTP is written healed.

"""
_EXIT_CODES = (
    ExitCode.CHECKPOINT,
    ExitCode.MEMORY,
    ExitCode.ARCHITECTURE,
    ExitCode.OUTPUT_EXISTS,
    ExitCode.MTP_MODE,
    ExitCode.VERIFICATION,
    ExitCode.LINEAGE,
    ExitCode.GRAFT_REFUSED,
    ExitCode.OUTPUT_BUSY,
    ExitCode.TUNE_REFUSED,
    *HUB_CODES,
)


def register(subparsers: Any) -> None:
    """Add the ``tune-mtp`` subcommand."""
    p = add_command(
        subparsers,
        "tune-mtp",
        summary="shrink a quant's MTP to the smallest precision per group that keeps its acceptance",
        description=(
            "Choose the precision of each MTP group of QUANT (input projection, attention, MLP or shared expert, "
            "routed experts) by measurement on QUANT's own quantized target, re-quantize the MTP from SRC's BF16 one "
            "and write only the MTP bytes."
        ),
        examples=_EXAMPLES,
        codes=_EXIT_CODES,
    )
    p.add_argument("quant", metavar="QUANT", help="the quant whose MTP to tune: a local directory (ModelOpt NVFP4)")
    p.add_argument("--from", dest="source", required=True, metavar="SRC",
                   help="its BF16 source, which holds the MTP to quantize: a directory or Hub repo id")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="OUT", help="write the tuned checkpoint here (must not exist)")
    where.add_argument("--in-place", action="store_true",
                       help="tune QUANT itself: built beside it, verified, then swapped in atomically")
    add_search_arguments(p)
    p.add_argument("--recipe", metavar="NAME|PATH",
                   help="the recipe QUANT is held to: what its quantization.exclude matches stays BF16 in the MTP, "
                   "and its calibration sets the MTP's input scales (default: QUANT's recipe.yaml, else the "
                   "family's default recipe)")
    p.add_argument("--calib-data", metavar="PATH|DATASET",
                   help="calibration text of the MTP's input scales (default: QUANT's recipe's)")
    p.add_argument("--calib-samples", metavar="N", type=int, help="calibration rows (default: QUANT's recipe's)")
    p.add_argument("--calib-seq-len", metavar="L", type=int, help="tokens per row (default: QUANT's recipe's)")
    add_device_argument(p, "auto", indexed=False, what="")
    p.add_argument("--max-memory", metavar="CAPS",
                   help="caps of QUANT's main model while the search measures on it, e.g. cpu=8GiB (convert's memory "
                   "plan: what does not fit is read from QUANT's files as it runs; default: all in memory when it "
                   "fits)")
    p.add_argument("--from-revision", dest="source_revision", metavar="REV", help="SRC's Hub revision")
    add_shard_size_argument(p)
    p.add_argument("--heal", action="store_true",
                   help="heal each finalist of the search (heal's quantization-aware training against QUANT's "
                   "target) before the choice, so the budget is met by the healed MTP, which is written")
    add_schedule_arguments(p, prefix="heal-")
    p.add_argument("--copy", action="store_true", help="copy untouched files instead of hard-linking them")
    p.add_argument("--dry-run", action="store_true", help="check and plan from headers, print the plan, write nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the options, call the API, print the summary."""
    from mtpquant.api import HealOptions, TuneOptions, tune_and_heal, tune_mtp
    from mtpquant.errors import UsageError
    from mtpquant.render import tune_text

    search, _ = search_settings(args)
    schedule = schedule_options(args)
    if schedule and not args.heal:
        raise UsageError(f"--heal-{next(iter(schedule)).replace('_', '-')} is only used with --heal")
    if "check_prompts" in schedule:
        raise UsageError("--heal-check-prompts is not used by tune-mtp: the search measures each healed finalist "
                         "itself (--search-prompts)")
    progress = os.environ.get("TQDM_DISABLE", "") in {"", "0"}
    heal = None
    if args.heal:  # heal's data and schedule; QUANT and SRC stand in for its (unused) checkpoint fields
        heal = HealOptions(quant=args.quant, source=args.source, in_place=True, device=args.device,
                           progress=progress, command=args.command_line, **schedule)  # fmt: skip
        check_schedule_values(heal)
    options = TuneOptions(
        quant=args.quant,
        source=args.source,
        out=args.out,
        in_place=args.in_place,
        search=search,
        recipe=args.recipe,
        calib_data=args.calib_data,
        calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len,
        device=args.device,
        max_memory=args.max_memory,
        source_revision=args.source_revision,
        max_shard_bytes=args.max_shard_size,
        link=not args.copy,
        dry_run=args.dry_run,
        progress=progress,
        command=args.command_line,
    )
    result = tune_mtp(options) if heal is None else tune_and_heal(options, heal)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, default=str))
        return 0
    print(tune_text(result))
    return 0
