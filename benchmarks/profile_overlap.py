"""Overlap of all-reduce with backward compute, and the step's tensor peak, from torch.profiler events.

Why a second method: the overlap recorder (ddp/overlap/recorder.py) is a DDP comm hook, and in
ddp="in_graph" modes the compiled backward all-reduces itself while DDP's reducer idles, so the hook sees
nothing. The profiler sees every collective whichever code issued it, so the same numbers can be taken for
every mode and the columns compare like with like.

Note [what the profiler records on torch 2.13 + gloo, and how it is read]
-------------------------------------------------------------------------
Checked with a 2-rank script (eager DDP, compile_core split and in_graph) on this build:

* every all-reduce is issued through the op `c10d::allreduce_` on the thread that runs the backward (DDP's
  reducer calls it from its bucket hook; the in-graph `_c10d_functional::all_reduce` calls it inside);
* gloo runs it on one of its worker threads as a `gloo:all_reduce` event, first in, first started;
* the backward's autograd nodes are `autograd::engine::evaluate_function: ...` events.

Per profiled step (the worker wraps each one in a `bench::step` record_function), exactly as the recorder
defines it (ddp/overlap/intervals.py, its Note): all-reduce i is the interval [issue_i, done_i], the i-th
`c10d::allreduce_` start paired with the end of the i-th `gloo:all_reduce` (both in start order; when their
counts differ, only the gloo intervals are used and `paired` says so); the backward compute window is
[S, E] with S the first autograd node (or the first issue, if earlier) and E the last issue (the last
bucket's gradients are ready then). Overlap % and exposed ms come from `ddp.overlap.intervals.overlap_stats`.
Consequence, as for the recorder: compute that runs after the last issue (optimizer_in_backward's per-bucket
updates of earlier buckets) is not counted as hiding the last all-reduce, so that mode's exposed ms is an
upper bound.

Tensor peak (host tensors): with `profile_memory=True` every CPU allocation and free is a `[memory]` event with signed
bytes; the running sum over a step, in time order, peaks at the most tensor memory the step held above
what was alive when it started (gradients, activations, all-reduce buffers; not the parameters or the
optimizer state, which live across steps). Unlike the RSS high-water mark it does not see the allocator's
retained pages, so it shows gradients freed per bucket directly.

Limitation: gloo only. With nccl the host-side events mark enqueueing, not completion; GPU kernel events
would be needed, and the result says "not measured".
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Iterable, Sequence

STEP_MARK = "bench::step"
"""record_function name the worker puts around each profiled step."""
ISSUE = ("c10d::allreduce_",)
"""Where a bucket's reduction is issued."""
DONE = ("gloo:all_reduce",)
"""Where gloo ran it: the all-reduce on a worker thread."""
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
MEMORY = "[memory]"


@dataclasses.dataclass(frozen=True)
class Event:
    """One profiler event, reduced to what the overlap math reads (times in microseconds)."""

    name: str
    thread: int
    start_us: float
    end_us: float
    nbytes: int = 0
    """Signed bytes of a `[memory]` event (allocation > 0, free < 0); 0 for other events."""
    device: str = "cpu"
    """Where the event ran: "cpu" (host ops, annotations, runtime calls) or "cuda" (kernels, copies, and the
    GPU side of annotations), recorded only when the profiler traced CUDA (benchmarks/kernels.py)."""
    kind: str = ""
    """Kineto's activity type ("cpu_op", "user_annotation", "kernel", "gpu_memcpy", ...) where this torch
    reports it; "" where it does not (then benchmarks/kernels.py classifies by name)."""


def step_windows(events: Sequence[Event]) -> list[tuple[float, float]]:
    """(start, end) of every `bench::step` mark, in time order."""
    # with CUDA traced, kineto repeats each annotation on the GPU timeline: the host's mark is the step
    return sorted((e.start_us, e.end_us) for e in events if e.name == STEP_MARK and e.device == "cpu")


def _within(events: Iterable[Event], window: tuple[float, float], names: tuple[str, ...]) -> list[Event]:
    lo, hi = window
    return sorted((e for e in events if e.name in names and lo <= e.start_us <= hi), key=lambda e: e.start_us)


def step_timeline(events: Sequence[Event], window: tuple[float, float], step: int) -> dict[str, Any] | None:
    """One step's comm intervals and compute window as a timeline dict (ddp.overlap.plot's format, plus
    `paired`), or None when the step issued no all-reduce."""
    from ddp.overlap.intervals import overlap_stats

    issues = _within(events, window, ISSUE)
    dones = _within(events, window, DONE)
    if not issues and not dones:
        return None
    paired = len(issues) == len(dones)
    if paired:
        comm = [(i.start_us, max(i.start_us, d.end_us)) for i, d in zip(issues, dones)]
    else:
        comm = [(d.start_us, d.end_us) for d in dones]
    starts = [e.start_us for e in events if e.name.startswith(BACKWARD_PREFIX) and window[0] <= e.start_us <= window[1]]
    first_issue = min(s for s, _ in comm)
    last_issue = issues[-1].start_us if issues else max(s for s, _ in comm)
    start = min([first_issue] + starts)
    end = max(start, last_issue)
    stats = overlap_stats(compute=(start / 1e6, end / 1e6), comm=[(s / 1e6, e / 1e6) for s, e in comm])
    return {
        "step": step,
        "paired": paired,
        "backward_ms": [0.0, (end - start) / 1e3],
        "buckets": [
            {"index": i, "params": [], "bytes": 0, "ready_ms": (s - start) / 1e3, "done_ms": (e - start) / 1e3}
            for i, (s, e) in enumerate(comm)
        ],
        "overlap": stats.to_dict(),
    }


