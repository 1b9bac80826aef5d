"""What this machine has to give: its memory (RAM as the kernel and the cgroup allow, GPU 0's as the driver says), its
CPU cores, and the device a run computes on.

One home for the probes convert's memory plan (``convert/memory.py``) and the engines mtpquant starts
(``engine/sizing.py``) both size themselves by, for ``--device`` (convert and validate: one resolver, one
exit code), and for how the CLI's process computes on the CPU (``tune_cpu_runtime``: OpenMP's thread count and wait
policy, chosen before torch loads, a user's own setting kept).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import MutableMapping
from pathlib import Path
from typing import Literal, get_args

from mtpquant.errors import DeviceError, UsageError

__all__ = [
    "COMPUTE_DTYPES",
    "CPU_RUNTIME_VARIABLES",
    "DEVICES",
    "DTYPE_BYTES",
    "ComputeDtype",
    "available_cpu_bytes",
    "compute_cores",
    "compute_dtype",
    "gpu_memory",
    "resolve_device",
    "total_cpu_bytes",
    "tune_cpu_runtime",
]

# The variables ``tune_cpu_runtime`` may set; a user who sets one (or GOMP_SPINCOUNT, libgomp's own knob for the
# wait) has chosen, and that choice is kept.
CPU_RUNTIME_VARIABLES = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")


# ``--device``'s names (where a run computes on one GPU, ``cuda:N`` too: ``resolve_device(indexed=True)``).
DEVICES = ("cpu", "cuda", "auto")
# ``--dtype``'s names, the dtypes a model computes in, and their bytes per element.
ComputeDtype = Literal["float32", "bfloat16", "float16"]
COMPUTE_DTYPES: tuple[str, ...] = get_args(ComputeDtype)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def compute_dtype(device: str, dtype: str | None = None) -> str:
    """The dtype a run computes in on ``device`` (``resolve_device``'s answer): ``dtype`` (``--dtype``), else float32
    on the CPU (BF16 weights upcast exactly) and bfloat16 on CUDA; another name is a one-line ``UsageError``."""
    name = dtype or ("float32" if device == "cpu" else "bfloat16")
    if name not in DTYPE_BYTES:
        raise UsageError(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {name!r}")
    return name


def resolve_device(device: str, *, indexed: bool = True, probe: bool = True) -> str:
    """``--device`` as the device a run computes on: ``cpu``, ``cuda``, ``cuda:N`` (where ``indexed``: validate runs
    on one GPU; convert's ``cuda`` spreads the model over every GPU it may use) or ``auto`` (``cuda`` when torch sees
    a GPU, else ``cpu``). Any other name, or CUDA that torch does not see, is a one-line ``DeviceError`` (exit 2).
    ``probe`` False (a dry run): the name is checked but no GPU is looked for, and ``auto`` is ``cuda`` only where an
    NVIDIA driver is present (torch is not imported)."""
    names = "cpu, cuda, cuda:N or auto" if indexed else "cpu, cuda or auto"
    if device not in ("cpu", "cuda", "auto") and not (indexed and re.fullmatch(r"cuda:\d+", device)):
        raise DeviceError(f"--device must be {names}, got {device!r}")
    if device == "cpu":
        return "cpu"
    if not probe:
        if device != "auto":
            return device
        if not Path("/proc/driver/nvidia").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
            return "cpu"
    import torch

    if not torch.cuda.is_available():
        if device == "auto":
            return "cpu"
        raise DeviceError(f"--device {device}: no CUDA device is visible to torch (use --device cpu)")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise DeviceError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return "cuda" if device == "auto" else device


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo(key: str, meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_cpu_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory this process can still use: ``MemAvailable``, bounded by the cgroup (v2) limit; None if unknown."""
    available = _meminfo("MemAvailable", meminfo)
    limit, current = _read_int(cgroup / "memory.max"), _read_int(cgroup / "memory.current")
    if limit is not None and current is not None:
        room = max(limit - current, 0)
        available = room if available is None else min(available, room)
    return available


def total_cpu_bytes(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The machine's RAM (``MemTotal``), bounded by the cgroup (v2) limit; None if unknown."""
    total = _meminfo("MemTotal", meminfo)
    limit = _read_int(cgroup / "memory.max")
    return min(total, limit) if total is not None and limit is not None else total if total is not None else limit


def gpu_memory() -> tuple[int | None, int | None]:
    """Total and free memory of GPU 0, from ``nvidia-smi`` (None, None without one): an engine's own torch drives the
    GPU, not this process's."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        total, free = (int(v.strip()) * 2**20 for v in out.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, None
    return total, free


def _cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``0-3,8,10-11``) as CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def compute_cores(
    cpus: set[int] | None = None,
    sysfs: Path = Path("/sys/devices/system/cpu"),
    cgroup: Path = Path("/sys/fs/cgroup"),
) -> int:
    """The CPU cores this process can compute on: the CPUs of its affinity mask (``cpus``, default the process's
    own), SMT siblings counted once (a core's hyperthreads share its vector units: the physical-core count llama.cpp,
    ONNX Runtime and torch's MKL default use), bounded by the cgroup's CPU quota (``cpu.max``: a container given 2
    CPUs of a 64-core host has 2, however many cores its mask shows). At least 1."""
    if cpus is None:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: set[frozenset[int]] = set()
    for cpu in cpus:
        try:
            siblings = _cpu_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = {cpu}
        cores.add(frozenset(siblings & cpus or {cpu}))
    count = max(len(cores), 1)
    try:
        quota, _, period = (cgroup / "cpu.max").read_text().strip().partition(" ")
        if quota != "max" and int(period) > 0:
            count = min(count, max(math.ceil(int(quota) / int(period)), 1))
    except (OSError, ValueError):
        pass
    return count


def tune_cpu_runtime(
    environ: MutableMapping[str, str] | None = None, *, cores: int | None = None, visible: int | None = None
) -> dict[str, str]:
    """Choose how torch's OpenMP threads compute, before torch is imported (libgomp reads its environment once, when
    it loads); returns what it set. Two settings, each only where the user set nothing (``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT``; ``OMP_NUM_THREADS``):

    - ``OMP_WAIT_POLICY=PASSIVE``: a thread that reaches the end of a parallel region sleeps instead of spinning
      (libgomp spins 300,000 times by default). On a machine another process also uses, the spinning threads take
      the cores the working ones need: beside one busy process the tiny model's convert took 5.9x the CPU time, its
      heal 2.5x (docs/BENCHMARKS.md, "the CLI on a busy machine"); with it, what a hand-tuned shell gets. What
      Intel's and PyTorch's CPU guides advise for a process sharing its cores.
    - ``OMP_NUM_THREADS``: the cores the process can compute on (``compute_cores``), set only when that is fewer
      than the CPUs the OpenMP runtime would count (a CPU quota, SMT siblings): more threads than cores wait on each
      other at every parallel region.

    The CLI calls this first; the engines it starts inherit the same environment. A program using the Python API
    runs under its own settings (call this before importing torch to get the CLI's). ``cores`` and ``visible`` (the
    CPUs OpenMP counts: the affinity mask) default to this machine's."""
    env = os.environ if environ is None else environ
    chosen: dict[str, str] = {}
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        chosen["OMP_WAIT_POLICY"] = "PASSIVE"
    if "OMP_NUM_THREADS" not in env:
        n = compute_cores() if cores is None else cores
        if visible is None:
            visible = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if n < visible:
            chosen["OMP_NUM_THREADS"] = str(n)
    env.update(chosen)
    return chosen
