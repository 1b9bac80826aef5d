"""Shared fixtures: tiny real-layout checkpoints built once per session, guarded read-only."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mtpquant.runtime.machine import compute_cores, tune_cpu_runtime


def _worker_threads() -> None:
    """Under pytest-xdist, each worker computes on its share of the cores (``OMP_NUM_THREADS``, unless set): the
    workers already keep every core busy, and the tiny models' operations are too small to gain from threads that
    wake and wait at each of them (three slow modules, two workers on 2 cores: 396 -> 327 CPU-s, 216 -> 179 s,
    docs/BENCHMARKS.md "the test lanes"). The subprocesses and engines the tests start inherit it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, compute_cores() // workers)))


# The tests run the API in this process: under the CLI's OpenMP settings (torch's threads otherwise spin while they
# wait, which on a shared machine burns the CPU other jobs need), chosen before torch is first imported.
_worker_threads()
tune_cpu_runtime()

from mtpquant.synth.tiny import make_tiny_checkpoint  # noqa: E402
from tests.support.demo import DemoRun, run_demo  # noqa: E402
from tests.support.engine import EnginePool, record_engine_starts  # noqa: E402
from tests.support.heal import HealedTiny  # noqa: E402
from tests.support.hubserver import LocalHub  # noqa: E402
from tests.support.lanes import LanesPlugin, work_unit  # noqa: E402

pytest_plugins = ["pytester"]  # tests/test_lanes.py runs throwaway test projects

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A copy of shared/fixtures/real-layouts (tables of real Hub checkpoints), so a bare clone can test.
REAL_LAYOUTS = Path(__file__).resolve().parent / "fixtures" / "real-layouts"
# Quants made by the peers' own tools (scripts/make_peer_fixtures.py), committed.
PEER_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "peers"


def pytest_configure(config: pytest.Config) -> None:
    """The lanes (tests/support/lanes.py): every module declares exactly one; the full lane allows only the
    documented skips."""
    config.pluginmanager.register(LanesPlugin.from_env(), "mtpquant-lanes")


def pytest_report_header(config: pytest.Config) -> str:
    """The free disk where tests write: a run that fails on a full disk says in its first lines how much it had."""
    import tempfile

    free = shutil.disk_usage(tempfile.gettempdir()).free
    return f"free disk under {tempfile.gettempdir()}: {free / 2**30:.1f} GiB (the suite needs about 6 GiB)"


