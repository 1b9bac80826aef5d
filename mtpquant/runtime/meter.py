"""What a run measures of itself: seconds and peak resident memory per named step, and the bytes it wrote.

convert and heal both time their steps with ``Timer`` and report ``peak_rss_bytes``; convert also reports
``bytes_written_so_far`` (its benchmark's write amplification).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Timer", "bytes_written_so_far", "peak_rss_bytes"]


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def bytes_written_so_far() -> int:
    """Bytes this process has written to files and pipes (Linux ``/proc/self/io`` wchar); 0 where unknown."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class Timer:
    """Seconds per named step, summed over the step's entries (``with timer("load"): ...``), and the process's peak
    RSS when each step last ended (which step raised it)."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.peak_rss_after: dict[str, int] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
            self.peak_rss_after[name] = peak_rss_bytes()
