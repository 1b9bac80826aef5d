"""What this machine has to give: its memory (RAM as the kernel and the cgroup allow, GPU 0's as the driver says),
and the device a run computes on.

One home for the probes convert's memory plan (``convert/memory.py``) and the engines mtpquant starts
(``engine/sizing.py``) both size themselves by, and for ``--device`` (convert and validate: one resolver, one
exit code).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from mtpquant.errors import DeviceError

__all__ = ["available_cpu_bytes", "gpu_memory", "resolve_device", "total_cpu_bytes"]


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
