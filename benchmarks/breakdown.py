"""Where a step's wall time went: Dynamo, AOTAutograd and backend passes, Inductor, C++ compile, caches.

Note [compile timers on torch 2.13]
-----------------------------------
torch keeps no per-phase total we could read in one call that covers the lazy backward too, so we read
its own phase timers: every `torch._dynamo.utils.dynamo_timed(key)` block appends its wall seconds to
`torch._dynamo.utils.compilation_time_metrics[key]` (what `torch._dynamo.utils.compile_times()` prints;
cleared only by `torch._dynamo.reset()`). A snapshot is the length of each list; the time spent between
two snapshots is the sum of what was appended. The keys we use, and how they nest (read in
torch/_dynamo/convert_frame.py, output_graph.py, _functorch/_aot_autograd/runtime_wrappers.py,
_inductor/compile_fx.py, _inductor/cpp_builder.py, checked with a compile on this build):

  _compile.compile_inner            one Dynamo frame compile, everything below included
    OutputGraph.call_user_compiler  the backend (DDPOptimizer / our splitter, AOTAutograd, Inductor)
      compile_fx_inner              Inductor on one forward or backward graph (lowering, codegen, ...)
        compile_file                one C++ compile (CPU kernels; in-process with compile_threads=1)
      AOTAutogradCache.inductor_load  a warm cache hit: Inductor output loaded instead of compiled
  backward._backward_impl           a backward graph compiled lazily, at the first backward (not in a frame)

Derived, all >= 0 and adding up to the step's wall time:
  compile   = compile_inner + backward_impl
  dynamo    = compile_inner - call_user_compiler                    (tracing, guards, bytecode)
  aot       = call_user_compiler + backward_impl - inductor          (AOTAutograd, the backend's own passes:
                                                                      graph splitting, in-graph all-reduce)
  inductor  = compile_fx_inner + inductor_load - compile_file        (lowering, scheduling, codegen, loads)
  cpp       = compile_file
  other     = wall - compile                                         (running the step; waiting for the
                                                                      other rank's compile at a collective)
Cache counters come from `torch._dynamo.utils.counters` (fxgraph_cache_* under "inductor",
autograd_cache_* under "aot_autograd"). With `TORCHINDUCTOR_COMPILE_THREADS` > 1, C++ compiles run in
worker processes whose timers we cannot see: the runner pins it to 1.
"""

from __future__ import annotations

import dataclasses
import pstats
from pathlib import Path
from typing import Any, Mapping

FRAME = "_compile.compile_inner"
BACKEND = "OutputGraph.call_user_compiler"
LAZY_BACKWARD = "backward._backward_impl"
INDUCTOR = "compile_fx_inner"
INDUCTOR_LOAD = "AOTAutogradCache.inductor_load"
CPP = "compile_file"

COUNTERS: dict[str, tuple[str, ...]] = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": (
        "autograd_cache_hit",
        "autograd_cache_miss",
        "autograd_cache_bypass",
        "autograd_cache_guard_miss",
        "autograd_cache_saved",
    ),
    "stats": ("unique_graphs",),
    "frames": ("total",),
}
"""torch._dynamo.utils.counters groups and keys copied into the breakdown."""

RAW_MIN_S = 0.001
"""Timers below this total are left out of the raw per-key listing (there are dozens of tiny ones)."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Where torch's compile timers and counters stood at one moment."""

    lengths: dict[str, int]
    counters: dict[str, dict[str, int]]


