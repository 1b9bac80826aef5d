"""The README's main job, ``mtpquant demo`` on the trained tiny Qwen3.5, run once per test process.

The demo converts with ``--keep-mtp`` (the calibration of ``tests/support/heal.py``'s ``CALIB``) and heals the quant in
place with heal's defaults: the default heal of the keep quant. tests/test_demo.py checks the story it prints, and
tests/test_engine_heal.py serves its healed quant in vLLM against the unhealed convert (``HealedTiny.quant("keep")``,
the same main-model bytes: checked there), so the suite runs that heal once instead of twice (both modules are one
xdist work unit, tests/support/lanes.py ``SHARED_UNITS``).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

from mtpquant.cli import main as cli

__all__ = ["DemoRun", "run_demo"]


@dataclass(frozen=True)
class DemoRun:
    """``mtpquant -q demo --workdir WORKDIR --device cpu``: its exit code and what it printed."""

    workdir: Path
    code: int
    out: str

    @property
    def quant(self) -> Path:
        """The demo's quant (healed in place when heal found it better)."""
        return self.workdir / "tiny-qwen3_5-nvfp4"


def run_demo(workdir: Path) -> DemoRun:
    """Run the demo in ``workdir`` (the CLI in this process, as a user's command), capturing its standard output."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli(["-q", "demo", "--workdir", str(workdir), "--device", "cpu"])
    return DemoRun(workdir, code, buffer.getvalue())
