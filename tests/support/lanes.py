"""The test lanes and the skips the full lane allows (registered by tests/conftest.py).

Every test module declares its lane at module level with exactly one of ``pytestmark = pytest.mark.dev`` (unit and
small tiny-model tests, seconds), ``pytest.mark.slow`` (tiny real models through transformers/modelopt, heavier) or
``pytest.mark.engine`` (real vLLM CPU servers); a module that declares none, or more than one, is a collection error
naming it. A single heavier test inside a ``dev`` module carries ``@pytest.mark.slow`` (or ``engine``) itself.

- development lane: ``pytest -m "not slow and not engine"`` (DEV_LANE);
- full lane: plain ``pytest`` (``.ci/run``), with ``MTPQUANT_FULL_LANE=1``: a test skipped for a reason that is not
  in ``ALLOWED_SKIPS`` fails the run (a skip that hides a missing engine, a lost platform feature or a missing
  dependency is a test that did not run);
- nightly lane: ``MTPQUANT_NIGHTLY=1 pytest`` (NIGHTLY_ENV): the full lane plus the tests marked
  ``@pytest.mark.nightly(reason=...)``, the measurements at scale (many prompts, every family's demo, every heal
  proof) whose behaviour a smaller test checks in the full lane. Outside it they skip with ``nightly: <reason>``, the
  one skip the full lane allows besides ``ALLOWED_SKIPS``, and only on a test that carries the mark. A nightly mark
  without a reason is a usage error naming the test.
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
    "NIGHTLY_ENV",
    "NIGHTLY_PREFIX",
    "SHARED_UNITS",
    "LanesPlugin",
    "lane_problem",
    "skip_allowed",
    "work_unit",
]

LANES = ("dev", "slow", "engine")
DEV_LANE = "not slow and not engine"
FULL_LANE_ENV = "MTPQUANT_FULL_LANE"
NIGHTLY_ENV = "MTPQUANT_NIGHTLY"
NIGHTLY_PREFIX = "nightly: "

# The skips the full lane allows besides the nightly tests': (pattern the skip's reason must match, why the test
# cannot run in CI). Any other skip in the full lane is a failure.
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = (
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


# Modules that need the same engine servers (the same checkpoint at the same k) or the same expensive run are one
# xdist work unit, so they run in one worker process with one session pool (tests/support/engine.py) and one session
# fixture: test_engine_heal's unhealed keep quant at k = 3 is test_engine_search's BF16-MTP baseline (both convert it
# through the one ``healed_tiny``; the nightly lane's), and its healed quant is test_demo's (the demo's default heal,
# run once: tests/support/demo.py). Every other module is its own unit, as ``--dist loadscope`` makes them
# (tests/conftest.py ``pytest_xdist_make_scheduler``).
# xdist's own ``--dist loadgroup`` with ``xdist_group`` marks does not group on pytest 9.2
# (pytest-dev/pytest-xdist#1386). All engine modules in one unit would put ~60 % of the suite's time on one worker.
SHARED_UNITS = {
    "test_engine_heal.py": "engine-tiny-keep",
    "test_engine_search.py": "engine-tiny-keep",
    "test_demo.py": "engine-tiny-keep",
}


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


def nightly_reason(item: pytest.Item) -> str | None:
    """The reason of ``item``'s nightly mark (None: not a nightly test); a mark without one is a usage error."""
    mark = item.get_closest_marker("nightly")
    if mark is None:
        return None
    reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "")
    if not isinstance(reason, str) or not reason.strip():
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.nightly needs reason='why it is nightly, and what "
                                "checks the behaviour in the full lane'")
    return reason


@dataclass(eq=False)  # a plugin object: registered by identity
class LanesPlugin:
    """Collection fails for a test module without exactly one lane; nightly tests skip outside the nightly lane; in
    the full lane, an unexpected skip fails."""

    full_lane: bool = False
    nightly: bool = False
    unexpected: list[tuple[str, str]] = field(default_factory=list)
    nightly_skipped: int = 0

    @classmethod
    def from_env(cls) -> LanesPlugin:
        def on(name: str) -> bool:
            return os.environ.get(name, "") not in ("", "0")

        return cls(full_lane=on(FULL_LANE_ENV), nightly=on(NIGHTLY_ENV))

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            reason = nightly_reason(item)
            if reason is not None and not self.nightly:
                item.add_marker(pytest.mark.skip(reason=f"{NIGHTLY_PREFIX}{reason} ({NIGHTLY_ENV}=1 runs it)"))

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
            reason = reason.removeprefix("Skipped: ")
            if reason.startswith(NIGHTLY_PREFIX) and "nightly" in report.keywords:
                self.nightly_skipped += 1
            elif not skip_allowed(reason):
                self.unexpected.append((report.nodeid, reason))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and not hasattr(session.config, "workerinput") and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.nightly_skipped:
            terminalreporter.line(f"{self.nightly_skipped} nightly tests skipped ({NIGHTLY_ENV}=1 runs them)")
        if self.unexpected:
            terminalreporter.section(f"unexpected skips in the full lane ({FULL_LANE_ENV}=1)", red=True)
            for nodeid, reason in self.unexpected:
                terminalreporter.line(f"{nodeid}: {reason}")
            terminalreporter.line("allowed skips: tests/support/lanes.py ALLOWED_SKIPS")
