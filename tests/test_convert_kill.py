"""Killing convert at a random point (SIGKILL, seeded) leaves no OUT; the rerun succeeds and cleans up."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mtpquant.checkpoint.table import Checkpoint
from mtpquant.checkpoint.writer import PARTIAL_MARK
from mtpquant.convert.run import ConvertOptions, convert

pytestmark = pytest.mark.slow

SEED = 20260501


@pytest.mark.parametrize("point", [0, pytest.param(1, marks=pytest.mark.nightly(
    reason="a third seeded kill point, the latest (0.79 s into the work: on a fast machine after convert finished): "
    "the full lane kills at the other two"
)), 2])  # fmt: skip
def test_sigkill_leaves_no_output_and_rerun_succeeds(
    tiny_factory: Callable[[str], Path], tmp_path: Path, point: int
) -> None:
    src = tiny_factory("qwen3_5_moe")
    out = tmp_path / "out"
    args = [
        "--mtp",
        "extract",
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "32",
        "--device",
        "cpu",
        "--max-shard-size",
        "1MB",
    ]
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpquant", "-q", "convert", str(src), str(out), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    # Kill inside the work, not during imports: once the temp output directory exists (imports, planning and OUT's
    # lock come before it), after a seeded random delay that spans calibration, export and writing on this model
    # (~1 s here). The process lives on for a while after it published OUT: a kill then is not a kill inside the work.
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f".out{PARTIAL_MARK}*")):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(random.Random(SEED + point).uniform(0.0, 1.0))  # several seeded kill points
    finished_first = proc.poll() is not None or out.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    if finished_first:
        pytest.skip("convert published OUT before the kill on this machine")
    assert not out.exists()
    assert not (tmp_path / "out-mtp").exists()
    assert list(tmp_path.glob(f".out*{PARTIAL_MARK}*"))  # the dead run's temp dirs are all that is left

    result = convert(
        ConvertOptions(
            src=str(src),
            out=out,
            mtp="extract",
            calib_samples=2,
            calib_seq_len=32,
            device="cpu",
            max_shard_size="1MB",
            progress=False,
        )
    )
    assert result.output == out and result.mtp_output == tmp_path / "out-mtp"
    Checkpoint.open(out)
    Checkpoint.open(tmp_path / "out-mtp")
    assert not list(tmp_path.glob(f".*{PARTIAL_MARK}*"))  # stale temp dirs of the killed run removed