# The modules that take longest (seconds of one worker, beside the other, from a full run's --durations), heaviest
# first. pytest-xdist hands whole modules to the workers in collection order (``--no-loadscope-reorder`` in
# pyproject.toml; its default order, by number of tests, left the few-test engine modules to the end: one worker ran
# the last 9 minutes alone), so these are collected first and the many small modules fill in around them.
# (test_engine_heal's weight also puts it before test_engine_search, the module it shares a worker and servers with
# (tests/support/lanes.py SHARED_UNITS): their shared server is started first and still alive when search needs it.)
# From the full lane's --durations on 2026-12-07 after the nightly lane took the measurements at scale (load 8-10,
# the first 43 minutes: the engine modules and the heavy slow ones); the rest from the development lane's.
HEAVY_MODULES = {
    "test_engine_validate.py": 1330,
    "test_engine_heal.py": 700,  # it runs the demo (tests/support/demo.py) for itself and test_demo
    "test_engine_search.py": 310,
    "test_search.py": 385,
    "test_demo.py": 60,
    "test_engine_peers.py": 275,
    "test_convert_scale.py": 265,
    "test_heal.py": 240,
    "test_graft_hub.py": 195,
    "test_heal_nextn.py": 185,
    "test_engine_nextn.py": 170,
    "test_nextn_vllm.py": 170,
    "test_inspect_fixes.py": 220,
    "test_validate_tiny.py": 115,
    "test_convert_nextn.py": 150,
    "test_search_heal.py": 150,
    "test_heal_sampling.py": 75,
    "test_validate_sglang.py": 50,
    "test_nextn_inspect.py": 35,
    "test_publish.py": 30,
    "test_convert_qwen4_exp.py": 40,
    "test_skeleton.py": 30,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heavy modules first (``HEAVY_MODULES``), then the rest by number of tests (xdist's own order); a module's
    tests stay together and in their order."""
    first: dict[str, int] = {}
    count: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.path.name, i)
        count[item.path.name] = count.get(item.path.name, 0) + 1
    items.sort(key=lambda it: (-HEAVY_MODULES.get(it.path.name, 0), -count[it.path.name], first[it.path.name]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope``, the modules that share engine servers one unit (tests/support/lanes.py ``work_unit``)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ModuleUnits(config, log)


def _fingerprint(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """Build (once) and return the path of a tiny checkpoint variant; fails if a test writes into it."""
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, tuple[Path, str]] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            path = make_tiny_checkpoint(root / variant, variant)
            built[variant] = (path, _fingerprint(path))
        return built[variant][0]

    yield get
    for variant, (path, fp) in built.items():
        assert _fingerprint(path) == fp, f"a test modified the shared tiny checkpoint {variant}"


@pytest.fixture(scope="session")
def naive_export_factory(
    tiny_factory: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Path]]:
    """A real modelopt NVFP4 export of a tiny variant, made the naive way (MTP lost, still declared)."""
    from tests.support.naive_export import naive_modelopt_export

    root = tmp_path_factory.mktemp("naive")
    built: dict[str, tuple[Path, str]] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            path = naive_modelopt_export(tiny_factory(variant), root / variant)
            built[variant] = (path, _fingerprint(path))
        return built[variant][0]

    yield get
    for variant, (path, fp) in built.items():
        assert _fingerprint(path) == fp, f"a test modified the shared naive export {variant}"


@pytest.fixture
def tiny_copy(tiny_factory: Callable[[str], Path], tmp_path: Path) -> Callable[[str], Path]:
    """A private, writable copy of a tiny checkpoint variant."""

    def get(variant: str) -> Path:
        dst = tmp_path / f"copy-{variant}"
        shutil.copytree(tiny_factory(variant), dst)
        return dst

    return get


@pytest.fixture(scope="session")
def real_layouts() -> Path:
    """The directory of real checkpoint layout tables (shared fixtures)."""
    return REAL_LAYOUTS


@pytest.fixture(scope="session")
def peer_quant() -> Iterator[Callable[[str], Path]]:
    """The path of a committed peer quant (tests/fixtures/peers/NAME); fails if a test writes into one."""
    seen: dict[str, str] = {}

    def get(name: str) -> Path:
        path = PEER_FIXTURES / name
        seen.setdefault(name, _fingerprint(path))
        return path

    yield get
    for name, fp in seen.items():
        assert _fingerprint(PEER_FIXTURES / name) == fp, f"a test modified the committed peer quant {name}"


@pytest.fixture(scope="session")
def healed_tiny(tmp_path_factory: pytest.TempPathFactory) -> HealedTiny:
    """The trained tiny model converted (keep / quantize) and healed with heal's defaults, built on first use."""
    return HealedTiny(tmp_path_factory.mktemp("healed-tiny"))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """``mtpquant demo`` as the README runs it, once per process (tests/test_demo.py, tests/test_engine_heal.py)."""
    return run_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def healed_tiny_qwen4(tmp_path_factory: pytest.TempPathFactory) -> HealedTiny:
    """The same of the trained tiny Qwen3.8-Flash-Next (Qwen4-Exp)."""
    from mtpquant.synth.train import TINY_MTP_ASSETS

    return HealedTiny(tmp_path_factory.mktemp("healed-tiny-qwen4"), TINY_MTP_ASSETS["qwen4_exp"])


@pytest.fixture(scope="session", autouse=True)
def _engine_starts() -> Iterator[None]:
    """With MTPQUANT_ENGINE_STARTS=FILE, every engine server this session starts is a line of FILE (.ci/run counts)."""
    with record_engine_starts():
        yield


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    """Real vLLM CPU servers, shared by the engine tests (the engine environment is built when missing)."""
    from tests.support.vllm_env import ensure_vllm_env

    pool = EnginePool(ensure_vllm_env(), tmp_path_factory.mktemp("vllm-logs"))
    yield pool
    pool.close()


@pytest.fixture
def local_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    """A local server in the Hub's URL layout; the real huggingface_hub client is pointed at it."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with LocalHub(tmp_path / "hub-root") as server, server.client_env(tmp_path / "hf_home"):
        yield server
    assert server.errors == []
