"""Overlap of communication with backward compute: pure interval math.

Note (the overlap math, stated once)
------------------------------------
For one training step:

* backward compute window ``[S, E]``. ``S`` is the time passed to `OverlapRecorder.mark_backward_start`
  (the benchmark calls it right before ``loss.backward()``); when nobody marked the step, ``S`` falls back to
  the first bucket's ready time. ``E`` is the *last bucket's ready time*: that is the moment the last gradient
  was produced, so gradient compute is over. We deliberately do not use an autograd ``queue_callback`` for
  ``E``: DDP's own end-of-backward callback (queued earlier) blocks on every outstanding all-reduce, so a
  callback queued after it would stretch the "compute" window over the communication tail and report a fake
  100 % overlap.
* communication intervals ``[ready_i, done_i]`` per bucket. Buckets queue behind each other on the
  communication stream, so we take their *union* ``U`` (never the sum: two queued buckets must not count the
  same wall-clock millisecond twice).
* ``hidden = |U ∩ [S, E]|``, ``exposed = |U| - hidden``, ``overlap = hidden / |U|`` (``None`` when there was
  no communication at all).

Consequence worth knowing: the last bucket's all-reduce starts at ``E`` and is therefore always exposed, so
even a perfect pipeline reports less than 100 % -- the exposed tail is the number that costs step time.
Also, ``[S, E]`` is the whole backward, DDP's own bucket copies included: a model whose gradients all arrive
at once (one unsplit graph) still shows some overlap, because the first bucket's all-reduce runs while DDP
copies the remaining buckets. Compare exposed milliseconds, not only percentages, across modes.

Limitation: times are host-side `time.perf_counter()` stamps. With gloo (CPU) the future completes when the
all-reduce is done, so the stamps are real. With NCCL the future's callback runs when the work is enqueued on
the stream, not when the GPU finishes it; use the profiler for GPU-accurate numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence


def interval_union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge intervals into sorted, disjoint ones (touching intervals merge)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts; pass (start, end) with start <= end")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_length(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of `intervals` that falls inside `window`."""
    lo, hi = window
    total = 0.0
    for start, end in interval_union(intervals):
        total += max(0.0, min(end, hi) - max(start, lo))
    return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapStats:
    """How much of one step's all-reduce time was hidden behind backward compute (see the module Note)."""

    backward_s: float
    """Length of the backward compute window [S, E]."""
    comm_s: float
    """Wall-clock time with at least one all-reduce in flight (union of bucket intervals)."""
    hidden_s: float
    """Part of `comm_s` inside the backward compute window."""
    exposed_s: float
    """Part of `comm_s` after (or before) the compute window: what communication adds to the step."""
    fraction: float | None
    """hidden_s / comm_s; None when the step had no communication."""

    @property
    def percent(self) -> float | None:
        return None if self.fraction is None else 100.0 * self.fraction

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "percent": self.percent}


def overlap_stats(*, compute: tuple[float, float], comm: Sequence[tuple[float, float]]) -> OverlapStats:
    """Overlap of communication intervals `comm` with the compute window `compute` (times in seconds)."""
    start, end = compute
    if end < start:
        raise ValueError(f"compute window {compute} ends before it starts; pass (start, end) with start <= end")
    comm_s = sum(e - s for s, e in interval_union(comm))
    hidden_s = covered_length(comm, compute)
    return OverlapStats(
        backward_s=end - start,
        comm_s=comm_s,
        hidden_s=hidden_s,
        exposed_s=comm_s - hidden_s,
        fraction=(hidden_s / comm_s) if comm_s > 0 else None,
    )
