"""The command line itself: every subcommand's help lists its exit codes from the one table, -q / -v go before
or after the subcommand, and library messages go through logging."""

from __future__ import annotations

import logging
import re
import shlex
import sys
from pathlib import Path

import pytest

from mtpquant.cli import COMMANDS, build_parser
from mtpquant.errors import ExitCode, exit_code_table

pytestmark = pytest.mark.dev

_ROW = re.compile(r"^\s+(\d+)  (.+)$")


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["convert", "graft", "inspect", "validate", "publish", "demo", "tiny"])
def test_every_epilog_is_rows_of_the_one_table(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(command, capsys)
    epilog = text[text.index("exit codes:\n") :]
    rows = [line for line in epilog.splitlines() if _ROW.match(line)]
    table = exit_code_table().splitlines()
    assert rows and all(row in table for row in rows), rows
    codes = [int(_ROW.match(row).group(1)) for row in rows]  # type: ignore[union-attr]
    assert codes == sorted(codes)
    assert {0, 1, 2, 19, 130} <= set(codes)
    assert "All exit codes: `mtpquant --help`." in epilog


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_shows_examples_that_parse(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every subcommand's --help opens its epilog with examples (only graft and heal had them); each is a command
    line the parser accepts, for that subcommand."""
    text = _help(command, capsys)
    block = text[text.index("\nexamples:\n") + len("\nexamples:\n") :].split("\n\n", 1)[0]
    examples = [shlex.split(line) for line in block.splitlines()]
    assert len(examples) >= 2 and all(argv[:2] == ["mtpquant", command] for argv in examples), block
    for argv in examples:
        args = build_parser().parse_args(argv[1:])  # argparse exits (code 2) on an example that does not parse
        assert args.command == command


def test_convert_help_names_an_already_quantized_source_15(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("convert", capsys)
    assert f"  {int(ExitCode.SOURCE_QUANTIZED)}  convert: the source is already quantized" in text
    assert "already quantized)" not in text  # the old hand-typed "6 ... (or SRC is already quantized)"


def test_tiny_help_says_what_it_writes(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help("tiny", capsys).split())
    assert "random weights" in text and "the directory to write" in text and "-tied: tied embeddings" in text


@pytest.mark.parametrize(
    ("argv", "verbose", "quiet"),
    [
        (["inspect", "X"], 0, False),
        (["-q", "inspect", "X"], 0, True),
        (["inspect", "X", "-q"], 0, True),
        (["inspect", "X", "-v"], 1, False),
        (["-v", "inspect", "X", "-v"], 2, False),
        (["convert", "S", "O", "-vv", "--dry-run"], 2, False),
    ],
)
def test_logging_flags_before_or_after_the_subcommand(argv: list[str], verbose: int, quiet: bool) -> None:
    args = build_parser().parse_args(argv)
    assert (args.verbose + args.sub_verbose, args.quiet or args.sub_quiet) == (verbose, quiet)


@pytest.mark.parametrize(
    ("argv", "recorded"),
    [
        (  # as given, in its order; -q, -vv and --json change only what is printed
            ["-q", "convert", "S", "O", "--mtp", "extract", "--calib-samples", "4", "--mtp-out", "X", "-vv", "--json"],
            ["convert", "S", "O", "--mtp", "extract", "--calib-samples", "4", "--mtp-out", "X"],
        ),
        (  # a dry run's card shows the command the real run records
            ["publish", "O", "--repo", "me/x", "--dry-run", "--base-model", "a/b", "--force"],
            ["publish", "O", "--repo", "me/x", "--base-model", "a/b", "--force"],
        ),
        (["graft", "Q", "--from", "S", "--quie", "--out", "O", "--js"], ["graft", "Q", "--from", "S", "--out", "O"]),
        (["convert", "S", "O", "--set=mtp.mode=-q", "-v"], ["convert", "S", "O", "--set=mtp.mode=-q"]),
        (["inspect", "-q", "--", "-v"], ["inspect", "--", "-v"]),  # after `--` every argument is a value
    ],
)
def test_every_command_records_its_command_line_through_one_helper(argv: list[str], recorded: list[str]) -> None:
    from mtpquant.cli import recorded_command

    build_parser().parse_args(argv)  # a command line argparse accepts
    assert recorded_command(argv) == ("mtpquant", *recorded)


def test_one_size_rule_for_every_size_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """graft's (and heal's) --max-shard-size read sizes as convert and recipe files do (``units.ByteSize``)."""
    assert build_parser().parse_args(["graft", "Q", "--out", "O", "--max-shard-size", "500MiB"]).max_shard_size == (
        500 * 2**20
    )
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["graft", "Q", "--out", "O", "--max-shard-size", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith("argument --max-shard-size: size must be positive, got '0'")


class _RootRecords(logging.Handler):
    """What reaches the root logger's handlers (pytest's capture also sits on non-propagating loggers such as
    transformers', where it would see the library's records before mtpquant routes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.name, record.getMessage()))


