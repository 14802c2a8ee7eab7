"""What is live at a step's memory peak, by kind, and where in the step the peak sits (issue 34, item 5).

Pure functions over one profiled step's trace (`torch.profiler` with `profile_memory=True`, written by
`export_chrome_trace`, the public way to get each allocation's address; `read_trace` reads it back). The
worker profiles one extra step this way after the timed ones (`memory_profile_steps`), on the device the
step runs on: CUDA's caching allocator on a GPU rank, the host allocator on a CPU rank.

Note [memory at the peak, by kind]
----------------------------------
Background: a peak figure (`max_memory_allocated`, the profiler's running sum) says how much, not what.
Whether `optimizer_in_backward` saves gradient memory, or whether activations set the peak anyway, needs
the peak taken apart.

Algorithm: in the step's window (its `bench::step` mark), the device's `[memory]` events are replayed in
time order: an allocation adds its bytes at its address, a free takes them away. The peak is the first
moment the running sum is highest. Each allocation still live then is given one kind:

* `gradients` -- freed inside `Optimizer.zero_grad` later in the step: a `.grad` that zero_grad(set_to_none)
  dropped. (Gradients that are buffers of a compiled backward, such as those `optimizer_in_backward`
  consumes in the graph, never become a `.grad`: they count as temporaries.)
* `activations` -- allocated before the backward began (the first `autograd::engine::evaluate_function`
  in the step) and still live at a peak inside or after the backward: what the forward saved for the
  backward, and its outputs. At a peak in the forward these are the forward's tensors so far.
* `temporaries` -- allocated since the backward began and freed later in the step, not by zero_grad:
  the backward's working buffers, the in-graph reducer's flat buckets, the optimizer's intermediates.
* `kept` -- allocated in the step and still live when it ends (a step that grows something, or the
  returned loss).

What was alive before the step began (parameters, optimizer state, buffers, DDP's bucket copy: what the
job holds between steps) made no allocation in the window; `held` (benchmarks/memory.py,
`training_state_mb`) supplies it by kind, and the absolute peak is held plus the step's own peak. If the
step freed some of that before its peak, `held_freed_mb` says how much.

`where` is the phase of the step at the peak: "forward" (before the backward began), "backward" (up to the
end of its last autograd node) or "after backward" (the optimizer step, zero_grad); `backward_fraction`
places a backward peak between the backward's start (0) and end (1).

Debugging: `read_trace` keeps only the events this needs; the trace file itself opens in
chrome://tracing or Perfetto, with each `[memory]` event's address and bytes in its args.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

STEP_MARK = "bench::step"
BACKWARD_NODE = "autograd::engine::evaluate_function"
ZERO_GRAD = "Optimizer.zero_grad"
MEMORY = "[memory]"
_MB = 2**20

KINDS = ("gradients", "activations", "temporaries", "kept")
"""The kinds of what the step itself allocated and still holds at its peak (the Note)."""


@dataclasses.dataclass(frozen=True)
class Alloc:
    """One `[memory]` event: `nbytes` > 0 allocates at `addr`, < 0 frees it (times in microseconds)."""

    ts_us: float
    addr: int
    nbytes: int
    device: str
    """"cpu", or "cuda:<index>"."""


@dataclasses.dataclass(frozen=True)
class Span:
    """A named range of the trace (a record_function mark, an op, an autograd node)."""

    name: str
    start_us: float
    end_us: float


def read_trace(path: str | Path) -> tuple[list[Alloc], list[Span]]:
    """The allocations and the spans this module reads, from a trace `export_chrome_trace` wrote."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    allocs, spans = [], []
    for e in events:
        name = e.get("name", "")
        if name == MEMORY:
            args = e.get("args") or {}
            kind = "cuda" if args.get("Device Type") == 1 else "cpu" if args.get("Device Type") == 0 else None
            if kind is None or "Addr" not in args:
                continue
            device = kind if kind == "cpu" else f"cuda:{args.get('Device Id', 0)}"
            allocs.append(Alloc(float(e["ts"]), int(args["Addr"]), int(args["Bytes"]), device))
        elif e.get("ph") == "X" and (name == STEP_MARK or name.startswith(BACKWARD_NODE) or name.startswith(ZERO_GRAD)):
            # kineto mirrors annotations onto the GPU timeline: the host's copy is the one with a cpu category
            if name == STEP_MARK and e.get("cat") == "gpu_user_annotation":
                continue
            start = float(e["ts"])
            spans.append(Span(name, start, start + float(e.get("dur", 0.0))))
    return allocs, spans


