"""The test lanes and the skips the full lane allows (registered by tests/conftest.py).

Every test module declares its lane at module level with exactly one of ``pytestmark = pytest.mark.dev`` (unit and
small tiny-model tests, seconds), ``pytest.mark.slow`` (tiny real models through transformers/modelopt, heavier) or
``pytest.mark.engine`` (real vLLM CPU servers); a module that declares none, or more than one, is a collection error
naming it. A single heavier test inside a ``dev`` module carries ``@pytest.mark.slow`` (or ``engine``) itself.

- development lane: ``pytest -m "not slow and not engine"`` (DEV_LANE);
- full lane: plain ``pytest`` (``.ci/run``), with ``MTPQUANT_FULL_LANE=1``: a test skipped for a reason that is not
  in ``ALLOWED_SKIPS`` fails the run (a skip that hides a missing engine, a lost platform feature or a missing
  dependency is a test that did not run).
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

__all__ = [
    "ALLOWED_SKIPS",
    "DEV_LANE",
    "FULL_LANE_ENV",
    "LANES",
    "SHARED_UNITS",
    "LanesPlugin",
    "lane_problem",
    "skip_allowed",
    "work_unit",
]

LANES = ("dev", "slow", "engine")
DEV_LANE = "not slow and not engine"
FULL_LANE_ENV = "MTPQUANT_FULL_LANE"

# The skips the full lane allows: (pattern the skip's reason must match, why the test cannot run in CI). Any other
# skip in the full lane is a failure.
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = (
    (
        r"the default heal takes CPU-minutes: set MTPQUANT_HEAL_PROOF=1",
        "heal's default-schedule proofs (tests/support/heal.py ``proof``): CPU-minutes per mode; one engine-measured "
        "gain with a reduced schedule runs in the full lane instead (tests/test_engine_heal.py)",
    ),
    (
        r"MTPQUANT_SGLANG_URL names no SGLang server",
        "a real SGLang server needs a GPU (SGLang's CPU build is not installable here): the client is tested on "
        "recorded answers; the live test runs where MTPQUANT_SGLANG_URL names a server",
    ),
    (
        r"convert published OUT before the kill on this machine",
        "test_convert_kill: the seeded kill point fell after convert had finished (a fast machine): there was no "
        "kill inside the work to check; the other seeded points still kill inside it",
    ),
)


# Modules that need the same engine servers (the same checkpoint at the same k) are one xdist work unit, so they run
# in one worker process with one session pool (tests/support/engine.py): test_engine_heal's unhealed keep quant at
# k = 3 is test_engine_search's BF16-MTP baseline (both convert it through the one ``healed_tiny``). Every other
# module is its own unit, as ``--dist loadscope`` makes them (tests/conftest.py ``pytest_xdist_make_scheduler``).
# xdist's own ``--dist loadgroup`` with ``xdist_group`` marks does not group on pytest 9.2
# (pytest-dev/pytest-xdist#1386). All engine modules in one unit would put ~60 % of the suite's time on one worker.
SHARED_UNITS = {"test_engine_heal.py": "engine-tiny-keep", "test_engine_search.py": "engine-tiny-keep"}


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or the shared unit of ``SHARED_UNITS``."""
    module = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(module.rsplit("/", 1)[-1], module)


def skip_allowed(reason: str) -> bool:
    """Whether a skip with this reason is one the full lane allows."""
    reason = reason.removeprefix("Skipped: ")
    return any(re.search(pattern, reason) for pattern, _ in ALLOWED_SKIPS)


def _marks(value: Any) -> Iterable[Any]:
    return value if isinstance(value, (list, tuple)) else [value]


def lane_problem(module: ModuleType) -> str | None:
    """What is wrong with ``module``'s lane declaration (None: exactly one of LANES at module level)."""
    names = [getattr(m, "name", None) or getattr(getattr(m, "mark", None), "name", None)
             for m in _marks(getattr(module, "pytestmark", []))]
    lanes = [n for n in names if n in LANES]
    if len(lanes) == 1:
        return None
    if not lanes:
        return ("declares no test lane: add `pytestmark = pytest.mark.dev` (or `slow`, or `engine`) at module "
                "level (tests/support/lanes.py)")
    return f"declares {len(lanes)} test lanes ({', '.join(lanes)}): exactly one of dev, slow, engine"


@dataclass(eq=False)  # a plugin object: registered by identity
class LanesPlugin:
    """Collection fails for a test module without exactly one lane; in the full lane, an unexpected skip fails."""

    full_lane: bool = False
    unexpected: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> LanesPlugin:
        return cls(full_lane=os.environ.get(FULL_LANE_ENV, "") not in ("", "0"))

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Generator[None, pytest.CollectReport,
                                                                                   pytest.CollectReport]:
        report = yield
        if isinstance(collector, pytest.Module) and report.passed:
            problem = lane_problem(collector.obj)
            if problem is not None:
                report.outcome = "failed"
                report.longrepr = f"{collector.nodeid}: {problem}"
                report.result = []
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.full_lane and report.skipped and not hasattr(report, "wasxfail"):
            longrepr = report.longrepr
            # (path, line, "Skipped: reason"); a list once it has crossed from an xdist worker
            reason = str(longrepr[2]) if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)
            if not skip_allowed(reason):
                self.unexpected.append((report.nodeid, reason.removeprefix("Skipped: ")))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and not hasattr(session.config, "workerinput") and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.unexpected:
            terminalreporter.section(f"unexpected skips in the full lane ({FULL_LANE_ENV}=1)", red=True)
            for nodeid, reason in self.unexpected:
                terminalreporter.line(f"{nodeid}: {reason}")
            terminalreporter.line("allowed skips: tests/support/lanes.py ALLOWED_SKIPS")