@pytest.mark.parametrize("propagate", [False, True], ids=["default", "CI=1"])  # transformers propagates under CI=1
def test_transformers_messages_go_through_logging(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, propagate: bool
) -> None:
    import transformers.utils.logging as tf_logging

    from mtpquant.runtime.libraries import library_output

    tf_log = tf_logging.get_logger("transformers.tokenization_utils_base")
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", propagate)
    root, records = logging.getLogger(), _RootRecords()
    monkeypatch.setattr(root, "handlers", [records])
    caplog.set_level(logging.WARNING)  # the root logger's level (restored after the test)
    with library_output(progress=False):
        tf_log.warning("Token indices sequence length is longer than the specified maximum sequence length for this")
        tf_log.warning("something else")
        assert not tf_logging.is_progress_bar_enabled()
    assert tf_logging.is_progress_bar_enabled()
    # the message about what calibration does on purpose is DEBUG now (hidden at WARNING); the other stays a warning
    assert records.seen == [("WARNING", "transformers.tokenization_utils_base", "something else")]
    records.seen.clear()
    caplog.set_level(logging.DEBUG)
    with library_output(progress=True):
        tf_log.warning("The fast path is not available because one of the required library is not installed.")
    # the CPU fallback of the linear-attention kernels: slower, not wrong (INFO, shown with -v)
    assert [(level, name) for level, name, _ in records.seen] == [("INFO", "transformers.tokenization_utils_base")]
    assert logging.getLogger("transformers").propagate is propagate  # put back as it was


def test_modelopt_import_warning_goes_to_the_log(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import warnings

    from mtpquant.runtime.libraries import import_libraries

    (tmp_path / "noisy_library.py").write_text(
        "import warnings\n"
        "warnings.warn('transformers 5.19.0 is not tested with current version of modelopt and may cause issues.')\n"
        "warnings.warn('a real problem')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "noisy_library", raising=False)
    caplog.set_level(logging.DEBUG, logger="mtpquant.runtime.libraries")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        import_libraries("noisy_library")
    assert [str(w.message) for w in seen] == ["a real problem"]  # another warning stays a warning
    assert [r.levelname for r in caplog.records if "not tested" in r.getMessage()] == ["DEBUG"]


def test_library_warnings_in_a_block_go_to_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """modelopt warns through Python's warnings (stderr, past -q): in a ``library_output`` block a warning is a log
    record under -q / -v, and modelopt's "exported tensor names may not match" (its per-expert export of qwen4_exp,
    which convert verifies) is INFO, not an alarm."""
    import warnings

    from mtpquant.runtime.libraries import library_output

    caplog.set_level(logging.DEBUG, logger="py.warnings")
    show = warnings.showwarning
    with warnings.catch_warnings(), library_output(progress=True):
        warnings.simplefilter("always")
        warnings.warn(
            "Quant-aware reverse weight conversion skipped (scoped WeightConverter (scope_prefix='language_model') "
            "cannot be reversed scope-aware); exported tensor names may not match the original HF hub checkpoint.",
            stacklevel=1,
        )
        warnings.warn("a real problem", stacklevel=1)
    assert warnings.showwarning is show  # put back
    assert [(r.name, r.levelname, r.getMessage()[:40]) for r in caplog.records] == [
        ("py.warnings", "INFO", "UserWarning: Quant-aware reverse weight "),
        ("py.warnings", "WARNING", "UserWarning: a real problem"),
    ]


def test_the_api_names_its_types_for_type_checkers() -> None:
    """Every public name of ``mtpquant.api`` is imported under TYPE_CHECKING from the module it loads lazily from:
    a user's type checker sees the real types, not ``Any``."""
    import ast

    import mtpquant.api as api

    tree = ast.parse(Path(api.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imports = [node for node in guarded.body if isinstance(node, ast.ImportFrom)]
    seen = {alias.name: node.module for node in imports for alias in node.names}
    # every public name but the functions defined in api.py itself (convert --heal, tune-mtp --heal: two commands
    # composed)
    assert seen == api._WHERE and sorted([*seen, "convert_and_heal", "tune_and_heal"]) == sorted(api.__all__)
    assert api.inspect_checkpoint.__name__ == "inspect_checkpoint"  # and at run time still loaded on first use


def test_one_device_resolver_one_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """convert, validate and heal read --device through one resolver: the same names, the same one-line refusal,
    exit 2 (validate used to exit 3, "malformed checkpoint", when no CUDA device existed)."""
    import torch

    from mtpquant.errors import DeviceError
    from mtpquant.runtime.machine import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == "cpu" and resolve_device("auto") == "cpu"
    for bad, message in [
        ("tpu", "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
        ("cuda", "--device cuda: no CUDA device is visible to torch (use --device cpu)"),
        ("cuda:1", "--device cuda:1: no CUDA device is visible to torch (use --device cpu)"),
    ]:
        with pytest.raises(DeviceError) as refused:
            resolve_device(bad)
        assert (str(refused.value), refused.value.exit_code) == (message, ExitCode.USAGE)
    # convert spreads the model over every GPU: no cuda:N; a dry run checks the name without looking for a GPU
    with pytest.raises(DeviceError, match=r"^--device must be cpu, cuda or auto, got 'cuda:1'$"):
        resolve_device("cuda:1", indexed=False)
    assert resolve_device("cuda", indexed=False, probe=False) == "cuda"
