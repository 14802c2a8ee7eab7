"""`StepTimeline`: what `OverlapRecorder` saw of one step (its buckets' all-reduces and the backward
window), shared by the recorder (`ddp/overlap/recorder.py`) and the picture (`ddp/overlap/plot.py`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ddp.overlap.intervals import OverlapStats, overlap_stats


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketRecord:
    """One bucket's all-reduce in one step."""

    step: int
    """Step number (0-based, counted by the recorder from the first backward it saw)."""
    index: int
    """DDP's bucket index (`GradBucket.index()`); DDP launches buckets in this order."""
    params: tuple[str, ...]
    """User names of the bucket's parameters, in DDP's order inside the bucket."""
    nbytes: int
    """Size of the flat gradient buffer that was all-reduced."""
    ready_s: float
    """perf_counter time the hook was called: every gradient of the bucket was ready."""
    done_s: float
    """perf_counter time the all-reduce's future completed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTimeline:
    """Every bucket of one step plus the backward compute window."""

    step: int
    """Step number."""
    backward_start_s: float
    """S: marked backward start, or the first bucket's ready time when the step was not marked."""
    backward_end_s: float
    """E: the last bucket's ready time (the last gradient produced)."""
    start_marked: bool
    """True when S came from `mark_backward_start`, False when it fell back to the first ready time."""
    buckets: tuple[BucketRecord, ...]
    """Buckets in DDP's launch (index) order."""

    def overlap(self) -> OverlapStats:
        return overlap_stats(
            compute=(self.backward_start_s, self.backward_end_s),
            comm=[(b.ready_s, b.done_s) for b in self.buckets],
        )

    def bucket_names(self) -> list[list[str]]:
        return [list(b.params) for b in self.buckets]

    def to_dict(self) -> dict[str, Any]:
        t0 = self.backward_start_s
        return {
            "step": self.step,
            "start_marked": self.start_marked,
            "backward_ms": [0.0, 1e3 * (self.backward_end_s - t0)],
            "buckets": [
                {
                    "index": b.index,
                    "params": list(b.params),
                    "bytes": b.nbytes,
                    "ready_ms": 1e3 * (b.ready_s - t0),
                    "done_ms": 1e3 * (b.done_s - t0),
                }
                for b in self.buckets
            ],
            "overlap": self.overlap().to_dict(),
        }
