"""``mtpquant heal QUANT --from SRC``: re-align the MTP to the quantized model (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from mtpquant.cli import (
    HUB_CODES,
    add_command,
    add_device_argument,
    add_dtype_argument,
    add_sampling_arguments,
    add_shard_size_argument,
)
from mtpquant.cli.heal_args import add_schedule_arguments, schedule_options
from mtpquant.errors import ExitCode
from mtpquant.heal.options import DATA_TEMPERATURE, HealOptions  # torch-free: the defaults at start-up
from mtpquant.records.record import field_choices, field_default

__all__ = ["register"]

_EXAMPLES = """\
examples:
  mtpquant heal ./Qwen3.6-27B-NVFP4 --from Qwen/Qwen3.6-27B --in-place
  mtpquant heal ./quant --from ./bf16-source --out ./quant-healed --steps 400 --lr 2e-4
  mtpquant heal ./quant --from ./bf16-source --in-place --dry-run --max-memory cpu=3GiB
  mtpquant heal ./quant --from ./bf16-source --out ./quant-healed --temperature 0 0.7

Only the mtp.* weights train (trunk, embeddings and LM head frozen), by self-distillation: the MTP's distribution
for x_{t+2} from (h_t of the quantized target, embedding of x_{t+1}) is fitted to the quantized target's own
distribution at t+1, on text the quantized target produces from the calibration prompts (greedily and at
the first sampled --temperature, else 0.7). A BF16 MTP stays BF16; an NVFP4/FP8 MTP trains with modelopt's fake
quantization in the loop and is written back in the same format and scales layout. Before anything is written, the
MTP's AL is measured before and after on held-out prompts (validate's built-in replay) at each sampling setting
given (greedy by default; --temperature 0 0.7: greedy and sampled at 0.7, as validate measures), for k = 1..K
(--k, default 3: the k you serve, e.g. --speculative-num-steps 3). The decision line names each k's verdict (better,
no change, worse: the change and its 95 % interval). Nothing is written unless the healed MTP is better beyond noise
at the served k = K of the first setting and worse beyond noise at no k of any (a heal that helps greedy acceptance
and hurts sampled acceptance is refused); --strict: better beyond noise at every k = 1..K.

"""
_EXIT_CODES = (
    ExitCode.CHECKPOINT,
    ExitCode.ARCHITECTURE,
    ExitCode.OUTPUT_EXISTS,
    ExitCode.VERIFICATION,
    ExitCode.LINEAGE,
    ExitCode.OUTPUT_BUSY,
    ExitCode.MEMORY,
    ExitCode.HEAL_NOT_BETTER,
    ExitCode.HEAL_REFUSED,
    *HUB_CODES,
)


def register(subparsers: Any) -> None:
    """Add the ``heal`` subcommand."""
    p = add_command(
        subparsers,
        "heal",
        summary="re-align a quant's MTP to its quantized model (self-distillation), written only if it is better",
        description=(
            "Fine-tune only QUANT's mtp.* weights against QUANT's own quantized target, check the MTP's acceptance "
            "before and after on held-out prompts, and write the healed MTP (only its bytes, atomically, in QUANT's "
            "precision) only when it is better beyond noise."
        ),
        examples=_EXAMPLES,
        codes=_EXIT_CODES,
    )
    p.add_argument("quant", metavar="QUANT", help="the quant whose MTP to heal: a local directory or a Hub repo id")
    p.add_argument("--from", dest="source", metavar="SRC", required=True,
                   help="the BF16 checkpoint QUANT was made from (lineage; a quantized MTP trains from its weights)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="OUT", help="write the healed checkpoint here (must not exist)")
    where.add_argument("--in-place", action="store_true",
                       help="heal QUANT itself: built beside it, verified, then swapped in atomically")
    add_schedule_arguments(p)
    p.add_argument("--k", type=int, metavar="K",
                   help="the k you serve: the check measures AL for k = 1..K and decides at K "
                   f"(default {field_default(HealOptions, 'k')})")
    p.add_argument("--strict", action="store_true",
                   help="write only when the healed MTP is better beyond noise at every k = 1..K, not only at K")
    add_sampling_arguments(
        p, HealOptions, "the check measures at each T, the target sampling the held-out continuations with seed "
        "--seed + prompt index (0: greedy, the default); the healed MTP must be better at the first and worse at "
        f"none; the first sampled T is also the training data's (default {DATA_TEMPERATURE:g})"
    )
    p.add_argument("--force", action="store_true",
                   help="write the healed MTP even if the check does not show it better (the provenance says so)")
    add_device_argument(p, field_default(HealOptions, "device"), indexed=True)
    add_dtype_argument(p)
    p.add_argument("--max-memory", metavar="SPEC",
                   help="memory caps for the quantized target, e.g. cpu=3GiB: what does not fit is read from QUANT's "
                   "files and dequantized when its layer runs")
    activations = field_default(HealOptions, "activations")
    p.add_argument("--activations", choices=field_choices(HealOptions, "activations"), default=activations,
                   help=f"emulate W4A4 activation quantization as the engines run it, or off (default {activations})")
    p.add_argument("--revision", metavar="REV", help="QUANT's Hub revision")
    p.add_argument("--from-revision", dest="source_revision", metavar="REV", help="SRC's Hub revision")
    add_shard_size_argument(p)
    p.add_argument("--copy", action="store_true", help="copy untouched files instead of hard-linking them")
    p.add_argument("--dry-run", action="store_true", help="print the plan (memory and disk too) and write nothing")
    p.add_argument("--json", action="store_true", help="print the result (or plan) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build the options, call the API, print the summary."""
    extra: dict[str, Any] = schedule_options(args)
    if args.k is not None:
        extra["k"] = args.k
    options = HealOptions(
        quant=args.quant,
        source=args.source,
        out=args.out,
        in_place=args.in_place,
        force=args.force,
        strict=args.strict,
        device=args.device,
        dtype=args.dtype,
        max_memory=args.max_memory,
        activations=args.activations,
        temperatures=tuple(args.temperature),
        top_p=tuple(args.top_p),
        top_k=tuple(args.top_k),
        rule=args.rule,
        revision=args.revision,
        source_revision=args.source_revision,
        max_shard_bytes=args.max_shard_size,
        link=not args.copy,
        dry_run=args.dry_run,
        progress=os.environ.get("TQDM_DISABLE", "") in {"", "0"},
        command=args.command_line,
        **extra,
    )
    options.check()  # a bad value or an existing OUT: refused at once, before heal's imports load torch
    from mtpquant.api import heal
    from mtpquant.render import heal_text

    result = heal(options)
    if args.json:
        print(json.dumps(result.plan.to_json() if args.dry_run else result.to_json(), indent=2, default=str))
        return 0
    print(heal_text(result))
    return 0
