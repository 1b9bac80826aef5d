"""``mtpquant convert SRC OUT``: NVFP4 through nvidia-modelopt, the MTP kept, quantized, extracted or dropped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from mtpquant.cli import (
    READ_CODES,
    WRITE_CODES,
    add_base_model_arguments,
    add_command,
    add_device_argument,
    options_from,
    progress_bars,
)
from mtpquant.cli.heal_args import add_schedule_arguments, check_schedule_values, schedule_options
from mtpquant.cli.search_args import add_search_arguments, search_settings
from mtpquant.convert.options import ConvertOptions  # torch-free: the defaults and choices at start-up
from mtpquant.errors import ExitCode
from mtpquant.records.record import field_choices, field_default
from mtpquant.units import format_bytes

EXAMPLES = """\
examples:
  mtpquant convert Qwen/Qwen3.5-4B ./Qwen3.5-4B-NVFP4-MTP
  mtpquant convert Qwen/Qwen3.5-4B ./Qwen3.5-4B-NVFP4-MTP --dry-run
  mtpquant convert ./Qwen3.5-27B ./Qwen3.5-27B-NVFP4-MTP --mtp quantize --max-memory cpu=48GiB
  mtpquant convert ./Qwen3.5-27B ./Qwen3.5-27B-NVFP4 --mtp extract --format compressed-tensors
  mtpquant convert Qwen/Qwen3.5-4B ./Qwen3.5-4B-NVFP4-MTP --calib-data calib.jsonl --heal

MTP modes (default: keep when SRC has an MTP, else drop):
  keep      every mtp.* tensor copied byte for byte into mtp-*.safetensors, excluded as mtp*
  quantize  MTP Linears to NVFP4 (or --mtp-format fp8) with calibrated input scales; mtp.fc, norms,
            router and shared_expert_gate stay BF16. vLLM serves it; SGLang loads it as FP8 (MIXED_PRECISION)
            or compressed-tensors NVFP4, not as ModelOpt NVFP4 (it builds that MTP in BF16).
  extract   OUT without MTP (declaration set to 0); the MTP goes to --mtp-out (default OUT-mtp)
  drop      no MTP in OUT, declaration set to 0
  auto      the precision of each MTP group (input projection, attention, MLP or shared expert, routed
            experts) chosen among BF16, FP8 and NVFP4: candidates selected on held-out prompts, the
            smallest confirmed on other held-out prompts (Holm over the finalists) within --al-budget of
            the BF16 MTP's AL at k = 1..3, predicted on the quantized main model, loadable by --engine;
            --al-budget 0 writes the BF16 MTP byte for byte; the report goes to OUT/mtp_search/ (in a
            recipe: mtp.mode: search)

Calibration data (default: offline text shipped with CPython, tokenised with SRC's tokenizer and chat
template): --calib-data FILE (.txt paragraphs, or .jsonl with "text" or "messages"), or a `datasets`
name (needs the datasets package).

