"""Kill safety of ``tune-mtp`` (and so of the search and its heals): every scratch byte inside OUT's partial
directory, QUANT locked and snapshotted before anything is measured, ``--in-place`` (success, refusal, kill).

The quant is a keep convert of the trained tiny Qwen3.5; the search is small and its budget (10 AL) one every
configuration meets, so finalists exist and ``--heal`` trains them. A child process (``tests/support/kills.py``) with
TMPDIR pointed at an empty folder is killed (SIGKILL) at a named step; a poller in the test reads the file system
every 20 ms while the child runs (TMPDIR's size, the names beside OUT) and what it leaves is read afterwards: nothing
beside OUT but its partial directory (the one the next run's clean-up finds) and its lock file at any poll, TMPDIR
never over 1 MB; the next run cleans it and succeeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mtpquant.api import ConvertOptions, SearchSettings, TuneOptions, convert, tune_mtp
from mtpquant.checkpoint.lock import lock_path
from mtpquant.checkpoint.writer import PARTIAL_MARK
from mtpquant.errors import GraftError
from mtpquant.synth.train import TINY_MTP_ASSET
from tests.support.kills import KILL_PRELUDE
from tests.test_graft import tensor_digests

pytestmark = pytest.mark.slow

SEARCH = ["--al-budget", "10", "--search-prompts", "6", "--confirm-prompts", "6", "--mtp-precisions", "nvfp4"]
HEAL = ["--heal", "--heal-samples", "8", "--heal-steps", "2"]
SETTINGS = SearchSettings(budget=10.0, num_prompts=6, confirm_prompts=6, max_len=32, precisions=("nvfp4",))
MB = 1 << 20


@pytest.fixture(scope="module")
def keep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kill") / "keep"
    convert(ConvertOptions(src=str(TINY_MTP_ASSET), out=out, mtp="keep", device="cpu", progress=False,
                           calib_samples=8, calib_seq_len=64))  # fmt: skip
    return out


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` -> the sha256 of its bytes."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def beside(final: Path) -> list[str]:
    """What sits in ``final``'s parent other than ``final`` and its lock file."""
    return sorted(p.name for p in final.parent.iterdir() if p != final and p != lock_path(final))


_DRIVER = KILL_PRELUDE + textwrap.dedent(
    """
    import importlib
    from mtpquant.cli import main

    if args["untrained"]:  # heal's data collected as usual, each finalist "healed" as it is (no training step)
        import mtpquant.heal.finalists as finalists
        from mtpquant.search.finalists import Training

        def untrained(self, config, master, precision, scales, *, shared, device):
            return master, Training(0.0, 0.0, 0.0)

        finalists.FinalistHealer.heal = untrained
    if args["hook"]:
        module, owner, name = args["hook"]
        target = importlib.import_module(module)
        wrap(getattr(target, owner) if owner else target, name)
    code = main(["-q", *args["argv"]])
    print(json.dumps({"tags": tags, "code": code}))
    """
)


@dataclass
class Watched:
    """A child run and what a poller saw while it ran (every ``POLL`` seconds): TMPDIR's largest size and every name
    that appeared beside OUT (and in the child's empty working directory)."""

    returncode: int
    stdout: str
    stderr: str
    tmp_peak: int
    seen_beside: set[str]
    polls: int

    @property
    def tags(self) -> list[str]:
        """The wrapped steps the child went through (the driver prints them when it finishes)."""
        lines = self.stdout.strip().splitlines()
        return list(json.loads(lines[-1])["tags"]) if lines else []


POLL = 0.02


def _child(
    tmp: Path, argv: list[str], hook: tuple[str, str, str] | None, tmpdir: Path, *, untrained: bool = False,
    kill_at: int = 1, final: Path | None = None,
) -> Watched:
    """Run the driver in a child with TMPDIR ``tmpdir`` and an empty working directory, killed at the ``kill_at``-th
    call of ``hook`` (None: run to the end); poll TMPDIR's size and what sits beside ``final`` while it runs."""
    script = tmp / "driver.py"
    script.write_text(_DRIVER)
    cwd = tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TMPDIR": str(tmpdir), "TQDM_DISABLE": "1", "PYTHONPATH": str(repo)}
    arg = json.dumps({"argv": argv, "hook": hook, "kill_at": kill_at if hook else 0, "untrained": untrained})
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, str(script), arg], stdout=out, stderr=err, text=True, env=env,
                                cwd=cwd)  # fmt: skip
        peak, seen, polls, start = 0, set(), 0, time.monotonic()
        while proc.poll() is None:
            assert time.monotonic() - start < 900, "the child ran past 15 minutes"
            try:
                peak = max(peak, du(tmpdir))
                seen |= set(beside(final)) if final is not None else set()
                seen |= {"cwd/" + p.name for p in cwd.iterdir()}
            except FileNotFoundError:  # a file removed while it was walked: the next poll sees the rest
                pass
            polls += 1
            time.sleep(POLL)
        peak = max(peak, du(tmpdir))
        out.seek(0)
        err.seek(0)
        return Watched(proc.returncode, out.read(), err.read(), peak, seen, polls)


