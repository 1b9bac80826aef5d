"""``--overwrite`` replaces only a checkpoint mtpquant wrote, in one atomic exchange: anything else at OUT is refused
(exit 5, naming what is in the way), and a kill at any point of the replacement leaves the old OUT or the new one,
with no leftover that the next run does not clean."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.writer import OutputDir
from mtpquant.cli import main
from mtpquant.convert.run import ConvertOptions, convert
from mtpquant.errors import ExitCode
from mtpquant.records.provenance import PROVENANCE_FILE, Provenance, Step, check_replaceable
from tests.support.cli import one_error
from tests.support.kills import KILL_PRELUDE
from tests.test_graft import leftovers, tree_state

pytestmark = pytest.mark.dev

Factory = Callable[[str], Path]


def _ours(path: Path, marker: str = "old") -> Path:
    """A directory as an earlier mtpquant run left it (its provenance file and a file to tell it by)."""
    path.mkdir(parents=True)
    (path / PROVENANCE_FILE).write_bytes(Provenance((Step("convert", ("mtpquant", "convert")),)).to_bytes())
    (path / "marker.txt").write_text(marker)
    return path


@pytest.mark.parametrize("kind", ["unrelated", "file", "link"])
def test_overwrite_refuses_what_mtpquant_did_not_write(
    kind: str, tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    if kind == "unrelated":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
        (out / "other-model").mkdir()
        (out / "other-model" / "config.json").write_text("{}")
    elif kind == "file":
        out.write_text("not a directory")
    else:
        _ours(tmp_path / "elsewhere")
        out.symlink_to(tmp_path / "elsewhere")
    before = tree_state(tmp_path)
    code, err = one_error(capsys, "convert", str(tiny_factory("qwen3_5")), str(out), "--overwrite", "--device", "cpu")
    assert code == ExitCode.OUTPUT_EXISTS
    mine = "--overwrite replaces only a checkpoint mtpquant wrote"
    assert err == {
        "unrelated": f"mtpquant: error: {out}: not a checkpoint mtpquant wrote (no readable {PROVENANCE_FILE}; it "
        f"holds 2 entries: other-model, thesis.tex); not replacing it ({mine}): remove it yourself or choose another "
        "output",
        "file": f"mtpquant: error: {out}: is a file, not a checkpoint mtpquant wrote; not replacing it ({mine})",
        "link": f"mtpquant: error: {out}: is a symbolic link, not a checkpoint mtpquant wrote; not replacing it "
        f"({mine})",
    }[kind]
    assert tree_state(tmp_path) == before  # nothing touched, nothing left beside it


def test_a_provenance_file_that_is_not_ours_does_not_count(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / PROVENANCE_FILE).write_text('{"schema": "someone-else/1"}')
    (out / "data.bin").write_bytes(b"x")
    with pytest.raises(Exception, match="not a checkpoint mtpquant wrote"):
        check_replaceable(out)
    (out / PROVENANCE_FILE).unlink()
    (out / PROVENANCE_FILE).symlink_to(tmp_path / "elsewhere.json")  # a link to one elsewhere is not ours either
    _ours(tmp_path / "x")
    (tmp_path / "elsewhere.json").write_bytes((tmp_path / "x" / PROVENANCE_FILE).read_bytes())
    with pytest.raises(Exception, match="not a checkpoint mtpquant wrote"):
        check_replaceable(out)
    check_replaceable(tmp_path / "x")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty")  # an empty directory holds nothing to lose


def test_the_check_runs_again_just_before_the_exchange(tmp_path: Path) -> None:
    out = _ours(tmp_path / "out")
    od = OutputDir(out, overwrite=True, replace_check=check_replaceable)
    (od.path / "new.txt").write_text("new")
    (out / PROVENANCE_FILE).unlink()  # someone else's directory now
    with pytest.raises(Exception, match="not a checkpoint mtpquant wrote"):
        od.finalize(lambda p: None, opened=True)
    od.abort()
    assert sorted(p.name for p in out.iterdir()) == ["marker.txt"]
    assert leftovers(tmp_path) == []


_DRIVER = KILL_PRELUDE + textwrap.dedent(
    """
    import shutil
    from pathlib import Path
    import mtpquant.checkpoint.writer as writer
    from mtpquant.records.provenance import PROVENANCE_FILE, Provenance, Step, check_replaceable

    out = Path(args["out"])
    od = writer.OutputDir(out, overwrite=True, replace_check=check_replaceable)
    (od.path / PROVENANCE_FILE).write_bytes(Provenance((Step("convert", ("new",)),)).to_bytes())
    (od.path / "marker.txt").write_text("new")
    for name in ("fsync", "replace", "rename", "unlink", "rmdir"):
        wrap(os, name)
    wrap(shutil, "rmtree")
    wrap(writer, "exchange_dirs", after=True)
    if args["no_exchange"]:
        writer.exchange_dirs = lambda a, b: False
    od.finalize(lambda p: None, opened=True)
    print(json.dumps(tags))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("no_exchange", [False, True], ids=["exchange", "aside"])
