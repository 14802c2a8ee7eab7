"""The benchmark's profiler overlap math (benchmarks/profile_overlap.py): the overlap of all-reduces with the
backward pass computed from synthetic profiler events and checked against the overlap recorder's definition,
the median over steps, the fallback when issue and completion events cannot be paired, bucket labels, and a
canary on a 1-rank gloo group that the profiler emits the events this math reads."""

from __future__ import annotations

import pytest


def _ev(name: str, start: float, end: float, thread: int = 1, nbytes: int = 0):
    from benchmarks.profile_overlap import Event

    return Event(name=name, thread=thread, start_us=start, end_us=end, nbytes=nbytes)


def _step_events(offset: float = 0.0) -> list:
    """One step (us): backward 100..1000; all-reduces issued at 300, 600, 1000 and done at 700, 900, 1400."""
    o = offset
    return [
        _ev("bench::step", o + 0, o + 1500),
        _ev("autograd::engine::evaluate_function: MmBackward0", o + 100, o + 200),
        _ev("c10d::allreduce_", o + 300, o + 310),
        _ev("gloo:all_reduce", o + 320, o + 700, thread=2),
        _ev("c10d::allreduce_", o + 600, o + 610),
        _ev("gloo:all_reduce", o + 700, o + 900, thread=3),
        _ev("c10d::allreduce_", o + 1000, o + 1010),
        _ev("gloo:all_reduce", o + 1010, o + 1400, thread=2),
        _ev("[memory]", o + 150, o + 150, nbytes=4000),
        _ev("[memory]", o + 400, o + 400, nbytes=6000),
        _ev("[memory]", o + 800, o + 800, nbytes=-8000),
        _ev("[memory]", o + 1200, o + 1200, nbytes=1000),
    ]


def test_profiler_overlap_matches_the_recorders_definition_on_a_synthetic_step():
    from benchmarks.profile_overlap import summarize
    from ddp.overlap.intervals import overlap_stats

    got = summarize(_step_events())
    # comm = [300,700] U [600,900] U [1000,1400] = 600+400 = 1000 us; window [100, 1000]; hidden 600
    expected = overlap_stats(compute=(100e-6, 1000e-6), comm=[(300e-6, 700e-6), (600e-6, 900e-6), (1000e-6, 1400e-6)])
    assert got["measured"] and got["paired"] and got["all_reduces"] == 3
    assert got["median_comm_ms"] == pytest.approx(1.0) and got["median_exposed_ms"] == pytest.approx(0.4)
    assert got["median_overlap_percent"] == pytest.approx(expected.percent) == pytest.approx(60.0)
    assert got["tensor_peak_mb"] == pytest.approx(10000 / 2**20)  # 4000 + 6000 before the free
    last = got["last_step"]
    assert last["backward_ms"] == [0.0, pytest.approx(0.9)]
    assert [b["ready_ms"] for b in last["buckets"]] == pytest.approx([0.2, 0.5, 0.9])


def test_profiler_overlap_takes_the_median_over_steps_and_falls_back_when_unpaired():
    from benchmarks.profile_overlap import label_buckets, summarize

    two = summarize(_step_events() + _step_events(offset=10_000))
    assert two["steps"] == 2 and two["median_overlap_percent"] == pytest.approx(60.0)
    # a gloo event without its issue (say, another thread issued it): only gloo's own intervals are used
    events = [e for e in _step_events() if not (e.name == "c10d::allreduce_" and e.start_us == 600)]
    unpaired = summarize(events)
    assert unpaired["measured"] and not unpaired["paired"]
    assert unpaired["median_comm_ms"] == pytest.approx((700 - 320 + 900 - 700 + 1400 - 1010) / 1e3)
    # no all-reduce at all (1 rank) or no step mark: not measured, with a reason
    quiet = summarize([e for e in _step_events() if "all" not in e.name])
    assert quiet["measured"] is False and "c10d::allreduce_" in quiet["reason"] and quiet["tensor_peak_mb"]
    assert summarize([])["measured"] is False
    planned = [{"params": ["a"], "bytes": 8}, {"params": ["b"], "bytes": 16}, {"params": ["c", "d"], "bytes": 4}]
    labelled = label_buckets(two["last_step"], planned)
    assert [b["params"] for b in labelled["buckets"]] == [["a"], ["b"], ["c", "d"]]
    assert label_buckets(two["last_step"], planned[:2]) is two["last_step"]  # counts differ: left alone


def test_profiler_records_the_events_the_overlap_math_reads(pg):
    """Canary on a 1-rank gloo group: the op names, gloo's worker-thread event and memory events exist."""
    import torch
    import torch.distributed as dist

    from benchmarks.profile_overlap import DONE, ISSUE, MEMORY, STEP_MARK, StepProfiler

    t = torch.ones(1024)
    with StepProfiler() as prof:
        with prof.mark_step():
            x = torch.randn(256, requires_grad=True)
            (x * 2).sum().backward()
            dist.all_reduce(t)
    names = {e.name for e in prof.events()}
    assert {STEP_MARK, ISSUE[0], DONE[0], MEMORY} <= names, sorted(n for n in names if "::" in n or "gloo" in n)
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    assert any(e.nbytes < 0 for e in prof.events() if e.name == MEMORY)  # frees are negative
