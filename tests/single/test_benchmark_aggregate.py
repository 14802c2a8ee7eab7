"""Aggregation of the benchmark's per-rank results and the tables built from them (benchmarks/aggregate.py,
benchmarks/tables.py): the first-step breakdown of the median job's slowest rank, per-mode aggregates with
memory, profiler figures and ratios against the peer mode, the absolute tensor peak and the gradient-memory
savings, and the steady-peak table cell."""

from __future__ import annotations

import pytest


def _rank(first: float, compile_s: float, **extra) -> dict:
    from benchmarks.breakdown import breakdown

    b = breakdown(first, {"_compile.compile_inner": compile_s}, {})
    return {
        "ok": True,
        "median_step_ms": 10.0,
        "first_step_s": first,
        "peak_rss_mb": 500.0,
        "final_loss": 2.0,
        "compile": {
            "first_step": b,
            "later_warmup_compile_s": 0.0,
            "timed_compile_s": 0.0,
            "timed_steps_with_compile": [],
        },
        **extra,
    }


def _job(job_id: str, kind: str, mode: str, ranks: list) -> dict:
    return {"job_id": job_id, "kind": kind, "mode": mode, "workload": "w", "ok": True, "ranks": ranks}


def test_first_step_breakdown_is_the_median_jobs_slowest_rank():
    from benchmarks.aggregate import first_step_breakdown

    jobs = [
        _job("a", "warm", "m", [_rank(1.0, 0.5), _rank(3.0, 2.0)]),
        _job("b", "warm", "m", [_rank(9.0, 8.0), _rank(2.0, 1.0)]),
        _job("c", "warm", "m", [_rank(5.0, 4.0), _rank(4.0, 1.0)]),
    ]
    got = first_step_breakdown(jobs)
    assert (got["job_id"], got["rank"], got["wall_s"], got["compile_s"], got["jobs"]) == ("c", 0, 5.0, 4.0, 3)
    assert first_step_breakdown([_job("old", "warm", "m", [{"first_step_s": 1.0}])]) is None  # older results


def test_aggregate_and_tables_show_breakdown_memory_profiler_and_ratios():
    from benchmarks.aggregate import aggregate_mode, comparisons
    from benchmarks.tables import markdown_table

    prof = {"measured": True, "median_overlap_percent": 70.0, "median_exposed_ms": 3.0, "tensor_peak_mb": 12.5}
    jobs = [
        _job(
            "t_cold", "cold", "torch_savvy", [_rank(20.0, 19.0, two_steps_s=21.0), _rank(21.0, 19.5, two_steps_s=22.0)]
        ),
        _job("t_warm", "warm", "torch_savvy", [_rank(6.0, 5.0), _rank(6.5, 5.0)]),
        _job(
            "o_cold",
            "cold",
            "ours_step_in_backward",
            [
                # its compile is at update 2: the first step is short, the second long
                _rank(8.0, 7.0, steady_peak_rss_mb=400.0, profile=prof, two_steps_s=16.0),
                _rank(9.0, 7.5, steady_peak_rss_mb=410.0, profile=prof, two_steps_s=15.0),
            ],
        ),
        _job("o_warm", "warm", "ours_step_in_backward", [_rank(2.0, 1.0), _rank(3.0, 1.0)]),
    ]
    modes = {m: aggregate_mode(jobs, m) for m in ("torch_savvy", "ours_step_in_backward")}
    ours = modes["ours_step_in_backward"]
    assert ours["first_step"]["cold"]["job_id"] == "o_cold" and ours["first_step"]["cold"]["rank"] == 1
    assert ours["steady_peak_rss_mb_per_rank"] == [400.0, 410.0]
    assert ours["profile"]["tensor_peak_mb_per_rank"] == [12.5, 12.5] and ours["profile"]["overlap_percent"] == 70.0
    [row] = comparisons(modes)
    assert row["peer"] == "torch_savvy" and row["first_step_cold_vs_peer"] == pytest.approx(9.0 / 21.0)
    assert row["first_step_warm_vs_peer"] == pytest.approx(3.0 / 6.5) and row["step_ms_vs_best_torch"] == 1.0
    assert row["warmup_compile_cold_vs_peer"] == pytest.approx(7.5 / 19.5)  # the slowest ranks' compile seconds
    assert row["two_steps_cold_vs_peer"] == pytest.approx(16.0 / 22.0)  # slowest ranks, to the end of step 2
    assert row["two_steps_warm_vs_peer"] is None  # the warm jobs' results do not have it: no ratio, no crash
    data = {
        "description": "d",
        "purpose": "p",
        "modes": modes,
        "comparisons": [row],
        "loss_agreement": {
            "ok": True,
            "tolerance": 0.1,
            "reference": "torch_savvy",
            "reference_loss": 2.0,
            "disagree": [],
            "unstable": [],
        },
    }
    text = markdown_table({"workloads": {"w": data}}, "w")
    assert "| ours_step_in_backward | cold | 9.00 | 7.50 |" in text  # breakdown row: slowest rank of the cold job
    assert "400/410" in text and "12.5/12.5" in text and "| 0.43 | 0.46 | 0.38 | 0.73 / - |" in text
    assert "| - / 70 | - / 3.0 |" in text  # no recorder in this job; the profiler's 70 % and 3.0 ms