def peak_by_kind(
    allocs: Sequence[Alloc], spans: Sequence[Span], *, device: str, held: dict[str, float] | None = None
) -> dict[str, Any]:
    """The last step's peak on `device`, taken apart by kind (the Note); MiB. `held` is what the job held
    between steps, by kind (`training_state_mb`), or None (then only the step's own share is given)."""
    steps = sorted((s for s in spans if s.name == STEP_MARK), key=lambda s: s.start_us)
    if not steps:
        return {"measured": False, "reason": f"no {STEP_MARK} mark in the trace"}
    step = steps[-1]
    inside = [a for a in allocs if a.device == device and step.start_us <= a.ts_us <= step.end_us]
    inside.sort(key=lambda a: a.ts_us)  # stable: events at one time keep the trace's order
    if not inside:
        seen = sorted({a.device for a in allocs}) or ["none"]
        return {"measured": False, "reason": f"no allocation on {device} inside the step (devices seen: {seen})"}
    nodes = [s for s in spans if s.name.startswith(BACKWARD_NODE) and step.start_us <= s.start_us <= step.end_us]
    backward = (min(s.start_us for s in nodes), max(s.end_us for s in nodes)) if nodes else None
    zero_grads = [s for s in spans if s.name.startswith(ZERO_GRAD) and step.start_us <= s.start_us <= step.end_us]

    peak_at, peak, running = -1, 0, 0
    for i, a in enumerate(inside):
        running += a.nbytes
        if running > peak:
            peak, peak_at = running, i
    live: dict[int, int] = {}  # addr -> index of its allocation, as it stood at the peak
    held_freed = 0
    for i, a in enumerate(inside[: peak_at + 1]):
        if a.nbytes > 0:
            live[a.addr] = i
        elif live.pop(a.addr, None) is None:
            held_freed -= a.nbytes  # freed something allocated before the step
    freed_at = _first_free_after(inside, peak_at, set(live))
    at = inside[peak_at].ts_us if peak_at >= 0 else step.start_us

    sizes = dict.fromkeys(KINDS, 0)
    for addr, i in live.items():
        a, free = inside[i], freed_at.get(addr)
        if free is None:
            kind = "kept"
        elif any(z.start_us <= free <= z.end_us for z in zero_grads):
            kind = "gradients"
        elif backward is None or a.ts_us < backward[0]:
            kind = "activations"
        else:
            kind = "temporaries"
        sizes[kind] += a.nbytes
    out: dict[str, Any] = {
        "measured": True,
        "device": device,
        "step_peak_mb": peak / _MB,
        "step_mb": {k: v / _MB for k, v in sizes.items()},
        "held_freed_mb": held_freed / _MB,
        "at_ms": (at - step.start_us) / 1e3,
        **_where(at, backward),
    }
    if held is not None:
        from benchmarks.memory import held_mb

        out["held_mb"] = {k: v for k, v in held.items() if k != "gradient_bytes"}
        out["peak_mb"] = held_mb(held) + out["step_peak_mb"]
    return out


def _first_free_after(inside: Sequence[Alloc], after: int, addrs: set[int]) -> dict[int, float]:
    """For each address in `addrs`: the time of its first free after index `after` (absent: never freed)."""
    out: dict[int, float] = {}
    for a in inside[after + 1 :]:
        if a.nbytes < 0 and a.addr in addrs and a.addr not in out:
            out[a.addr] = a.ts_us
    return out


def _where(at: float, backward: tuple[float, float] | None) -> dict[str, Any]:
    if backward is None:
        return {"where": "no backward seen", "backward_fraction": None}
    start, end = backward
    if at < start:
        return {"where": "forward", "backward_fraction": None}
    if at <= end:
        return {"where": "backward", "backward_fraction": (at - start) / (end - start) if end > start else 0.0}
    return {"where": "after backward", "backward_fraction": None}


def profiled_peak(run_step, *, device: str, held: dict[str, float] | None, trace_path: str | Path) -> dict[str, Any]:
    """Run `run_step()` once under the memory profiler, write its trace to `trace_path`, and return
    `peak_by_kind` of it (the trace file is removed afterwards: it is large and read once)."""
    import torch.profiler as tp

    path = Path(trace_path)
    with tp.profile(activities=[tp.ProfilerActivity.CPU], profile_memory=True) as prof:
        with tp.record_function(STEP_MARK):
            run_step()
    try:
        prof.export_chrome_trace(str(path))
        allocs, spans = read_trace(path)
    finally:
        path.unlink(missing_ok=True)
    return peak_by_kind(allocs, spans, device=device, held=held)