def test_a_kill_during_the_replacement_leaves_old_or_new(no_exchange: bool, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    root = Path(__file__).resolve().parents[1]

    def drive(out: Path, kill_at: int) -> subprocess.CompletedProcess[str]:
        arg = json.dumps({"out": str(out), "kill_at": kill_at, "no_exchange": no_exchange})
        return subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, cwd=root, timeout=60)

    ref = _ours(tmp_path / "ref" / "out")
    old = tree_state(ref)
    done = drive(ref, 0)
    assert done.returncode == 0, done.stderr
    tags = json.loads(done.stdout.strip().splitlines()[-1])
    new = tree_state(ref)
    assert old != new and leftovers(ref.parent) == []
    for k in range(1, len(tags) + 1):
        out = _ours(tmp_path / f"k{k}" / "out")
        killed = drive(out, k)
        assert killed.returncode == -signal.SIGKILL, (k, tags[k - 1], killed.stderr[-2000:])
        now = tree_state(out) if out.exists() else None
        if no_exchange:
            # between the two renames OUT is briefly absent; the old tree then waits aside for the next run
            assert now in (old, new, None), (k, tags[k - 1])
        else:
            assert now in (old, new), (k, tags[k - 1])  # one atomic exchange: never absent, never mixed
        # the next run on OUT puts the old tree back if needed, removes every leftover, and replaces it
        rerun = OutputDir(out, overwrite=True, replace_check=check_replaceable)
        assert tree_state(out) in (old, new), (k, tags[k - 1])
        rerun.abort()
        assert leftovers(out.parent) == [], (k, tags[k - 1], leftovers(out.parent))


@pytest.mark.slow
def test_convert_overwrite_replaces_its_own_output(tiny_factory: Factory, tmp_path: Path) -> None:
    src, out = tiny_factory("qwen3_5"), tmp_path / "out"
    options = ConvertOptions(src=str(src), out=out, calib_samples=2, calib_seq_len=32, device="cpu", progress=False)
    convert(options)
    first = os.stat(out).st_ino
    convert(dataclasses.replace(options, mtp="drop", overwrite=True))
    assert os.stat(out).st_ino != first and not list(out.glob("mtp-*.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no old tree, no lock, no temp directory


def test_tiny_overwrite_replaces_only_a_checkpoint_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["tiny", str(out), "--variant", "qwen3_5"]) == 0
    assert main(["tiny", str(out), "--variant", "qwen3_5-tied", "--overwrite"]) == 0  # its own kind: replaced
    (out / "notes").mkdir()
    code, err = one_error(capsys, "tiny", str(out), "--variant", "qwen3_5", "--overwrite")
    assert code == ExitCode.OUTPUT_EXISTS
    assert err == (
        f"mtpquant: error: {out}: not a checkpoint directory (notes is not a checkpoint file); not replacing it"
    )
    assert (out / "notes").is_dir()


def test_save_hidden_never_replaces_an_unrelated_file(
    tiny_factory: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    code, err = one_error(
        capsys, "validate", str(tiny_factory("qwen3_5")), "--save-hidden", str(notes), "--device", "cpu"
    )
    assert code == ExitCode.OUTPUT_EXISTS
    assert err == (
        f"mtpquant: error: {notes}: exists and is not an mtpquant hidden-state file; not replacing it (choose another "
        "--save-hidden)"
    )
    assert notes.read_text() == "mine"
    code, err = one_error(capsys, "validate", str(tiny_factory("qwen3_5")), "--hidden", str(notes), "--device", "cpu")
    assert code == ExitCode.USAGE and err.startswith(f"mtpquant: error: {notes}: not a")
