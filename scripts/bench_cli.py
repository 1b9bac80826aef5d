#!/usr/bin/env python3
"""The CLI as users run it, on a busy machine: ``mtpquant convert`` and ``mtpquant heal`` of the trained tiny model.

    python scripts/bench_cli.py --work /tmp/bench-cli --pairs 3 --write

Each run is the ``mtpquant`` command of this environment in a fresh process, with the calling shell's OpenMP
settings removed (``OMP_*``, ``GOMP_*``, ``KMP_*``, ``MKL_*``: a user's shell has none) and one CPU-bound process
(a Python busy loop) running beside it the whole time, so the machine is busy as a shared one is. Three settings,
run in turn (default, tuned, default, tuned, ...; the untuned runs last, they are slow):

- default: nothing set; what the CLI chooses for itself (``mtpquant.runtime.machine.tune_cpu_runtime``);
- tuned: ``OMP_WAIT_POLICY=PASSIVE`` set by the caller, the setting the test suite and the earlier benchmarks ran
  with (the CLI keeps a user's setting, so this is what a hand-tuned shell gets);
- untuned: ``GOMP_SPINCOUNT=300000``, libgomp's own default spin, which the CLI keeps as a user's choice: the CLI as
  it ran before it chose a wait policy.

CPU time is the child's own (``wait4``: user + system, its threads included); the ratio columns are default over
tuned, pair by pair, median. The sections of docs/BENCHMARKS.md are rewritten with ``--write``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from _benchlib import command_line, machine, machine_line, today, write_section  # noqa: E402

HEADING = "## the CLI on a busy machine (convert and heal of the tiny model)"
ASSET = REPO / "mtpquant" / "assets" / "tiny-qwen3_5-mtp"
MTPQUANT = Path(sys.executable).with_name("mtpquant")
SETTINGS = {"default": {}, "tuned": {"OMP_WAIT_POLICY": "PASSIVE"}, "untuned": {"GOMP_SPINCOUNT": "300000"}}
# docs/BENCHMARKS.md "heal", (a): the default heal of the keep convert, measured with OMP_WAIT_POLICY=PASSIVE set
DOCUMENTED_HEAL_CPU_S = 84.0


@dataclass(frozen=True)
class Run:
    """One finished command: its CPU seconds (user + system) and wall seconds."""

    cpu_s: float
    wall_s: float


def user_env(setting: str) -> dict[str, str]:
    """The environment of a user's shell (no OpenMP / MKL settings) plus the setting's own variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
    return {**env, **SETTINGS[setting]}


def timed(cmd: list[str], setting: str) -> Run:
    """Run ``cmd`` to the end; its own CPU time from ``wait4``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=user_env(setting), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} ({setting}) exited {proc.returncode}: {err.decode()[-2000:]}")
    return Run(usage.ru_utime + usage.ru_stime, wall)


def convert_cmd(out: Path) -> list[str]:
    """``mtpquant convert`` of the tiny model with --keep-mtp, as the README shows it."""
    return [str(MTPQUANT), "-q", "convert", str(ASSET), str(out), "--keep-mtp", "--device", "cpu"]


def heal_cmd(quant: Path, out: Path) -> list[str]:
    """``mtpquant heal`` with the default schedule."""
    return [str(MTPQUANT), "-q", "heal", str(quant), "--from", str(ASSET), "--out", str(out), "--device", "cpu"]


def measure(work: Path, pairs: int, untuned: int) -> dict[str, dict[str, list[Run]]]:
    """Every job's runs per setting, beside one busy process."""
    quant = work / "quant"
    if not quant.exists():
        subprocess.run(convert_cmd(quant), check=True, env=user_env("default"), stdout=subprocess.DEVNULL)
    jobs = {"convert": lambda out: convert_cmd(out), "heal": lambda out: heal_cmd(quant, out)}
    order = [s for _ in range(pairs) for s in ("default", "tuned")] + ["untuned"] * untuned
    runs: dict[str, dict[str, list[Run]]] = {job: {s: [] for s in SETTINGS} for job in jobs}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for job, cmd in jobs.items():
            for setting in order:
                out = work / f"{job}-out"
                shutil.rmtree(out, ignore_errors=True)
                runs[job][setting].append(timed(cmd(out), setting))
                shutil.rmtree(out, ignore_errors=True)
                print(f"{job} {setting}: {runs[job][setting][-1]}", file=sys.stderr)
    finally:
        busy.kill()
        busy.wait()
    return runs


def table(runs: dict[str, dict[str, list[Run]]]) -> str:
    """The Markdown rows: medians per setting, the paired default/tuned ratio, heal against the documented figure."""
    lines = [
        "| command | setting | runs | CPU s (median) | wall s (median) | CPU default / tuned (paired median) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for job, by in runs.items():
        ratio = statistics.median(d.cpu_s / t.cpu_s for d, t in zip(by["default"], by["tuned"]))
        for setting, rs in by.items():
            if not rs:
                continue
            cpu = statistics.median(r.cpu_s for r in rs)
            wall = statistics.median(r.wall_s for r in rs)
            shown = f"{ratio:.2f}x" if setting == "default" else ""
            lines.append(f"| {job} | {setting} | {len(rs)} | {cpu:.1f} | {wall:.1f} | {shown} |")
    heal = statistics.median(r.cpu_s for r in runs["heal"]["default"])
    lines += ["", f"heal, default: {heal:.1f} CPU-s = {heal / DOCUMENTED_HEAL_CPU_S:.2f}x the "
              f"{DOCUMENTED_HEAL_CPU_S:.0f} CPU-s of the \"heal\" section's keep row (goal: within 1.3x)."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="directory for the outputs")
    parser.add_argument("--pairs", type=int, default=3, help="default/tuned pairs per command (default 3)")
    parser.add_argument("--untuned", type=int, default=1, help="untuned runs per command (default 1)")
    parser.add_argument("--write", action="store_true", help="rewrite this section of docs/BENCHMARKS.md")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs = measure(args.work, args.pairs, args.untuned)
    about = (__doc__ or "").split("\n\n", 2)[2].strip()
    section = "\n".join([
        HEADING, "", f"`{command_line('bench_cli.py')}` on {today()}. {about}", "",
        machine_line(machine(args.work)), "", table(runs), "",
    ])
    print(section)
    if args.write:
        write_section(HEADING, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
