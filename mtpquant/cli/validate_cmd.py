"""``mtpquant validate REFERENCE [CANDIDATE]``: MTP acceptance before/after quantization, with a report."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

from mtpquant.cli import (
    READ_CODES,
    add_command,
    add_device_argument,
    add_dtype_argument,
    add_sampling_arguments,
    options_from,
)
from mtpquant.engine.table import launchable
from mtpquant.errors import ExitCode
from mtpquant.records.record import field_choices, field_default
from mtpquant.validate.options import ValidateOptions  # torch-free: the defaults and choices at start-up

_D = partial(field_default, ValidateOptions)

EXAMPLES = """\
examples:
  mtpquant validate ./Qwen3.5-4B-NVFP4-MTP
  mtpquant validate Qwen/Qwen3.5-4B ./Qwen3.5-4B-NVFP4-MTP --report-dir ./Qwen3.5-4B-NVFP4-MTP/validation
  mtpquant validate Qwen/Qwen3.5-4B ./Qwen3.5-4B-NVFP4-MTP --temperature 0 0.7 --top-p 1 0.95 --k 3
  mtpquant validate ./Qwen3.5-4B-NVFP4-MTP --engine vllm --vllm-python /opt/vllm/bin/python --k 1,3
  mtpquant validate --server http://127.0.0.1:8000 --candidate-server http://127.0.0.1:8001

"""

EXIT_CODES = (
    *READ_CODES,
    ExitCode.OUTPUT_EXISTS,
    ExitCode.LINEAGE,
    ExitCode.VALIDATE_WARN,
    ExitCode.VALIDATE_FAIL,
    ExitCode.VALIDATE_INCONCLUSIVE,
    ExitCode.VALIDATE_BROKEN,
    ExitCode.ENGINE_UNREACHABLE,
    ExitCode.ENGINE_ANSWER,
    ExitCode.ENGINE_MODEL,
    ExitCode.ENGINE_SPEC_DECODE,
    ExitCode.ENGINE_START,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand."""
    p = add_command(
        sub,
        "validate",
        summary="measure what speculative decoding with the MTP accepts (one checkpoint, or before vs after)",
        description=(
            "With one checkpoint: its MTP acceptance per draft position, acceptance rate and mean acceptance "
            "length for k = 1..K under greedy verification, or sampled (--temperature). With REFERENCE and "
            "CANDIDATE: both, plus MTP and "
            "main-model top-1 agreement and KL(ref || cand) on identical inputs, and a verdict. "
            f"Exit status: 0 pass, {int(ExitCode.VALIDATE_WARN)} warn, {int(ExitCode.VALIDATE_FAIL)} fail (MTP missing "
            f"or drafting for nothing), {int(ExitCode.VALIDATE_BROKEN)} fail (the candidate is broken), "
            f"{int(ExitCode.VALIDATE_INCONCLUSIVE)} inconclusive (too few prompts to decide)."
        ),
        examples=EXAMPLES,
        codes=EXIT_CODES,
    )
    p.add_argument(
        "reference", nargs="?", help="checkpoint directory or Hub repo id (alone: the checkpoint to evaluate)"
    )
    p.add_argument("candidate", nargs="?", help="the quantized checkpoint to compare against REFERENCE")
    p.add_argument("--prompts", type=Path, help="prompt file: .jsonl ({'text': ...}) or text blocks")
    _defaulted(p, "--num-prompts", "number of prompts (default {})", type=int)
    _defaulted(p, "--max-len", "tokens per sequence: prompt (<= half) + greedy continuation (default {})", type=int)
    p.add_argument(
        "--k",
        type=_ks,
        default=(_D("k"), _D("ks")),
        metavar="K|K1,K2,..",
        help=f"k = 1..K drafts per step (default {_D('k')}), or the listed k values (--engine: one server each)",
    )
    _defaulted(
        p,
        "--batch-size",
        "prompts of one length generated together by the built-in path (default {}; lower it for memory)",
        type=int,
        metavar="N",
    )
    p.add_argument(
        "--report-dir",
        type=Path,
        help="write report.json, report.md, plots (and --engine's server logs, in logs/) here, replacing an earlier "
        "report whole",
    )
    add_device_argument(p, _D("device"), indexed=True)
    add_dtype_argument(p)
    _defaulted(p, "--activations", "emulate: quantize the inputs of Linears with input scales (W4A4) as the engines "
               "do; off: full precision, optimistic, labelled in every output (default {})",
               choices=field_choices(ValidateOptions, "activations"))
    p.add_argument(
        "--save-hidden", type=Path, metavar="FILE", help="save target hidden states and tokens (safetensors)"
    )
    p.add_argument("--hidden", type=Path, metavar="FILE", help="use saved target hidden states instead of the targets")
    _defaulted(
        p,
        "--warn-al-drop",
        "the allowed AL drop per k: warn when the drop exceeds it beyond noise (default {})",
        type=float,
    )
    _defaulted(
        p,
        "--min-main-agreement",
        "pair: a candidate whose main model agrees with the reference's top-1 token less often is broken (default {})",
        type=float,
        metavar="F",
    )
    _defaulted(p, "--confidence", "level of the bootstrap intervals over prompts (default {})", type=float)
    p.add_argument("--json", action="store_true", help="print report.json to stdout instead of the table")
    g = add_sampling_arguments(
        p, ValidateOptions, "the target samples at each T (0: greedy, the default); the first is the headline of the "
        "verdict"
    )
    _defaulted(g, "--seed", "prompt i samples with seed + i (default {})", type=int)
    p.add_argument(
        "--context-buckets",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="upper ends of context-length buckets (tokens, ascending): prompts are cut and extended to fill each "
        "bucket, and per-position acceptance is reported per bucket (default: four spans up to --max-len)",
    )
    e = p.add_argument_group(
        "through a serving engine (its own speculative-decoding counters: vLLM, SGLang, TensorRT-LLM with --server)"
    )
    e.add_argument(
        "--server", metavar="URL",
        help="a running vLLM, SGLang or trtllm-serve server (the reference or the one checkpoint; TensorRT-LLM: AL "
        "only, its counters have no per-position acceptance)",
    )  # fmt: skip
    e.add_argument("--candidate-server", metavar="URL", help="a second running server to compare (e.g. the NVFP4 one)")
    e.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="the servers' API key (vLLM/SGLang --api-key), first line of FILE; or MTPQUANT_ENGINE_API_KEY "
        "(never put a key or password in the URL: it is removed from every report and message)",
    )
    e.add_argument("--served-model", metavar="NAME", help="the model name to ask for (default: the only one served)")
    e.add_argument("--engine", choices=launchable(),
                   help="start the engine for CHECKPOINT [CANDIDATE] on 127.0.0.1")
    e.add_argument("--vllm-python", type=Path, metavar="PATH", help="the python of the vLLM environment")
    e.add_argument("--sglang-python", type=Path, metavar="PATH", help="the python of the SGLang environment")
    _defaulted(e, "--tensor-parallel-size", "--engine: tensor parallelism (default {})", type=int)
    e.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="--engine: one more server argument (given last: it overrides mtpquant's own, the memory sizing too)",
    )
    e.add_argument(
        "--compare-reference", action="store_true", help="--engine: also the built-in prediction, side by side"
    )
    _defaulted(e, "--concurrency", "requests in flight at once (default {}: per-prompt counters, the finest intervals)",
               type=int, metavar="N")
    _defaulted(e, "--startup-timeout", "--engine: seconds to wait for the server (default {:g})", type=float)
    p.set_defaults(func=run)


