"""The ``mtpquant`` command line: argument parsing and printing only; the work is in the API."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mtpquant import __version__
from mtpquant.errors import ExitCode, MtpquantError, exit_code_table
from mtpquant.runtime.machine import tune_cpu_runtime

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Options = TypeVar("Options", bound=DataclassInstance)

__all__ = [
    "HUB_CODES",
    "MTP_COPY_CODES",
    "MTP_KIND_CODES",
    "READ_CODES",
    "WRITE_CODES",
    "add_command",
    "add_device_argument",
    "add_dtype_argument",
    "add_report_flags",
    "add_sampling_arguments",
    "add_shard_size_argument",
    "exit_codes_epilog",
    "main",
    "options_from",
    "parse_size",
    "progress_bars",
    "recorded_command",
]

# Subcommands, each a module (``tune-mtp``: ``tune_mtp_cmd``) with `register(subparsers)` setting `func(args) -> int`
# on its parser.
COMMANDS = (
    "demo", "convert", "graft", "extract", "heal", "tune-mtp", "inspect", "validate", "publish", "tiny", "families"
)

# Every command can end with these; a command's epilog adds its own (``exit_codes_epilog``).
_COMMON_CODES = (ExitCode.OK, ExitCode.INTERNAL, ExitCode.USAGE, ExitCode.IO, ExitCode.INTERRUPTED)
# A command that takes a Hub repo id where it takes a checkpoint.
HUB_CODES = (ExitCode.HUB_UNREACHABLE, ExitCode.HUB_ACCESS, ExitCode.HUB_REFUSED)
# A command that reads a checkpoint (a local directory or a Hub repo id) and knows its family.
READ_CODES = (ExitCode.CHECKPOINT, ExitCode.ARCHITECTURE, *HUB_CODES)
# A command that writes a checkpoint of its MTP (convert, graft, extract): OUT, the MTP mode, the verified output.
WRITE_CODES = (ExitCode.OUTPUT_EXISTS, ExitCode.MTP_MODE, ExitCode.VERIFICATION)
# The family's MTP status refuses it (``families.schema.Family.status``): inspect reports it, every surgery refuses.
MTP_KIND_CODES = (ExitCode.MTP_NEVER_SHIPPED, ExitCode.NOT_AN_MTP)
# A command that copies a checkpoint's MTP into a checkpoint of its own writing (graft, extract).
MTP_COPY_CODES = (*READ_CODES, *WRITE_CODES, *MTP_KIND_CODES)


# Flags that change only what a command prints (--dry-run: that it writes nothing): left out of the command line an
# output records, so an output records the same command however its run was watched.
_UNRECORDED_FLAGS = ("--quiet", "--verbose", "--json", "--dry-run")
_SHORT_UNRECORDED = re.compile(r"-[qv]+")


def recorded_command(argv: Sequence[str]) -> tuple[str, ...]:
    """The command line an output records (provenance, the recipe's header, the card): ``mtpquant`` and the
    arguments as given, in their order, less the flags that change only what is printed (``-q``, ``-v``,
    ``--json``, ``--dry-run``; argparse's unambiguous prefixes too). Every command records it through this."""
    out = ["mtpquant"]
    options_end = False
    for arg in argv:
        options_end = options_end or arg == "--"
        unrecorded = _SHORT_UNRECORDED.fullmatch(arg) or (
            len(arg) > 2 and arg.startswith("--") and any(flag.startswith(arg) for flag in _UNRECORDED_FLAGS)
        )
        if options_end or not unrecorded:
            out.append(arg)
    return tuple(out)


def progress_bars() -> bool:
    """Whether progress bars show (``-q`` and tqdm's own ``TQDM_DISABLE`` turn them off)."""
    return os.environ.get("TQDM_DISABLE", "") in {"", "0"}


def options_from(options: type[Options], args: argparse.Namespace, **given: Any) -> Options:
    """A command's frozen ``options`` from its parsed ``args``: each field from the flag of the same name, ``command``
    from the recorded command line (``recorded_command``), ``given`` the fields whose flags are named or typed
    otherwise."""
    fields = {f.name for f in dataclasses.fields(options)}
    values = {name: getattr(args, name) for name in fields & vars(args).keys() if name != "command"}
    if "command" in fields:
        values["command"] = args.command_line
    return options(**{**values, **given})


def exit_codes_epilog(*codes: ExitCode) -> str:
    """The exit codes a subcommand can end with, as its ``--help`` lists them: rows of the one table."""
    return "exit codes:\n" + exit_code_table({*_COMMON_CODES, *codes}) + "\nAll exit codes: `mtpquant --help`."


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    summary: str,
    description: str,
    examples: str,
    codes: Sequence[ExitCode],
) -> argparse.ArgumentParser:
    """A subcommand's parser (``summary``: its line in ``mtpquant --help``); its epilog: ``examples`` (raw text),
    then the exit ``codes`` it can end with."""
    return sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=examples + exit_codes_epilog(*codes),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_report_flags(p: argparse.ArgumentParser, dry_run: str, json: str = "print the result as JSON") -> None:
    """``--dry-run`` (``dry_run``: what it still does) and ``--json`` (``json``: what it prints)."""
    p.add_argument("--dry-run", action="store_true", help=dry_run)
    p.add_argument("--json", action="store_true", help=json)


def _add_logging_flags(p: argparse.ArgumentParser, dest: str = "") -> None:
    """``-v`` / ``-q``, accepted before the subcommand and after it (``dest`` prefixes the second pair)."""
    p.add_argument(
        "-v", "--verbose", dest=f"{dest}verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    p.add_argument("-q", "--quiet", dest=f"{dest}quiet", action="store_true", help="only errors; no progress bars")


def add_base_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--base-model`` and its revision (convert and publish): the card's ``base_model`` when SRC is a local copy."""
    p.add_argument(
        "--base-model",
        metavar="ORG/NAME",
        help="Hub id of the base model (when it is not recorded: SRC was a local copy), written into the card",
    )
    p.add_argument("--base-model-revision", metavar="REV", help="the base model's revision (branch, tag or commit)")


def parse_size(text: str) -> int:
    """``5GB`` / ``500MiB`` / ``1000000`` -> bytes (argparse type)."""
    from mtpquant.units import ByteSize

    try:
        return ByteSize.of(text).bytes
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_shard_size_argument(p: argparse.ArgumentParser, what: str = "byte budget per new MTP shard") -> None:
    """``--max-shard-size SIZE`` (graft, heal), its default the one shard-size default."""
    from mtpquant.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
    from mtpquant.units import format_bytes

    p.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES, metavar="SIZE",
                   help=f"{what} (default {format_bytes(DEFAULT_MAX_SHARD_BYTES)})")


def add_device_argument(p: argparse.ArgumentParser, default: str, *, indexed: bool, what: str = "") -> None:
    """``--device``: ``runtime.machine.DEVICES`` (and ``cuda:N`` where a run computes on one GPU: ``indexed``)."""
    from mtpquant.runtime.machine import DEVICES

    names = ", ".join(DEVICES[:-1]) + (", cuda:N" if indexed else "") + f" or {DEVICES[-1]}"
    p.add_argument("--device", default=default, metavar="DEVICE" if indexed else None,
                   choices=None if indexed else DEVICES, help=f"{what}{names} (default {default})")


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """``--dtype``: ``runtime.machine.COMPUTE_DTYPES``; by default float32 on the CPU, bfloat16 on CUDA."""
    from mtpquant.runtime.machine import COMPUTE_DTYPES

    p.add_argument("--dtype", choices=COMPUTE_DTYPES, help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")


def add_sampling_arguments(p: argparse.ArgumentParser, options: type, temperature_help: str) -> argparse._ArgumentGroup:
    """The sampling flags ``--temperature``, ``--top-p``, ``--top-k``, ``--rule`` (validate's and heal's: the settings
    ``records.sampling.check_sampling`` reads), their defaults those of ``options``' fields ``temperatures``, ``top_p``,
    ``top_k``, ``rule``; returns their group."""
    from mtpquant.records.record import field_default
    from mtpquant.records.sampling import RULES

    top_p, top_k = field_default(options, "top_p"), field_default(options, "top_k")
    each = "one value, or one per --temperature"
    g = p.add_argument_group("sampling (as users serve: Qwen recommends temperature 0.6-1.0)")
    g.add_argument("--temperature", type=float, nargs="+", default=list(field_default(options, "temperatures")),
                   metavar="T", help=temperature_help)
    g.add_argument("--top-p", type=float, nargs="+", default=list(top_p), metavar="P",
                   help=f"nucleus sampling of the target (default {top_p[0]:g}: off); {each}")
    g.add_argument("--top-k", type=int, nargs="+", default=list(top_k), metavar="K",
                   help=f"top-k sampling of the target (default {top_k[0]}: off); {each}")
    g.add_argument("--rule", choices=tuple(RULES), default=field_default(options, "rule"),
                   help="how drafts are verified: " + "; ".join(f"{r.flag}: {r.description}" for r in RULES.values()))
    return g


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not a flag; the top-level flags take no value), when it
    is one of ``COMMANDS``; else None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered (``only``: that one alone, so a command imports only
    its own module: ``mtpquant inspect --help`` loads no other command's settings, recipes or schema)."""
    parser = argparse.ArgumentParser(
        prog="mtpquant",
        description=(
            "Quantize Qwen checkpoints to NVFP4 without losing their MTP layer; repair, inspect, validate, publish."
        ),
        epilog="exit codes:\n" + exit_code_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mtpquant {__version__}")
    _add_logging_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in (only,) if only is not None else COMMANDS:
        where = f"mtpquant.cli.{name.replace('-', '_')}_cmd"
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name != where:
                raise
            continue
        module.register(sub)
    for command in sub.choices.values():
        _add_logging_flags(command, "sub_")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    # huggingface_hub's telemetry first asks the Hub for its list of agent harnesses (3 s timeout, again on every run
    # while the Hub cannot be reached): a second request before mtpquant's first, and a second wait when the Hub is
    # down. Off unless the user chose (huggingface_hub's own setting; read when huggingface_hub is first imported).
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    tuned = tune_cpu_runtime()  # before any command imports torch (machine.tune_cpu_runtime says why)
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(words))
    args = parser.parse_args(words)
    args.verbose += args.sub_verbose
    args.quiet = args.quiet or args.sub_quiet
    args.command_line = recorded_command(sys.argv[1:] if argv is None else argv)
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if tuned:
        logging.getLogger("mtpquant.runtime.machine").info(
            "CPU runtime: %s (set yours to override)", ", ".join(f"{k}={v}" for k, v in tuned.items())
        )
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
    try:
        return int(args.func(args))
    except MtpquantError as exc:
        print(f"mtpquant: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into `head` and the like
        return 0
    except KeyboardInterrupt:
        print("mtpquant: interrupted; no output was left behind", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:
        hub = _hub_error(exc)  # a Hub failure the command did not translate itself: still one line
        if hub is not None:
            print(f"mtpquant: error: {hub}", file=sys.stderr)
            return hub.exit_code
        if not isinstance(exc, OSError):
            raise
        # disk full, permissions, ...: one line, the temp output already removed
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"mtpquant: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return int(ExitCode.IO)


def _hub_error(exc: BaseException) -> MtpquantError | None:
    """The one-line error for an exception raised by huggingface_hub or httpx, else None."""
    if not type(exc).__module__.startswith(("huggingface_hub", "httpx", "httpcore")):
        return None
    from mtpquant.net.hub import translate

    return translate(exc, "the Hub", "a request")


if __name__ == "__main__":
    sys.exit(main())
