"""Faults at the command level: disk full mid-command, and no writes outside OUT / cache / temp."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mtpquant.checkpoint import filesystem, writer
from mtpquant.checkpoint.writer import PARTIAL_MARK
from mtpquant.cli import main as cli
from mtpquant.errors import ExitCode

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _fail_at(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Disk full at the n-th write, counting plain writes and in-kernel tensor copies alike."""
    calls = {"n": 0}
    real_write, real_copy = filesystem.write_data, writer._copy_range

    def check(fh: object) -> None:
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno.ENOSPC, "No space left on device", str(getattr(fh, "name", "")))

    def flaky_write(fh: object, data: bytes | memoryview) -> None:
        check(fh)
        real_write(fh, data)

    def flaky_copy(fh: object, src: Path, start: int, end: int, observe: Any = None) -> None:
        check(fh)
        real_copy(fh, src, start, end, observe)

    monkeypatch.setattr(filesystem, "write_data", flaky_write)
    monkeypatch.setattr(writer, "_copy_range", flaky_copy)


@pytest.mark.parametrize("seed", range(3))
def test_graft_disk_full_at_random_write(
    naive_export_factory: Factory,
    tiny_factory: Factory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    seed: int,
) -> None:
    quant, src = naive_export_factory("qwen3_5"), tiny_factory("qwen3_5")  # built before the fault is armed
    capsys.readouterr()
    _fail_at(monkeypatch, random.Random(seed).randint(1, 12))
    out = tmp_path / "out"
    code = cli(["graft", str(quant), "--from", str(src), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == ExitCode.IO
    assert err.count("\n") == 1 and "No space left on device" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temp dir left


@pytest.mark.parametrize("seed", range(2))
def test_convert_disk_full_at_random_write(
    tiny_factory: Factory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    seed: int,
) -> None:
    src = tiny_factory("qwen3_5")  # built before the fault is armed
    capsys.readouterr()
    _fail_at(monkeypatch, random.Random(seed).randint(1, 6))
    out = tmp_path / "out"
    argv = [
        "-q",
        "convert",
        str(src),
        str(out),
        "--keep-mtp",
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "32",
        "--device",
        "cpu",
    ]
    code = cli(argv)
    err = capsys.readouterr().err
    assert code == ExitCode.IO
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("mtpquant: error: ") and "No space left on device" in err.splitlines()[-1]
    assert not out.exists() and not list(tmp_path.glob(f".*{PARTIAL_MARK}*"))


@pytest.mark.slow
def test_commands_write_nowhere_but_out_cache_and_temp(
    naive_export_factory: Factory, tiny_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home, cwd, tmp, work = (tmp_path / d for d in ("home", "cwd", "tmp", "work"))
    for d in (home, cwd, tmp, work):
        d.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.chdir(cwd)
    src, quant = tiny_factory("qwen3_5"), naive_export_factory("qwen3_5")
    assert (
        cli(
            [
                "-q",
                "convert",
                str(src),
                str(work / "conv"),
                "--keep-mtp",
                "--calib-samples",
                "2",
                "--calib-seq-len",
                "32",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert cli(["graft", str(quant), "--from", str(src), "--out", str(work / "graft")]) == 0
    assert (
        cli(
            [
                "-q",
                "validate",
                str(src),
                str(work / "conv"),
                "--num-prompts",
                "2",
                "--max-len",
                "24",
                "--report-dir",
                str(work / "report"),
                "--device",
                "cpu",
            ]
        )
        == ExitCode.VALIDATE_FAIL
    )  # the random tiny MTP accepts nothing
    assert cli(["inspect", str(work / "conv")]) == 0
    assert sorted(p.name for p in work.iterdir()) == ["conv", "graft", "report"]
    assert list(cwd.iterdir()) == []
    leftovers = [p for p in home.rglob("*") if p.is_file() and ".cache" not in p.parts]
    assert leftovers == []
    assert os.listdir(tmp) == [] or all(not p.name.startswith(".") for p in tmp.iterdir())