def _defaulted(p: argparse._ActionsContainer, flag: str, help_text: str, **kw: Any) -> None:
    """``flag`` defaulting to ValidateOptions' field of its name, the default stated where ``help_text`` has ``{}``."""
    default = _D(flag.removeprefix("--").replace("-", "_"))
    p.add_argument(flag, default=default, help=help_text.format(default), **kw)


def _ks(text: str) -> tuple[int, tuple[int, ...] | None]:
    """``3`` -> (3, None): k = 1..3; ``1,3`` -> (3, (1, 3))."""
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not K or a list K1,K2,...") from None
    if not values:
        raise argparse.ArgumentTypeError("--k needs a value")
    return (values[-1], values if "," in text else None)


def run(args: argparse.Namespace) -> int:
    """Run validate and print the acceptance table (or the JSON report)."""
    from mtpquant.api import validate
    from mtpquant.render import validate_text

    opts = options_from(
        ValidateOptions,
        args,
        prompts_file=args.prompts,
        k=args.k[0],
        ks=args.k[1],
        temperatures=tuple(args.temperature),
        top_p=tuple(args.top_p),
        top_k=tuple(args.top_k),
        context_buckets=tuple(args.context_buckets),
        progress=not args.quiet,
        engine_args=tuple(args.engine_arg),
    )
    report = validate(opts)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, allow_nan=False))
    else:
        print(validate_text(report.report, args.report_dir))
    return report.report.verdict.exit_code
