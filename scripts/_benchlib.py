"""Helpers shared by the skeleton benchmarks (bench_inspect, bench_keep_copy, bench_skeleton_graft).

Machine facts, child processes with their peak RSS and I/O counters, the ``cp`` baseline, and
replacing one ``## `` section of docs/BENCHMARKS.md while leaving every other section alone.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "docs" / "BENCHMARKS.md"
LAYOUTS = REPO / "tests" / "fixtures" / "real-layouts"
PYTHON = sys.executable


def machine(tmp: Path | None = None) -> dict[str, Any]:
    """nproc, RAM, CPU model, load average, Python, and the filesystem of ``tmp``."""
    mem_kib = 0
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    fs = "n/a"
    if tmp is not None:
        try:
            out = subprocess.run(["df", "-T", str(tmp)], capture_output=True, text=True, check=True).stdout
            fs = out.splitlines()[-1].split()[1]
        except (OSError, subprocess.CalledProcessError, IndexError):
            pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": mem_kib / 2**20,
        "cpu": cpu,
        "python": platform.python_version(),
        "fs": fs,
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def machine_line(m: dict[str, Any]) -> str:
    """One Markdown line describing the machine."""
    load = ", ".join(f"{x:.2f}" for x in m["load"]) if m["load"] else "n/a"
    return (
        f"Machine: nproc {m['nproc']}, RAM {m['ram_gib']:.1f} GiB, CPU {m['cpu']}, Python {m['python']}, "
        f"temp filesystem {m['fs']}, load average {load} at the end of the run (machine shared with other jobs)."
    )


def command_line(script: str) -> str:
    """The command that ran this benchmark, as a user would type it."""
    return " ".join([".venv/bin/python", f"scripts/{script}", *map(shlex.quote, sys.argv[1:])])


def today() -> str:
    """ISO date."""
    return _dt.date.today().isoformat()


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (empty where unavailable)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


@dataclass
class ChildRun:
    """A finished child process: wall time, peak RSS and its last stdout line parsed as JSON."""

    wall: float
    max_rss: int  # bytes (VmHWM of the child's own address space)
    output: dict[str, Any]
    returncode: int
    stderr: str


# Runs a Python command line and reports its own peak RSS (VmHWM) on stderr at exit. ru_maxrss from
# wait4 is not usable here: Linux keeps ru_maxrss across execve, so a child forked from a large
# benchmark process would report the parent's RSS. VmHWM belongs to the new address space.
_WRAPPER = r"""
import atexit, runpy, sys
def _hwm():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                sys.stderr.write("\n__VMHWM_KB__ %s\n" % line.split()[1])
                sys.stderr.flush()
atexit.register(_hwm)
args = sys.argv[1:]
if args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
elif args[0] == "-c":
    sys.argv = ["-c", *args[2:]]
    exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
"""


def run_python(args: list[str]) -> ChildRun:
    """Run ``python ARGS`` (a script, ``-m module`` or ``-c code``) in a fresh process; its peak RSS is VmHWM."""
    import tempfile

    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        t0 = time.perf_counter()
        proc = subprocess.run([PYTHON, "-c", _WRAPPER, *args], stdout=fout, stderr=ferr, text=True, check=False)
        wall = time.perf_counter() - t0
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    rss = 0
    for line in err.splitlines():
        if line.startswith("__VMHWM_KB__ "):
            rss = int(line.split()[1]) * 1024
    data: dict[str, Any] = {}
    # the whole output when it is one JSON object (``--json`` is indented), else its last line that is one
    for text in (out, *reversed(out.strip().splitlines())):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            data = parsed
            break
    return ChildRun(wall, rss, data, proc.returncode, err)


def import_rss(modules: str = "mtpquant, torch") -> int:
    """Peak RSS (bytes) of a fresh interpreter that only imports ``modules``."""
    run = run_python(["-c", f"import {modules}"])
    if run.returncode != 0:
        raise RuntimeError(f"importing {modules} failed: {run.stderr.strip()[-400:]}")
    return run.max_rss


def timed_cp(src: Path, dst: Path) -> tuple[float, float]:
    """(``cp src dst`` seconds, seconds until the copy is also fsynced with ``sync dst``)."""
    t0 = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    t1 = time.perf_counter()
    subprocess.run(["sync", str(dst)], check=True)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0


def write_flat(path: Path, chunks: Any) -> int:
    """Write an iterable of byte chunks to ``path`` (fsynced); returns the byte count."""
    n = 0
    with path.open("wb") as fh:
        for chunk in chunks:
            fh.write(chunk)
            n += len(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return n


def write_section(heading: str, section: str, path: Path = BENCHMARKS) -> None:
    """Insert or replace the section that starts with ``heading``; every other section stays as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + section.rstrip("\n") + "\n" + ("\n" + tail if tail else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(new)
    os.replace(tmp, path)


def fmt_bytes(n: float) -> str:
    """Human bytes in decimal units (as the layout tables' totals are compared in GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def drop_cache(paths: list[Path]) -> None:
    """Evict these (clean, fsynced) files' pages from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
