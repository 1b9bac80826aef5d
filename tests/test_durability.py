"""Crash durability and the order of convert's work: every file of OUT (the exported shards moved into place by a
rename, the files carried over from SRC) is fsynced before the rename that publishes OUT; and convert takes OUT's
lock before it downloads anything, so a second run on the same OUT is refused at once."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.writer import PARTIAL_MARK
from mtpquant.cli import main
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.errors import ExitCode
from tests.support.hubserver import LocalHub
from tests.test_convert_scale import _holder

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


@pytest.mark.slow
def test_every_file_is_fsynced_before_out_is_published(
    tiny_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    synced: set[tuple[int, int]] = set()
    at_publish: set[tuple[int, int]] = set()
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real_fsync(fd)

    def replace(a: str | os.PathLike[str], b: str | os.PathLike[str], **kw: object) -> None:
        if PARTIAL_MARK in os.fspath(a) and Path(b) == out:
            at_publish.update(synced)  # what was durable when OUT appeared
        real_replace(a, b, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    convert(ConvertOptions(src=str(tiny_factory("qwen3_5")), out=out, mtp="keep", calib_samples=2, calib_seq_len=32,
                           device="cpu", progress=False))
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"tokenizer.json", "config.json"} <= names and "model.safetensors" in names  # moved, carried
    not_synced = [p.name for p in files if (p.stat().st_dev, p.stat().st_ino) not in at_publish]
    assert not_synced == []


def test_convert_is_refused_before_it_downloads_anything(
    local_hub: LocalHub, tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tiny_factory("qwen3_5")
    local_hub.create_repo("org/tiny", {p.name: p for p in src.iterdir() if p.is_file()})
    out = tmp_path / "out"
    first = _holder(out)
    try:
        capsys.readouterr()
        code = main(["convert", "org/tiny", str(out), "--keep-mtp", "--device", "cpu"])
        err = capsys.readouterr().err
    finally:
        first.kill()
        first.wait()
    assert code == ExitCode.OUTPUT_BUSY
    assert err == (
        f"mtpquant: error: {out}: another mtpquant run (pid {first.pid}) is writing it; wait for it to finish or stop "
        "it\n"
    )
    # the plan's ranged header reads only: no file was downloaded whole, nothing reached the HF cache
    assert local_hub.requests and all(r.range for r in local_hub.requests if r.kind == "resolve")
    assert not out.exists()
