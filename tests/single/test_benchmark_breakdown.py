"""The first-step breakdown of `python -m benchmarks` (benchmarks/breakdown.py): how a step's wall time is
split into Dynamo, AOTAutograd, Inductor, C++ compile and other time from torch's timers and counters, how
the steps of a run are summarized, and a canary that the timer keys and counters it reads exist on this torch."""

from __future__ import annotations

import json

import pytest


def _timers(**kw: float) -> dict[str, float]:
    from benchmarks import breakdown as b

    names = {
        "frame": b.FRAME,
        "backend": b.BACKEND,
        "lazy": b.LAZY_BACKWARD,
        "inductor": b.INDUCTOR,
        "load": b.INDUCTOR_LOAD,
        "cpp": b.CPP,
    }
    return {names[k]: v for k, v in kw.items()}


def test_breakdown_phases_add_up_to_the_wall_time():
    from benchmarks.breakdown import breakdown

    # a frame of 10 s whose backend took 8 s (Inductor 6 s of it, 4 s C++), then a lazy backward of 3 s
    # with 2 s of Inductor: Dynamo 2, AOT 8 + 3 - 8 = 3, Inductor 8 - 4 = 4, C++ 4, other 14 - 13 = 1
    timers = _timers(frame=10.0, backend=8.0, lazy=3.0, inductor=8.0, cpp=4.0)
    counters = {
        "inductor": {"fxgraph_cache_miss": 2},
        "aot_autograd": {"autograd_cache_miss": 1, "autograd_cache_guard_miss": 1},
        "stats": {"unique_graphs": 1},
        "frames": {"total": 3},
    }
    got = breakdown(14.0, timers, counters)
    assert got["compile_s"] == 13.0
    assert (got["dynamo_s"], got["aot_s"], got["inductor_s"], got["cpp_compile_s"], got["other_s"]) == (2, 3, 4, 4, 1)
    parts = got["dynamo_s"] + got["aot_s"] + got["inductor_s"] + got["cpp_compile_s"] + got["other_s"]
    assert parts == pytest.approx(got["wall_s"])
    assert got["cache"] == {
        "fxgraph_hit": 0,
        "fxgraph_miss": 2,
        "fxgraph_bypass": 0,
        "aot_hit": 0,
        "aot_miss": 2,
        "aot_bypass": 0,
    }
    assert (got["graphs"], got["frames"]) == (1, 3)
    json.dumps(got)  # JSON-ready


def test_breakdown_of_a_warm_cache_counts_inductor_loads_and_never_goes_negative():
    from benchmarks.breakdown import breakdown

    # warm: the backend only loads Inductor's output from the AOTAutograd cache
    got = breakdown(1.0, _timers(frame=0.9, backend=0.6, load=0.5), {"aot_autograd": {"autograd_cache_hit": 2}})
    assert got["inductor_s"] == 0.5 and got["aot_s"] == pytest.approx(0.1) and got["cache"]["aot_hit"] == 2
    # clock skew between nested timers must not produce negative phases
    skewed = breakdown(0.5, _timers(frame=1.0, backend=1.2, inductor=1.3, cpp=1.4), {})
    assert all(skewed[k] >= 0 for k in ("dynamo_s", "aot_s", "inductor_s", "other_s"))
    assert breakdown(0.01, {}, {})["compile_s"] == 0.0  # eager: nothing compiled


def test_summarize_steps_flags_compiles_after_the_warmup():
    from benchmarks.breakdown import breakdown, summarize_steps

    steps = [
        breakdown(5.0, _timers(frame=4.0, backend=3.0), {}),
        breakdown(2.0, _timers(frame=1.5), {}),
        breakdown(0.1, {}, {}),
        breakdown(0.1, {}, {}),
        breakdown(0.9, _timers(lazy=0.8), {}),
    ]
    got = summarize_steps(steps, warmup=2)
    assert got["first_step"]["compile_s"] == 4.0
    assert got["later_warmup_compile_s"] == 1.5
    assert got["timed_compile_s"] == pytest.approx(0.8) and got["timed_steps_with_compile"] == [4]
    assert summarize_steps([], warmup=2) == {}


def test_step_clock_reads_torchs_timers_around_a_real_compile():
    """Canary: the dynamo_timed keys and counters benchmarks/breakdown.py relies on exist on this torch."""
    import torch

    from benchmarks import breakdown as b

    clock = b.StepClock()
    lin = torch.nn.Linear(4, 4)
    fn = torch.compile(lambda x: lin(x).relu().sum(), backend="aot_eager")
    clock.start()
    fn(torch.randn(2, 4)).backward()
    first = clock.stop(1.0)
    clock.start()
    fn(torch.randn(2, 4)).backward()
    second = clock.stop(0.1)
    assert first["timers"].get(b.FRAME, 0) > 0 and first["timers"].get(b.BACKEND, 0) > 0, first["timers"]
    timers = first["timers"]  # rounded to 0.1 ms
    assert first["compile_s"] == pytest.approx(timers[b.FRAME] + timers.get(b.LAZY_BACKWARD, 0), abs=1e-3)
    assert first["graphs"] >= 1 and first["frames"] >= 1
    assert second["compile_s"] == 0.0 and second["graphs"] == 0  # the cached graph ran: nothing compiled
    from torch._dynamo.utils import counters

    assert {"inductor", "aot_autograd", "stats", "frames"} <= set(b.COUNTERS) and isinstance(counters["stats"], dict)