def snapshot() -> Snapshot:
    """Read torch's timers (list lengths) and counters now. Cheap: no copy of the timings themselves."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return Snapshot(
        lengths={k: len(v) for k, v in compilation_time_metrics.items()},
        counters={group: {k: int(counters[group].get(k, 0)) for k in keys} for group, keys in COUNTERS.items()},
    )


def timers_since(before: Snapshot) -> dict[str, float]:
    """Seconds per timer key spent since `before` (a list that shrank was reset: all of it is new)."""
    from torch._dynamo.utils import compilation_time_metrics

    out = {}
    for key, values in compilation_time_metrics.items():
        start = before.lengths.get(key, 0)
        new = values[start:] if len(values) >= start else values
        if new:
            out[key] = float(sum(new))
    return out


def counters_since(before: Snapshot) -> dict[str, dict[str, int]]:
    """Counter increments since `before`, only the non-zero ones."""
    now = snapshot().counters
    deltas = {group: {k: v - before.counters[group].get(k, 0) for k, v in keys.items()} for group, keys in now.items()}
    return {group: {k: d for k, d in keys.items() if d} for group, keys in deltas.items()}


def compile_seconds(timers: Mapping[str, float]) -> float:
    """Total compile wall time in a timer delta (Dynamo frames plus lazily compiled backwards)."""
    return timers.get(FRAME, 0.0) + timers.get(LAZY_BACKWARD, 0.0)


def breakdown(wall_s: float, timers: Mapping[str, float], counters: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """Split a step's wall seconds by phase (see the module Note); pure, JSON-ready."""
    frame, backend = timers.get(FRAME, 0.0), timers.get(BACKEND, 0.0)
    lazy = timers.get(LAZY_BACKWARD, 0.0)
    inductor_all = timers.get(INDUCTOR, 0.0) + timers.get(INDUCTOR_LOAD, 0.0)
    cpp = timers.get(CPP, 0.0)
    compile_s = frame + lazy
    fx, aot = counters.get("inductor", {}), counters.get("aot_autograd", {})
    return {
        "wall_s": wall_s,
        "compile_s": compile_s,
        "dynamo_s": max(0.0, frame - backend),
        "aot_s": max(0.0, backend + lazy - inductor_all),
        "inductor_s": max(0.0, inductor_all - cpp),
        "cpp_compile_s": cpp,
        "other_s": max(0.0, wall_s - compile_s),
        "cache": {
            "fxgraph_hit": fx.get("fxgraph_cache_hit", 0),
            "fxgraph_miss": fx.get("fxgraph_cache_miss", 0),
            "fxgraph_bypass": fx.get("fxgraph_cache_bypass", 0),
            "aot_hit": aot.get("autograd_cache_hit", 0),
            "aot_miss": aot.get("autograd_cache_miss", 0) + aot.get("autograd_cache_guard_miss", 0),
            "aot_bypass": aot.get("autograd_cache_bypass", 0),
        },
        "graphs": counters.get("stats", {}).get("unique_graphs", 0),
        "frames": counters.get("frames", {}).get("total", 0),
        "timers": {k: round(v, 4) for k, v in sorted(timers.items()) if v >= RAW_MIN_S},
    }


class StepClock:
    """Per-step compile accounting for one job: `start()` before a step, `stop(wall_s)` after it."""

    def __init__(self) -> None:
        self._before: Snapshot | None = None
        self.per_step: list[dict[str, Any]] = []
        """One breakdown per step, in order."""

    def start(self) -> None:
        self._before = snapshot()

    def stop(self, wall_s: float) -> dict[str, Any]:
        assert self._before is not None, "StepClock.stop() without start()"
        result = breakdown(wall_s, timers_since(self._before), counters_since(self._before))
        self._before = None
        self.per_step.append(result)
        return result

    def summary(self, warmup: int) -> dict[str, Any]:
        """The first step in full; compile seconds of the other warm-up steps and of the timed ones."""
        return summarize_steps(self.per_step, warmup)


def summarize_steps(per_step: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """First- and second-step breakdowns, plus compile seconds in later warm-up steps (variant compiles, optimizer
    recompiles) and in the timed steps (should be 0: a compile there is a steady-state recompile)."""
    if not per_step:
        return {}
    later = per_step[1:warmup]
    timed = per_step[warmup:]
    return {
        "first_step": per_step[0],
        # the in-backward update compiles its graph at step 2: where that step's seconds go
        "second_step": per_step[1] if len(per_step) > 1 else None,
        "later_warmup_compile_s": sum(s["compile_s"] for s in later),
        "later_warmup_graphs": sum(s["graphs"] for s in later),
        "timed_compile_s": sum(s["compile_s"] for s in timed),
        "timed_steps_with_compile": [warmup + i for i, s in enumerate(timed) if s["compile_s"] > 0],
    }


def top_functions(profile: Any, n: int = 20) -> dict[str, list[dict[str, Any]]]:
    """Where a start-up spent its Python time, from a `cProfile.Profile` of its first steps (the GPU
    benchmark's `--profile-warm`; the timers above see compiles only): the `n` functions with the most own
    time and the `n` with the most cumulative time, as {"where": "dir/file.py:line(name)", "own_s",
    "cumulative_s", "calls"} (paths cut to their last two parts)."""
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profile).stats.items():
        where = "/".join(Path(path).parts[-2:]) + f":{line}({name})" if line else name
        rows.append({"where": where, "own_s": own, "cumulative_s": cumulative, "calls": calls})
    return {
        "own": sorted(rows, key=lambda r: -r["own_s"])[:n],
        "cumulative": sorted(rows, key=lambda r: -r["cumulative_s"])[:n],
    }