"""
EXIT_CODES = (
    *READ_CODES,
    *WRITE_CODES,
    ExitCode.INDIVISIBLE,
    ExitCode.SOURCE_QUANTIZED,
    ExitCode.OUTPUT_BUSY,
    ExitCode.MEMORY,
    ExitCode.HEAL_NOT_BETTER,
    ExitCode.HEAL_REFUSED,
    ExitCode.GRAFT_REFUSED,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``convert`` subcommand."""
    p = add_command(
        sub,
        "convert",
        summary="quantize a BF16 Qwen checkpoint to NVFP4 with modelopt, keeping its MTP layer",
        description=(
            "Quantize SRC (a local directory or a Hub repo id) to NVFP4 through nvidia-modelopt and write OUT. "
            "Nothing appears at OUT until the output is complete and verified (inspect verdict clean)."
        ),
        examples=EXAMPLES,
        codes=EXIT_CODES,
    )
    p.add_argument("src", metavar="SRC", help="source checkpoint: local directory or Hub repo id (org/name)")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--recipe", metavar="NAME|PATH", help="built-in recipe name or YAML file (default: by family)")
    p.add_argument("--mtp", choices=field_choices(ConvertOptions, "mtp"), help="what to do with the MTP layer")
    p.add_argument("--keep-mtp", action="store_true", help="same as --mtp keep")
    p.add_argument("--mtp-format", choices=field_choices(ConvertOptions, "mtp_format"),
                   help="format of the MTP Linears with --mtp quantize")
    layout = field_default(ConvertOptions, "output_format")
    p.add_argument(
        "--format",
        dest="output_format",
        choices=field_choices(ConvertOptions, "output_format"),
        default=layout,
        help=f"checkpoint layout: modelopt or compressed-tensors (nvfp4-pack-quantized, as llm-compressor); default "
        f"{layout}",
    )
    p.add_argument("--mtp-out", metavar="DIR", type=Path, help="where --mtp extract writes the MTP (default OUT-mtp)")
    add_search_arguments(p, when="--mtp auto: ")
    p.add_argument("--calib-data", metavar="PATH|DATASET", help="calibration text (default: offline CPython text)")
    p.add_argument("--calib-samples", metavar="N", type=int, help="calibration rows (default: the recipe's)")
    p.add_argument("--calib-seq-len", metavar="L", type=int, help="tokens per calibration row (default: the recipe's)")
    add_device_argument(p, field_default(ConvertOptions, "device"), indexed=False,
                        what="cuda uses accelerate device_map=auto (GPU sharding, CPU/disk offload): ")
    p.add_argument(
        "--max-memory",
        metavar="SPEC",
        help="per-device memory caps, e.g. cpu=8GiB or cuda:0=70GiB,cpu=200GiB: what does not fit stays on disk "
        "(read from SRC's files) and calibration runs layer by layer (default: in memory when it fits, else "
        "capped at 80%% of the free memory)",
    )
    p.add_argument(
        "--layerwise",
        action="store_true",
        help="calibrate layer by layer (resumable after a kill) even when the model fits in memory",
    )
    p.add_argument(
        "--resume-every",
        type=int,
        metavar="N",
        help="layer-wise calibration: commit the resume state every N layers, so a kill redoes at most N (default: "
        "as often as keeps the saved layer inputs within 5%% of the output)",
    )
    p.add_argument("--max-shard-size", metavar="SIZE", help="output shard budget, e.g. 5GB, 500MiB (default: the "
                   f"recipe's, {format_bytes(DEFAULT_MAX_SHARD_BYTES)} unless it says)")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a recipe value, e.g. --set calibration.batch_size=4 (repeatable)",
    )
    p.add_argument("--revision", help="Hub revision of SRC (branch, tag or commit)")
    add_base_model_arguments(p)
    p.add_argument(
        "--heal",
        action="store_true",
        help="then heal OUT's MTP against OUT's own quantized target (`mtpquant heal OUT --from SRC --in-place`); "
        "exit 24 when the healed MTP is not better beyond noise at the served k (--heal-k) or worse at some k (OUT "
        "stays as converted). With --mtp auto: each "
        "finalist of the search is healed before the choice, and the chosen MTP is written healed",
    )
    add_schedule_arguments(p, prefix="heal-")
    p.add_argument("--heal-force", action="store_true",
                   help="with --heal: write the healed MTP even if the check does not show it better (`heal --force`)")
    p.add_argument("--heal-k", type=int, metavar="K",
                   help="with --heal: the k you serve; the check measures k = 1..K and decides at K (`heal --k`, "
                   "default 3)")
    p.add_argument("--heal-strict", action="store_true",
                   help="with --heal: write only when better beyond noise at every k = 1..K (`heal --strict`)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (from headers only) and write nothing")
    p.add_argument("--overwrite", action="store_true", help="replace OUT (and --mtp-out) if they exist")
    p.add_argument("--json", action="store_true", help="print the result (or plan) as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Convert and print the summary."""
    import logging

    from mtpquant.api import convert
    from mtpquant.errors import RecipeError
    from mtpquant.render import convert_text

    if args.keep_mtp and args.mtp not in (None, "keep"):
        raise RecipeError(f"--keep-mtp contradicts --mtp {args.mtp}")
    heal_flags = [f"--heal-{key.replace('_', '-')}" for key in schedule_options(args)]
    check_flags = [flag for flag, given in (("--heal-force", args.heal_force), ("--heal-k", args.heal_k is not None),
                                            ("--heal-strict", args.heal_strict)) if given]
    if not args.heal and (heal_flags or check_flags):  # would be ignored: refused
        raise RecipeError(f"{(heal_flags or check_flags)[0]} is only used with --heal")
    search, search_flags = search_settings(args)
    if search_flags and args.mtp != "auto":
        raise RecipeError(f"{search_flags[0]} is only used with --mtp auto")
    if args.heal and args.mtp == "auto" and (check_flags or args.heal_check_prompts is not None):
        flag = check_flags[0] if check_flags else "--heal-check-prompts"
        raise RecipeError(f"{flag} is not used with --mtp auto: the search measures each healed finalist itself "
                          "(--search-prompts) and writes the chosen one only within the budget")
    heal_options = _heal_options(args) if args.heal else None
    if heal_options is not None:
        check_schedule_values(heal_options)  # now, before the imports; what needs SRC's headers in convert's plan
    options = options_from(
        ConvertOptions,
        args,
        out=Path(args.out),
        mtp="keep" if args.keep_mtp else args.mtp,
        overrides=tuple(args.overrides),
        progress=progress_bars(),
        search=search,
    )
    # The summary is printed below; keep the library's copy of it out of the log.
    logging.getLogger("mtpquant.convert.run.summary").setLevel(logging.WARNING)
    if heal_options is None:
        result, healed = convert(options), None
    else:
        from mtpquant.api import convert_and_heal

        show = None if args.json else (lambda converted: print(convert_text(converted), flush=True))
        result, healed = convert_and_heal(options, heal_options, on_converted=show)
    if args.json:
        data = result.plan.to_json() if result.dry_run else result.to_json()
        if healed is not None:
            data = {"convert": data, "heal": healed.to_json()}
        print(json.dumps(data, indent=2, default=str))
        return 0
    if heal_options is None:
        print(convert_text(result))
    if healed is not None:
        from mtpquant.render import heal_text

        print(heal_text(healed))
    elif args.heal and args.mtp == "auto":
        print("heal       each finalist of the search healed before the choice (mtp_search/report.md: its AL before "
              "and after)" + ("" if result.dry_run else "; the chosen MTP is written healed"))
    elif args.heal:
        print("heal       after the conversion: mtpquant heal OUT --from SRC --in-place (planned once OUT exists)")
    return 0


def _heal_options(args: argparse.Namespace) -> Any:
    """``convert --heal``'s heal: OUT in place against SRC (convert's plan refuses what it would refuse)."""
    from mtpquant.api import HealOptions

    return HealOptions(
        quant=Path(args.out).expanduser(),
        source=args.src,
        in_place=True,
        device=args.device,
        max_memory=args.max_memory,
        source_revision=args.revision,
        force=args.heal_force,
        strict=args.heal_strict,
        progress=progress_bars(),
        **({} if args.heal_k is None else {"k": args.heal_k}),
        command=args.command_line,
        **schedule_options(args),
    )
