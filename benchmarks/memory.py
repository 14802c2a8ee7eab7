"""Per-rank memory: the process's peak RSS, and the peak over the timed steps only.

The process peak (`ru_maxrss`) is set by compilation (Dynamo, Inductor and the C++ compiler driver
allocate far more than training does), so it cannot show what a mode costs while it trains. Linux lets a
process reset its own high-water mark: writing "5" to /proc/self/clear_refs sets VmHWM back to the current
RSS (Documentation/admin-guide/mm/soft-dirty.rst, proc.rst). Reset right before the timed steps, read
VmHWM after them: the steady-state peak. It still counts pages the allocator keeps after a free, so the
step's tensor peak from the profiler (benchmarks/profile_overlap.py) is the sharper number for freed
gradients; this one is what the machine really has to provide.

The reset also resets `ru_maxrss` (both read the kernel's one high-water mark), so `PeakTracker` keeps
the process peak from before the reset itself.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def process_peak_rss_mb() -> float:
    """High-water mark of the whole process so far (compilation included), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it (then read_peak is None)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def read_peak_mb() -> float | None:
    """VmHWM (peak RSS since the last reset, or since start), MiB; None where /proc is unavailable."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) / 1024.0 if match else None


class PeakTracker:
    """The process peak and the steady-state peak of one job: `start_steady()` right before the timed
    steps, `stop_steady()` right after them, `process_peak_mb()` at the end."""

    def __init__(self) -> None:
        self._before_reset = 0.0
        self.steady_mb: float | None = None
        """Peak RSS over the timed steps; None where the high-water mark cannot be reset."""
        self.start_mb: float | None = None
        """RSS when the timed steps began (the high-water mark right after the reset)."""
        self._reset = False

    def start_steady(self) -> None:
        self._before_reset = process_peak_rss_mb()
        self._reset = reset_peak()
        self.start_mb = read_peak_mb() if self._reset else None

    def stop_steady(self) -> None:
        if self._reset and self.steady_mb is None:
            self.steady_mb = read_peak_mb()

    @property
    def growth_mb(self) -> float | None:
        """How far the timed steps raised RSS above where it stood when they began: what the steps
        themselves need (gradients, activations, buffers), without the code and caches loaded before."""
        if self.steady_mb is None or self.start_mb is None:
            return None
        return self.steady_mb - self.start_mb

    def process_peak_mb(self) -> float:
        """Peak RSS of the whole process, compilation included (across the reset)."""
        return max(self._before_reset, process_peak_rss_mb())
