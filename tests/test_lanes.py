"""The test lanes (tests/support/lanes.py): a module without exactly one lane is a collection error naming it; the
development lane's marker expression leaves out slow and engine tests; in the full lane an undocumented skip fails
the run and a documented one does not. Checked on throwaway test projects run by pytest itself (pytester)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.lanes import (
    ALLOWED_SKIPS,
    DEV_LANE,
    FULL_LANE_ENV,
    LANES,
    NIGHTLY_ENV,
    skip_allowed,
    work_unit,
)

pytestmark = pytest.mark.dev

TESTS = Path(__file__).resolve().parent

CONFTEST = """
from tests.support.lanes import LanesPlugin

def pytest_configure(config):
    config.pluginmanager.register(LanesPlugin.from_env(), "mtpquant-lanes")
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A throwaway test project with this suite's lanes plugin and markers, outside the full lane."""
    monkeypatch.delenv(FULL_LANE_ENV, raising=False)
    monkeypatch.delenv(NIGHTLY_ENV, raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    dev\n    slow\n    engine\n    nightly\n")
    return pytester


def test_a_module_without_a_lane_is_a_collection_error_naming_it(project: pytest.Pytester) -> None:
    project.makepyfile(
        test_fine="import pytest\npytestmark = pytest.mark.dev\ndef test_a(): pass\n",
        test_bare="import pytest\ndef test_b(): pass\n",
    )
    result = project.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*test_bare.py: declares no test lane: add `pytestmark = pytest.mark.dev`*"])
    assert "test_fine.py:" not in result.stdout.str()


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ("pytestmark = [pytest.mark.dev, pytest.mark.slow]", "declares 2 test lanes (dev, slow)"),
        ("pytestmark = pytest.mark.skipif(False, reason='x')", "declares no test lane"),
        ("pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings('ignore')]", None),
    ],
)
def test_exactly_one_lane_at_module_level(project: pytest.Pytester, declaration: str, message: str | None) -> None:
    project.makepyfile(test_m=f"import pytest\n{declaration}\ndef test_a(): pass\n")
    result = project.runpytest("-p", "no:cacheprovider")
    if message is None:
        result.assert_outcomes(passed=1)
    else:
        assert result.ret == pytest.ExitCode.INTERRUPTED
        result.stdout.fnmatch_lines([f"*test_m.py: {message}*"])


def test_the_development_lane_leaves_out_slow_and_engine_tests(project: pytest.Pytester) -> None:
    project.makepyfile(
        test_dev=(
            "import pytest\npytestmark = pytest.mark.dev\n"
            "def test_quick(): pass\n"
            "@pytest.mark.slow\ndef test_heavy(): pass\n"
            "@pytest.mark.engine\ndef test_server(): pass\n"
        ),
        test_slow="import pytest\npytestmark = pytest.mark.slow\ndef test_model(): pass\n",
        test_engine="import pytest\npytestmark = pytest.mark.engine\ndef test_vllm(): pass\n",
    )
    dev = project.runpytest("-p", "no:cacheprovider", "-m", DEV_LANE, "-v")
    dev.assert_outcomes(passed=1, deselected=4)
    dev.stdout.fnmatch_lines(["*test_dev.py::test_quick PASSED*"])
    project.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=5)


SKIPS = """
import pytest
pytestmark = pytest.mark.dev

def test_opt_in():
    pytest.skip({allowed!r})

@pytest.mark.skipif(True, reason="the vLLM test engine is not installed")
def test_engine_missing():
    pass
"""


@pytest.mark.parametrize("full", [False, True])
def test_an_undocumented_skip_fails_the_full_lane(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, full: bool
) -> None:
    project.makepyfile(test_skips=SKIPS.format(allowed="MTPQUANT_SGLANG_URL names no SGLang server"))
    if full:
        monkeypatch.setenv(FULL_LANE_ENV, "1")
    result = project.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)
    if not full:  # the development lane: skips are reported, not failures
        assert result.ret == pytest.ExitCode.OK
        return
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert "test_skips.py::test_engine_missing: the vLLM test engine is not installed" in out
    assert "test_skips.py::test_opt_in:" not in out  # documented in ALLOWED_SKIPS