def test_tune_mtp_heal_scratch_lives_in_outs_partial_directory(keep: Path, tmp_path: Path) -> None:
    """Killed (SIGKILL) as it heals its second finalist (the first one trained, heal's data collected): beside OUT only
    OUT's partial directory, which holds the search's scratch (the heal data); TMPDIR, polled every 20 ms while the
    child ran, never above 1 MB, and nothing appeared beside OUT but its partial directory at any poll. The next run
    (every finalist trained, polled the same way) removes it, succeeds, and leaves nothing beside OUT; TMPDIR never
    above 1 MB. The child's working directory stays empty throughout."""
    out = tmp_path / "work" / "tuned"
    out.parent.mkdir()
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    argv = ["tune-mtp", str(keep), "--from", str(TINY_MTP_ASSET), "--out", str(out), "--device", "cpu", *SEARCH,
            *HEAL]  # fmt: skip
    partial = f".{out.name}{PARTIAL_MARK}"
    killed = _child(tmp_path, argv, ("mtpquant.heal.finalists", "FinalistHealer", "heal"), tmpdir, kill_at=2,
                    final=out)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]  # killed mid-run: in its second heal, after the first
    assert killed.polls > 10  # the poller watched the run
    left = beside(out)
    assert len(left) == 1 and left[0].startswith(partial), left
    assert all(n.startswith(partial) for n in killed.seen_beside), killed.seen_beside
    scratch = out.parent / left[0] / ".search-scratch" / "heal-data"
    assert scratch.is_dir() and du(scratch) > 0  # the heal data, where the clean-up finds it
    assert killed.tmp_peak <= MB, (killed.tmp_peak, sorted(p.name for p in tmpdir.rglob("*")))
    done = _child(tmp_path, argv, None, tmpdir, final=out)
    assert done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1])["code"] == 0, done.stderr[-3000:]
    assert beside(out) == [] and not (out / ".search-scratch").exists()
    assert all(n.startswith(partial) for n in done.seen_beside), done.seen_beside
    assert done.tmp_peak <= MB, (done.tmp_peak, sorted(p.name for p in tmpdir.rglob("*")))
    assert not any((tmp_path / "cwd").iterdir())
    report = json.loads((out / "mtp_search/report.json").read_text())
    healed = [j for j in report["evaluated"] if j["role"] == "healed"]
    assert report["healed"] and len(healed) >= 2  # every finalist healed, the killed run reached the second


def test_tune_mtp_in_place(keep: Path, tmp_path: Path) -> None:
    """--in-place: QUANT's MTP replaced (every other tensor QUANT's bytes), nothing left beside it."""
    quant = tmp_path / "quant"
    shutil.copytree(keep, quant)
    result = tune_mtp(TuneOptions(quant=quant, source=TINY_MTP_ASSET, in_place=True, search=SETTINGS, device="cpu",
                                  progress=False))  # fmt: skip
    assert result.search is not None and not result.search.choice.assignment.all_bf16
    assert tensor_digests(quant, mtp=False) == tensor_digests(keep, mtp=False)
    assert tensor_digests(quant, mtp=True) != tensor_digests(keep, mtp=True)
    assert (quant / "mtp_search/report.json").is_file() and beside(quant) == []


@pytest.mark.parametrize("in_place", [True, False])
def test_tune_mtp_refuses_a_quant_changed_during_the_search(keep: Path, tmp_path: Path, in_place: bool) -> None:
    """QUANT snapshotted before the search: a file of QUANT changed while the search measures is refused before
    anything is put in place (GRAFT_REFUSED); QUANT is as it was (but the change), nothing left beside it or OUT."""
    import mtpquant.search.run as search_run

    quant = tmp_path / "quant"
    shutil.copytree(keep, quant)
    real = search_run.search_mtp

    def changing(*args: Any, **kwargs: Any) -> Any:
        (quant / "README.md").write_text("changed behind tune-mtp's back\n")
        return real(*args, **kwargs)

    before = tree(quant)
    out = None if in_place else tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search_run, "search_mtp", changing)
        with pytest.raises(GraftError, match="changed while tuning the MTP"):
            tune_mtp(TuneOptions(quant=quant, source=TINY_MTP_ASSET, in_place=in_place, out=out, search=SETTINGS,
                                 device="cpu", progress=False))  # fmt: skip
    after = tree(quant)
    assert after.pop("README.md") == hashlib.sha256(b"changed behind tune-mtp's back\n").hexdigest()
    assert after == {k: v for k, v in before.items() if k != "README.md"}
    assert beside(quant) == [] and (out is None or not out.exists())


def test_tune_mtp_in_place_killed_during_the_search(keep: Path, tmp_path: Path) -> None:
    """--in-place killed while the search measures: QUANT byte for byte as it was, beside it only its partial
    directory; the next run cleans it up and tunes QUANT."""
    quant = tmp_path / "work" / "quant"
    shutil.copytree(keep, quant)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    before = tree(quant)
    argv = ["tune-mtp", str(quant), "--from", str(TINY_MTP_ASSET), "--in-place", "--device", "cpu", *SEARCH]
    killed = _child(tmp_path, argv, ("mtpquant.search.run", "", "search"), tmpdir, final=quant)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert tree(quant) == before
    left = beside(quant)
    partial = f".{quant.name}{PARTIAL_MARK}"
    assert len(left) == 1 and left[0].startswith(partial), left
    assert all(n.startswith(partial) for n in killed.seen_beside) and killed.tmp_peak <= MB
    done = _child(tmp_path, argv, None, tmpdir, final=quant)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(n.startswith(partial) for n in done.seen_beside) and done.tmp_peak <= MB
    assert beside(quant) == [] and tensor_digests(quant, mtp=False) == tensor_digests(keep, mtp=False)
    assert tensor_digests(quant, mtp=True) != tensor_digests(keep, mtp=True)
