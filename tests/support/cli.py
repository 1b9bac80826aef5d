"""Running the CLI in a test: the exit code and its one error line."""

from __future__ import annotations

import pytest

from mtpquant.cli import main


def one_error(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``mtpquant ARGV``; what it prints on stderr must be one line and no traceback: (exit code, the line)."""
    capsys.readouterr()  # drop what building the fixtures printed
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]