def test_a_documented_skip_alone_passes_the_full_lane(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    project.makepyfile(test_skips=SKIPS.format(allowed="convert published OUT before the kill on this machine")
                       .replace("True, reason", "False, reason"))
    monkeypatch.setenv(FULL_LANE_ENV, "1")
    result = project.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK


NIGHTLY = """
import pytest
pytestmark = pytest.mark.slow

@pytest.mark.nightly(reason="96 prompts through six servers")
def test_at_scale():
    pass

def test_small():
    pass

def test_pretends():
    pytest.skip("nightly: not marked, so not a nightly test")
"""


@pytest.mark.parametrize("lane", ["full", "nightly"])
def test_nightly_tests_run_only_in_the_nightly_lane(
    project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, lane: str
) -> None:
    """Outside the nightly lane a marked test skips with its reason, a skip the full lane allows; a skip that only
    says "nightly:" on an unmarked test is not allowed. In the nightly lane the marked test runs."""
    project.makepyfile(test_scale=NIGHTLY)
    monkeypatch.setenv(FULL_LANE_ENV, "1")
    if lane == "nightly":
        monkeypatch.setenv(NIGHTLY_ENV, "1")
    result = project.runpytest("-p", "no:cacheprovider", "-rs")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the unmarked "nightly:" skip, in both lanes
    assert "test_scale.py::test_pretends: nightly: not marked, so not a nightly test" in out
    if lane == "full":
        result.assert_outcomes(passed=1, skipped=2)
        assert f"nightly: 96 prompts through six servers ({NIGHTLY_ENV}=1 runs it)" in out
        assert "test_scale.py::test_at_scale:" not in out.split("unexpected skips")[1]  # allowed
        assert f"1 nightly tests skipped ({NIGHTLY_ENV}=1 runs them)" in out
    else:
        result.assert_outcomes(passed=2, skipped=1)


def test_a_nightly_mark_without_a_reason_is_a_usage_error(project: pytest.Pytester) -> None:
    project.makepyfile(test_scale="import pytest\npytestmark = pytest.mark.dev\n"
                                  "@pytest.mark.nightly\ndef test_at_scale(): pass\n")  # fmt: skip
    result = project.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_scale.py::test_at_scale: @pytest.mark.nightly needs reason=*"])


def test_every_allowed_skip_is_one_a_test_makes() -> None:
    """Each allowed reason is the reason of a skip somewhere in the suite (no stale entries), and the skips the
    suite can hit for a missing engine or platform are not allowed."""
    sources = "\n".join(p.read_text() for p in sorted(TESTS.rglob("*.py")) if p.name != "lanes.py")
    for pattern, why in ALLOWED_SKIPS:
        assert re.search(pattern, sources), pattern
        assert why
    assert not skip_allowed("Skipped: the vLLM test engine is not installed (python -m tests.support.vllm_env)")
    assert not skip_allowed("Skipped: no mount namespace here (unshare --mount --map-root-user)")
    assert not skip_allowed("needs Linux /proc/self/io")


def test_every_module_of_this_suite_declares_one_lane() -> None:
    """Read from the files' syntax (the collection hook checks the imported modules)."""

    def lanes(path: Path) -> list[str]:
        found = []
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["pytestmark"]:
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                found += [ast.unparse(v).removeprefix("pytest.mark.") for v in values]
        return [name for name in found if name in LANES]

    declared = {path.name: lanes(path) for path in sorted(TESTS.glob("test_*.py"))}
    assert len(declared) >= 79
    assert {name: found for name, found in declared.items() if len(found) != 1} == {}


def test_modules_sharing_engine_servers_are_one_xdist_unit() -> None:
    heal, search = "tests/test_engine_heal.py::test_x", "tests/test_engine_search.py::test_y[a::b]"
    assert work_unit(heal) == work_unit(search) != work_unit("tests/test_engine_validate.py::test_z")
    assert work_unit("tests/test_writer.py::test_a[x]") == work_unit("tests/test_writer.py::test_b") == (
        "tests/test_writer.py"
    )


def test_last_failed_reruns_only_the_failed_tests(project: pytest.Pytester) -> None:
    """pytest's cache is on (nothing in pyproject.toml's addopts or .ci/run turns it off): after a run with one
    failure, ``--lf`` runs that test alone."""
    project.makepyfile(
        test_mixed=(
            "import pytest\npytestmark = pytest.mark.dev\n"
            "def test_ok(): pass\n"
            "def test_also_ok(): pass\n"
            "def test_broken(): assert 1 == 2\n"
        )
    )
    project.runpytest().assert_outcomes(passed=2, failed=1)
    rerun = project.runpytest("--lf", "-v")
    rerun.assert_outcomes(failed=1)  # the two that passed are not run (pytest 9 does not even collect them)
    rerun.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure*", "*test_mixed.py::test_broken FAILED*"])
    assert "::test_ok" not in rerun.stdout.str() and "::test_also_ok" not in rerun.stdout.str()
    root = TESTS.parent
    addopts = re.search(r"^addopts = (.*)$", (root / "pyproject.toml").read_text(), re.M)
    assert addopts is not None and "cacheprovider" not in addopts.group(1)
    assert "cacheprovider" not in (root / ".ci" / "run").read_text()
    assert ".pytest_cache/" in (root / ".gitignore").read_text().splitlines()