def tensor_peak_bytes(events: Sequence[Event], window: tuple[float, float]) -> int | None:
    """Most tensor bytes held above the step's start (running sum of `[memory]` events); None if none seen."""
    mem = [e for e in events if e.name == MEMORY and window[0] <= e.start_us <= window[1]]
    if not mem:
        return None
    live = peak = 0
    for e in sorted(mem, key=lambda e: e.start_us):
        live += e.nbytes
        peak = max(peak, live)
    return peak


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    """Median overlap %, exposed and comm ms over the profiled steps, the tensor peak, the last timeline."""
    windows = step_windows(events)
    if not windows:
        return {"measured": False, "reason": f"no '{STEP_MARK}' event: no step was profiled"}
    timelines = [t for k, w in enumerate(windows) if (t := step_timeline(events, w, k)) is not None]
    peaks = [p for w in windows if (p := tensor_peak_bytes(events, w)) is not None]
    out: dict[str, Any] = {"steps": len(windows), "tensor_peak_mb": max(peaks) / 2**20 if peaks else None}
    if not timelines:
        return {**out, "measured": False, "reason": f"no event named {ISSUE + DONE} in the profiled steps"}
    stats = [t["overlap"] for t in timelines]
    percents = [s["percent"] for s in stats if s["percent"] is not None]
    return {
        **out,
        "measured": True,
        "method": "profiler",
        "median_overlap_percent": statistics.median(percents) if percents else None,
        "median_exposed_ms": 1e3 * statistics.median(s["exposed_s"] for s in stats),
        "median_comm_ms": 1e3 * statistics.median(s["comm_s"] for s in stats),
        "all_reduces": len(timelines[-1]["buckets"]),
        "paired": all(t["paired"] for t in timelines),
        "last_step": timelines[-1],
    }


def label_buckets(timeline: dict[str, Any], planned: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    """Name a profiler timeline's all-reduces after the planned in-graph buckets when the counts agree."""
    if not planned or len(planned) != len(timeline["buckets"]):
        return timeline
    buckets = [
        {**b, "params": list(p.get("params", [])), "bytes": int(p.get("bytes", 0))}
        for b, p in zip(timeline["buckets"], planned)
    ]
    return {**timeline, "buckets": buckets}


# -- capture (runs inside a rank) ------------------------------------------------------------------------


class StepProfiler:
    """torch.profiler around the last steps of a job; `events()` afterwards. By default CPU activity with
    memory events (the overlap and tensor-peak figures); `cuda=True` traces the GPU's kernels too, and
    `memory=False` leaves out the allocation events (cheaper host time: the kernel figures)."""

    def __init__(self, *, cuda: bool = False, memory: bool = True, tolerant: bool = False) -> None:
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        self._prof = tp.profile(activities=activities, profile_memory=memory)
        self._tolerant = tolerant
        self.error: str | None = None
        """With `tolerant`: why the profiler failed to stop (then it has no events); a job keeps its timings."""

    def __enter__(self) -> "StepProfiler":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._prof.__exit__(*exc)
        except Exception as err:
            if not self._tolerant:
                raise
            self.error = f"the profiler failed to stop: {type(err).__name__}: {err}"

    @staticmethod
    def mark_step():
        """Context manager around one profiled step."""
        import torch.profiler as tp

        return tp.record_function(STEP_MARK)

    def events(self) -> list[Event]:
        return kineto_events(self._prof)


def kineto_events(prof: Any) -> list[Event]:
    """The profile's raw events. Reads `profile.profiler.kineto_results.events()` (torch/autograd/profiler.py,
    torch/profiler/profiler.py): the public `prof.events()` drops the `[memory]` events and their bytes."""
    from torch.autograd import DeviceType

    results = prof.profiler.kineto_results
    out = []
    for e in results.events():
        start = e.start_ns() / 1e3
        on_cpu = e.device_type() == DeviceType.CPU
        if e.name() == MEMORY and not on_cpu:
            continue  # host tensors only: GPU ranks report their device peak separately (steady_peak_cuda_mb)
        kind = getattr(e, "activity_type", None)  # a method on torch 2.13; read defensively on other versions
        out.append(
            Event(
                name=e.name(),
                thread=e.start_thread_id(),
                start_us=start,
                end_us=max(start, e.end_ns() / 1e3),
                nbytes=int(e.nbytes()) if e.name() == MEMORY else 0,
                device="cpu" if on_cpu else str(e.device_type()).rsplit(".", 1)[-1].lower(),
                kind=_activity(kind),
            )
        )
    return out


def _activity(method: Any) -> str:
    """Kineto's activity type as a lower-case string ("" where this torch does not say)."""
    if method is None:
        return ""
    try:
        value = method()
    except Exception:  # an older binding, or one that raises for this event: classify by name instead
        return ""
    return str(value).rsplit(".", 1)[-1].lower() if value is not None else ""