def test_absolute_tensor_peak_adds_what_was_held_and_savings_are_read_in_gradient_bytes():
    from benchmarks.aggregate import aggregate_mode
    from benchmarks.memory import gradient_savings
    from benchmarks.tables import _tensor_peak_cell, gradient_savings_line

    def prof(step_peak, **state):
        return {
            "measured": False,
            "reason": "r",
            "tensor_peak_mb": step_peak,
            "state_mb": {"gradient_bytes": 50.0, **state},
        }

    held_ref = {"parameters": 50.0, "optimizer_state": 100.0, "ddp_buckets": 50.0}
    jobs = [
        _job("r", "cold", "ours_step", [_rank(8.0, 7.0, profile=prof(50.0, **held_ref))] * 2),
        _job(
            "b",
            "cold",
            "ours_step_in_backward",
            [_rank(8.0, 7.0, profile=prof(30.0, parameters=50.0, optimizer_state=100.0))] * 2,
        ),
    ]
    modes = {m: aggregate_mode(jobs, m) for m in ("ours_step", "ours_step_in_backward")}
    ref = modes["ours_step"]["profile"]
    assert ref["held_mb_per_rank"] == [200.0, 200.0] and ref["absolute_peak_mb_per_rank"] == [250.0, 250.0]
    [row] = gradient_savings(modes)
    # 250 - 180 = 70 MB lower: 140% of the 50 MB of gradients (DDP's bucket copy and the gradients both gone)
    assert row["mode"] == "ours_step_in_backward" and row["saved_mb"] == 70.0 and row["share"] == pytest.approx(1.4)
    assert _tensor_peak_cell(ref) == "200.0/200.0 + 50.0/50.0 = 250.0/250.0"
    assert _tensor_peak_cell({"tensor_peak_mb_per_rank": [12.5, 12.5]}) == "12.5/12.5"  # older results
    assert "ours_step_in_backward +70.0 MB (+140%)" in gradient_savings_line({"gradient_savings": [row]})


def test_the_steady_peak_cell_shows_what_the_steps_added():
    from benchmarks.tables import _steady_cell

    assert _steady_cell({"steady_peak_rss_mb_per_rank": [900.0, 880.0]}) == "900/880"
    both = {"steady_peak_rss_mb_per_rank": [900.0, 880.0], "steady_growth_rss_mb_per_rank": [12.0, None]}
    assert _steady_cell(both) == "900/880 (+12/-)"
