"""See whether DDP's gradient all-reduce really overlapped the backward pass, and check bucket alignment.

* `ddp.overlap.recorder.OverlapRecorder` -- an opt-in DDP communication hook that records, per bucket
  per step, the parameters, bytes, ready time and all-reduce finish time; overlap % and a timeline PNG.
* `ddp.overlap.timeline` -- `StepTimeline`/`BucketRecord`: one recorded step, shared by recorder and plot.
* `ddp.overlap.intervals` -- the overlap math (stated once, in its Note).
* `ddp.overlap.check.check_alignment` -- pure: planned graph pieces against the buckets DDP really used.
* `ddp.overlap.plot.plot_timeline` -- the timeline picture (needs matplotlib).
"""

from ddp.overlap.check import AlignmentResult, BucketAlignment, check_alignment
from ddp.overlap.intervals import OverlapStats, covered_length, interval_union, overlap_stats
from ddp.overlap.plot import plot_timeline
from ddp.overlap.recorder import OverlapRecorder, RecorderConfig
from ddp.overlap.timeline import BucketRecord, StepTimeline

__all__ = [
    "AlignmentResult",
    "BucketAlignment",
    "BucketRecord",
    "OverlapRecorder",
    "OverlapStats",
    "RecorderConfig",
    "StepTimeline",
    "check_alignment",
    "covered_length",
    "interval_union",
    "overlap_stats",
    "plot_timeline",
]
