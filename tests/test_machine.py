"""How the CLI's process computes on the CPU: the cores it counts and the OpenMP settings it chooses (#33)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpquant.runtime.machine import compute_cores, tune_cpu_runtime

pytestmark = pytest.mark.dev

REPO = Path(__file__).resolve().parents[1]


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    """A fake /sys/devices/system/cpu: each CPU's thread_siblings_list."""
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return root


def _cgroup(root: Path, cpu_max: str | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def test_smt_siblings_count_as_one_core(tmp_path: Path) -> None:
    # 4 cores with two hyperthreads each, numbered the way Linux numbers them (sibling of n is n + 4)
    sysfs = _topology(tmp_path / "sys", {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    cgroup = _cgroup(tmp_path / "cg", "max 100000")
    assert compute_cores(set(range(8)), sysfs, cgroup) == 4
    # a mask holding one thread of core 0 and both of core 1: two cores
    assert compute_cores({0, 1, 5}, sysfs, cgroup) == 2


def test_a_cpu_quota_bounds_the_cores(tmp_path: Path) -> None:
    sysfs = _topology(tmp_path / "sys", {c: str(c) for c in range(16)})
    assert compute_cores(set(range(16)), sysfs, _cgroup(tmp_path / "a", "200000 100000")) == 2
    assert compute_cores(set(range(16)), sysfs, _cgroup(tmp_path / "b", "150000 100000")) == 2  # 1.5 CPUs: 2 threads
    assert compute_cores(set(range(16)), sysfs, _cgroup(tmp_path / "c", "50000 100000")) == 1
    assert compute_cores(set(range(16)), sysfs, _cgroup(tmp_path / "d", "max 100000")) == 16
    assert compute_cores(set(range(16)), sysfs, _cgroup(tmp_path / "e", None)) == 16  # cgroup v1 / no file


def test_missing_topology_counts_each_cpu(tmp_path: Path) -> None:
    assert compute_cores({0, 3, 7}, tmp_path / "nothing", tmp_path / "nothing") == 3


def test_the_cli_settings_and_a_users_own() -> None:
    env: dict[str, str] = {}
    assert tune_cpu_runtime(env, cores=2, visible=2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    # fewer cores than the CPUs OpenMP would count (SMT, a quota): one thread per core
    env = {}
    assert tune_cpu_runtime(env, cores=4, visible=8) == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "4"}
    # a user's own choice is kept, each variable by itself
    env = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "8"}
    assert tune_cpu_runtime(env, cores=4, visible=8) == {}
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "8"}
    env = {"GOMP_SPINCOUNT": "300000"}
    assert tune_cpu_runtime(env, cores=4, visible=8) == {"OMP_NUM_THREADS": "4"}
    assert "OMP_WAIT_POLICY" not in env


@pytest.mark.parametrize(
    ("given", "seen"),
    [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "1000"}, "unset")],
)
def test_the_command_sets_the_wait_policy_before_torch_loads(given: dict[str, str], seen: str) -> None:
    # the console script's process: the policy is in the environment libgomp reads when a command imports torch
    code = (
        "import os, sys\n"
        "from mtpquant.cli import main\n"
        "rc = main(['inspect', '/nonexistent-checkpoint'])\n"
        "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), 'torch' in sys.modules, rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, **given, "PYTHONPATH": str(REPO)}, capture_output=True, text=True
    )
    policy, torch_loaded, rc = out.stdout.split()
    assert (policy, torch_loaded) == (seen, "False") and rc != "0"
