"""The GPU benchmark (`python -m benchmarks.gpu`) without a GPU: its kernel counting on made-up profiler events,
its rows and table (a failed mode is reported, never dropped), its BENCHMARKS.md block, the phases with a
stand-in worker (no torch in the ranks), and one real one-mode run on the CPU at tiny sizes. Nothing is timed."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.profile_overlap import Event

# -- benchmarks/kernels.py -------------------------------------------------------------------------------


def _ev(name, start, end, *, device="cpu", kind="", thread=1):
    return Event(name=name, thread=thread, start_us=start, end_us=end, device=device, kind=kind)


def test_gpu_kernels_are_counted_per_step_without_copies_or_mirrored_annotations():
    from benchmarks.kernels import summarize_kernels

    events = [
        _ev("bench::step", 0, 100, kind="user_annotation"),
        _ev("bench::step", 1000, 1100, kind="user_annotation"),
        _ev("## Call CompiledFxGraph abc ##", 10, 50, kind="user_annotation"),
        _ev("cudaStreamSynchronize", 60, 90, kind="cuda_runtime"),
        _ev("aten::_local_scalar_dense", 55, 95, kind="cpu_op"),
        # step 0's GPU side: two kernels overlapping by 10 us, a copy, the mirrored step annotation
        _ev("bench::step", 5, 400, device="cuda", kind="gpu_user_annotation"),
        _ev("triton_poi_fused_add_0", 200, 300, device="cuda", kind="kernel"),
        _ev("ampere_sgemm", 290, 390, device="cuda", kind="kernel"),
        _ev("Memcpy DtoH (Device -> Pageable)", 395, 399, device="cuda", kind="gpu_memcpy"),
        # step 1: one kernel, and a kind-less copy and annotation (a torch that does not say the kind)
        _ev("bench::step", 1005, 1400, device="cuda"),
        _ev("triton_red_fused_sum_1", 1200, 1250, device="cuda"),
        _ev("Memset (Device)", 1260, 1261, device="cuda"),
    ]
    got = summarize_kernels(events)
    assert got["measured"] and got["device"] == "cuda" and got["steps"] == 2
    step0, step1 = got["per_step"]
    assert (step0["kernels"], step0["copies"], step0["syncs"], step0["graph_calls"]) == (2, 1, 1, 1)
    assert step0["kernel_ms"] == pytest.approx(0.2) and step0["busy_ms"] == pytest.approx(0.19)
    assert step0["scalar_reads"] == 1 and step0["host_ms"] == pytest.approx(0.1)
    assert (step1["kernels"], step1["copies"], step1["busy_ms"]) == (1, 1, pytest.approx(0.05))
    assert got["kernels"] == 1.5  # medians per figure
    assert got["top"][0]["name"] == "triton_red_fused_sum_1"
    json.dumps(got)


def test_the_longest_idle_stretches_name_the_kernels_around_them_and_what_the_host_had_open():
    from benchmarks.kernels import summarize_kernels

    events = [
        _ev("bench::step", 0, 500, kind="user_annotation"),
        _ev("Optimizer.step#AdamW.step", 300, 480, kind="user_annotation"),
        _ev("aten::_foreach_add_", 400, 450, kind="cpu_op"),
        _ev("cudaLaunchKernel", 440, 445, kind="cuda_runtime"),  # a runtime call: never named as the host's
        _ev("k_fwd", 100, 200, device="cuda", kind="kernel"),
        _ev("k_bwd", 210, 250, device="cuda", kind="kernel"),
        _ev("k_bwd_tail", 240, 260, device="cuda", kind="kernel"),  # overlaps: no gap between them
        _ev("k_update", 445, 470, device="cuda", kind="kernel"),
    ]
    gaps = summarize_kernels(events)["idle_top"]
    # 260 -> 445 (185 us, the longest), the lead 0 -> 100, then 200 -> 210
    assert [(g["at_ms"], g["ms"]) for g in gaps] == [(0.26, 0.185), (0.0, 0.1), (0.2, 0.01)]
    assert (gaps[0]["before"], gaps[0]["after"]) == ("k_bwd_tail", "k_update")
    assert gaps[0]["host"] == ["bench::step", "Optimizer.step#AdamW.step", "aten::_foreach_add_"]
    assert gaps[1]["before"] is None and gaps[1]["after"] == "k_fwd"


def test_cpu_kernels_are_leaf_compute_ops_and_inductor_cpp_kernels():
    from benchmarks.kernels import summarize_kernels

    events = [
        _ev("bench::step", 0, 1000, kind="user_annotation"),
        # eager linear: addmm is the kernel, the transpose a view
        _ev("aten::linear", 10, 100, kind="cpu_op"),
        _ev("aten::t", 11, 12, kind="cpu_op"),
        _ev("aten::addmm", 20, 90, kind="cpu_op"),
        # a dtype conversion: only its copy_ runs a kernel
        _ev("aten::to", 110, 150, kind="cpu_op"),
        _ev("aten::_to_copy", 111, 149, kind="cpu_op"),
        _ev("aten::empty_strided", 112, 113, kind="cpu_op"),
        _ev("aten::copy_", 114, 148, kind="cpu_op"),
        # a compiled graph: one extern mm and two C++ kernels (one per fused kernel)
        _ev("## Call CompiledFxGraph f ##", 200, 600, kind="user_annotation"),
        _ev("aten::empty_strided", 201, 202, kind="cpu_op"),
        _ev("aten::mm", 210, 300, kind="cpu_op"),
        _ev("graph_0_cpp_fused_gelu_0", 310, 400, kind="cpu_op"),
        _ev("graph_0_cpp_fused_add_1", 410, 500, kind="cpu_op"),
        _ev("mkldnn::_linear_pointwise", 505, 590, kind="cpu_op"),  # a GEMM with its epilogue, from oneDNN
        # an .item() and an op on another thread (the autograd engine's on a GPU rank)
        _ev("aten::item", 700, 720, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 701, 719, kind="cpu_op"),
        _ev("aten::mul_", 800, 850, kind="cpu_op", thread=2),
        # outside the step: not counted
        _ev("aten::add_", 1500, 1600, kind="cpu_op"),
    ]
    got = summarize_kernels(events)
    assert got["device"] == "cpu" and got["steps"] == 1
    step = got["per_step"][0]
    assert step["kernels"] == 7  # addmm, copy_, mm, 2 C++ kernels, the oneDNN linear, mul_
    assert step["cpp_kernels"] == 2 and step["graph_calls"] == 1 and step["scalar_reads"] == 1
    assert step["kernel_ms"] == pytest.approx((70 + 34 + 90 + 90 + 90 + 85 + 50) / 1e3)


def test_the_cpu_loop_inside_a_multi_tensor_op_is_one_kernel_and_no_host_ops_of_its_own():
    """torch's fused Adam on the CPU reads each step count with `.item()` and a foreach add runs an `add_` per
    tensor, inside the op; a GPU does both on the device, so on the CPU they count neither as kernels, host ops
    nor scalar reads. A read outside such an op still counts."""
    from benchmarks.kernels import summarize_kernels

    events = [
        _ev("bench::step", 0, 1000, kind="user_annotation"),
        _ev("aten::_foreach_add_", 10, 100, kind="cpu_op"),
        _ev("aten::add_", 20, 40, kind="cpu_op"),
        _ev("aten::add_", 50, 70, kind="cpu_op"),
        _ev("aten::_fused_adamw_", 200, 600, kind="cpu_op"),
        _ev("aten::item", 210, 220, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 211, 219, kind="cpu_op"),
        _ev("aten::item", 300, 320, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 301, 319, kind="cpu_op"),
        _ev("aten::mul_", 400, 500, kind="cpu_op", thread=2),  # another thread: not inside the fused op
        _ev("aten::item", 700, 720, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 701, 719, kind="cpu_op"),
    ]
    got = summarize_kernels(events)
    assert got["host_ops_scope"] == "outside multi-tensor ops"  # the renderer tells it from older results
    step = got["per_step"][0]
    assert step["kernels"] == 3  # the foreach add, the fused AdamW, mul_
    assert (step["host_ops"], step["scalar_reads"]) == (5, 1)
    assert dict(summarize_kernels(events)["host_top"])["aten::item"] == 1
    # on a GPU rank the host's own events are all host work
    gpu = events + [_ev("k", 200, 210, device="cuda", kind="kernel")]
    assert summarize_kernels(gpu)["per_step"][0]["host_ops"] == 11
    assert "host_ops_scope" not in summarize_kernels(gpu)


def test_no_step_mark_means_not_measured():
    from benchmarks.kernels import summarize_kernels

    assert summarize_kernels([_ev("aten::mm", 0, 1)])["measured"] is False


# -- benchmarks/gpu_report.py ----------------------------------------------------------------------------


def _ok_job(mode, step_ms, *, two=2.0, kernels=100, busy=8.0, dot=1.0):
    rank = {
        "ok": True,
        "median_step_ms": step_ms,
        "median_host_ms": step_ms / 2,
        "first_step_s": two - 0.5,
        "two_steps_s": two,
        "steady_peak_cuda_mb": 4000.0,
        "final_loss": 5.0,
        "param_checksum": {"names": ["w"], "update_norm": [1.0], "update_dot": [dot]},
        "kernels": {"measured": True, "device": "cuda", "kernels": kernels, "busy_ms": busy, "graph_calls": 3},
        "versions": {"torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "device_name": "H100"},
        "pg_backend": "nccl",
    }
    ready = {"first_step_s": two - 0.5, "two_steps_s": two, "cold_parallel": 5}
    return {"mode": mode, "kind": "cold", "ok": True, "errors": [], "ranks": [rank], "ready": ready}


def _failed_job(mode, error, *, ready=None, unavailable=False):
    return {"mode": mode, "kind": "cold", "ok": False, "unavailable": unavailable, "errors": [error], "ranks": []}


def _result(jobs, modes):
    from benchmarks.gpu_report import aggregate

    config = {
        "precision": "fp32",
        "modes": modes,
        "model": "GPT d=768",
        "optimizer": "AdamW(lr=0.001)",
        "backend": "inductor",
        "warmup": 3,
        "steps": 20,
        "profile_steps": 3,
        "parallel": len(modes),
        "compile_threads_text": "TORCHINDUCTOR_COMPILE_THREADS=2",
        "command": "python -m benchmarks.gpu",
    }
    machine = {"device_name": "H100", "versions": {"torch": "2.11.0"}, "pg_backend": "nccl", "cpu_count": 16}
    phases = [{"name": "A", "budget_s": 300.0, "spent_s": 120.0}, {"name": "B", "budget_s": 200.0, "spent_s": 90.0}]
    return {"device": "cuda", "config": config, "machine": machine, "phases": phases, "modes": aggregate(config, jobs)}


def test_a_failed_stopped_or_unstarted_mode_keeps_its_row_and_its_error():
    from benchmarks.gpu_report import table

    modes = ["eager", "torch_savvy", "ours_step", "ours_step_in_graph", "ours_step_in_backward"]
    failed = _failed_job("ours_step", "ours_step rank 0: RuntimeError: CUDA driver error")
    failed["ready"] = {"first_step_s": 80.0, "two_steps_s": 90.0}  # failed after its warm-up: start-up kept
    jobs = [
        _ok_job("eager", 44.8, two=0.4),
        _ok_job("torch_savvy", 41.4, two=76.4, dot=1.001),
        failed,
        _failed_job("ours_step_in_graph", "ours_step_in_graph rank 0: GateStopped: the GPU benchmark stopped this job"),
    ]
    result = _result(jobs, modes)
    rows = result["modes"]
    assert list(rows) == modes
    assert [rows[m]["status"] for m in modes] == ["ok", "ok", "failed", "not timed", "not run"]
    assert rows["ours_step"]["two_steps_s_cold"] == 90.0 and rows["ours_step"].get("step_ms") is None
    assert rows["eager"]["step_vs_ref"] == pytest.approx(44.8 / 41.4)
    assert rows["torch_savvy"]["param_distance"] == pytest.approx(0.001)
    lines = table(result)
    body = [line for line in lines if line.startswith("| `")]
    assert len(body) == len(modes)  # every mode has its row
    assert "| `ours_step` | failed |" in body[2] and "90.0 (1.18x)" in body[2]
    assert any(line.startswith("- `ours_step` failed: ours_step rank 0: RuntimeError") for line in lines)
    assert any(line.startswith("- `ours_step_in_backward` not run") for line in lines)
    assert "| `eager` | ok | 44.8 (1.08x) | - | 22.4 | 0.4 (0.01x) |" in body[0]
    json.dumps(result)


def test_the_gpu_block_lives_between_its_own_markers_beside_the_cpu_generator():
    from benchmarks.gpu_report import GPU_BEGIN, GPU_END, merge_gpu_section, section
    from benchmarks.markers import GENERATED_BEGIN, GENERATED_END, check_markdown, merge_markdown

    result = _result([_ok_job("eager", 44.8), _ok_job("torch_savvy", 41.4)], ["eager", "torch_savvy"])
    block = section([result])
    assert block.startswith(GPU_BEGIN) and block.rstrip().endswith(GPU_END)
    assert "### fp32: H100, world size 1 (nccl)" in block and "under that contention" in block
    doc = f"# Benchmarks\n\n{GENERATED_BEGIN}\nCPU tables\n{GENERATED_END}\n\n## GPU: notes\n\nHAND-WRITTEN\n"
    once = merge_gpu_section(doc, block)
    assert once.index("## GPU: notes") < once.index(GPU_BEGIN) < once.index("HAND-WRITTEN")
    twice = merge_gpu_section(once, block.replace("44.8", "40.0"))
    assert twice.count(GPU_BEGIN) == 1 and "40.0" in twice and "HAND-WRITTEN" in twice
    # the CPU generator rewrites its own block and keeps ours
    regenerated = merge_markdown(twice, f"{GENERATED_BEGIN}\nnew CPU tables\n{GENERATED_END}\n")
    assert "new CPU tables" in regenerated and regenerated.count(GPU_BEGIN) == 1
    path = Path(__file__).parent / "does_not_exist.md"
    check_markdown(path)
    with pytest.raises(ValueError, match="generated-gpu:begin"):
        merge_gpu_section(twice.replace(GPU_END, ""), block)
    assert merge_gpu_section("# B\n", block).endswith(block)  # no GPU heading: a new section at the end


# -- benchmarks/gpu.py: the phases with a stand-in worker --------------------------------------------------

STAND_IN = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from benchmarks.gate import Gate, GateStopped

    spec_path = Path(sys.argv[1])
    spec = json.loads(spec_path.read_text())
    mode, out = spec["mode"], spec_path.parent / "rank0.json"
    if mode == "ours_step":
        sys.exit(1)  # dies in its warm-up, no result
    if mode == "ours_step_in_graph":
        time.sleep(600)  # never ready: phase A must end it
    if spec.get("gate_dir"):
        gate = Gate(spec["gate_dir"])
        gate.arrive({"first_step_s": 1.0, "two_steps_s": 1.5, "warmup_s": 2.0})
        gate.wait(60)
    out.write_text(json.dumps({
        "ok": True, "mode": mode, "rank": 0, "median_step_ms": 10.0, "median_host_ms": 4.0,
        "first_step_s": 1.0, "two_steps_s": 1.5 if spec.get("gate_dir") else 0.5, "final_loss": 1.0,
        "kernels": {"measured": True, "device": "cpu", "kernels": 7, "kernel_ms": 3.0, "graph_calls": 2},
    }))
    os._exit(0)
    """
)


def test_phases_time_the_ready_jobs_and_report_the_crashed_and_the_hung(tmp_path):
    from benchmarks import gpu, gpu_phases

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    args = gpu.build_parser().parse_args(["--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "64"])
    modes = ("eager", "torch_savvy", "ours_step", "ours_step_in_graph")
    cfg = gpu._config(args, modes, 1, "python -m benchmarks.gpu (test)", "fp32")
    entries = [gpu_phases.Entry("fp32", mode, cfg) for mode in modes]
    lines: list[str] = []
    budget = gpu_phases.Budget(20.0, log=lines.append, margin_s=1.0)
    jobs = gpu_phases.run_phases(
        entries,
        parallel=len(modes),
        reserve_s=2.0,
        warm=[entries[1]],
        budget=budget,
        work=tmp_path,
        worker=(str(script),),
    )
    by = {(j["mode"], j["kind"]): j for j in jobs}
    assert by[("eager", "cold")]["ok"] and by[("torch_savvy", "cold")]["ok"]
    assert by[("torch_savvy", "warm")]["ranks"][0]["two_steps_s"] == 0.5
    assert "without a result" in by[("ours_step", "cold")]["errors"][0]
    assert "not finished within phase A" in by[("ours_step_in_graph", "cold")]["errors"][0]
    assert by[("eager", "cold")]["ready"]["cold_parallel"] == 4
    assert [p["name"] for p in budget.phases] == ["A", "B", "C"]
    assert any(line.startswith("budget: phase A spent") and "2/4 ready" in line for line in lines)
    result = gpu.build_result(
        cfg, args, jobs, tag="fp32", device="cpu", phases=budget.phases, threads_text="1 thread", parallel=4
    )
    status = {m: r["status"] for m, r in result["modes"].items()}
    assert status == {"eager": "ok", "torch_savvy": "ok", "ours_step": "failed", "ours_step_in_graph": "failed"}
    assert result["modes"]["torch_savvy"]["two_steps_s_warm"] == 0.5


# -- one real run on the CPU ------------------------------------------------------------------------------


def test_a_tiny_cpu_run_writes_the_json_and_the_block(tmp_path):
    from benchmarks import gpu
    from benchmarks.gpu_report import GPU_BEGIN

    argv = ["--d-model", "32", "--layers", "1", "--heads", "2", "--vocab", "64", "--compute-batch", "1x8"]
    argv += ["--modes", "eager", "--backend", "eager", "--warmup", "2", "--steps", "2", "--profile-steps", "1"]
    argv += [
        "--budget-s",
        "120",
        "--warm-modes",
        "eager",
        "--profile-warm",
        "--out-dir",
        str(tmp_path),
        "--tag",
        "tiny",
    ]
    assert gpu.main(argv) == 0
    result = json.loads((tmp_path / "results_fp32_tiny.json").read_text())
    row = result["modes"]["eager"]
    assert row["status"] == "ok", row.get("error")
    assert row["kernels"]["device"] == "cpu" and row["kernels"]["kernels"] > 10
    assert row["cuda_peak_mb"] is None and row["step_ms"] > 0
    assert row["back_to_back_ms"] > 0  # 10 steps with no sync between them (the default), timed together
    # one more step under the memory profiler: its peak by kind, the held state from the job's own count
    peak = row["memory_at_peak"]
    assert peak["measured"] and peak["device"] == "cpu", peak
    assert peak["held_mb"]["parameters"] > 0 and peak["held_mb"]["optimizer_state"] > 0, peak
    assert peak["peak_mb"] == pytest.approx(sum(peak["held_mb"].values()) + peak["step_peak_mb"])
    assert peak["where"] in ("forward", "backward", "after backward") and peak["step_peak_mb"] > 0, peak
    # 3 steps after the timed ones under cProfile (the default): the step's own Python leads by cumulative time
    host = row["host_profile"]
    assert host["steps"] == 3 and len(host["own"]) == 20, host
    assert host["cumulative"][0]["where"].startswith("benchmarks/mode_context.py:"), host["cumulative"][:3]
    assert host["cumulative"][0]["calls"] == 3 and host["cumulative"][0]["cumulative_s"] > 0
    # phase C: a warm start-up, then one more with its first two steps under cProfile
    assert row["two_steps_s_warm"] > 0
    found = row["startup_profile_warm"]
    assert found["two_steps_s"] > 0 and len(found["own"]) == len(found["cumulative"]) == 20, found
    # the profiled region is the step itself: its outermost function (eager's `run`) leads by cumulative time
    assert found["cumulative"][0]["where"].startswith("benchmarks/mode_context.py:"), found["cumulative"][:3]
    assert found["cumulative"][0]["cumulative_s"] <= found["two_steps_s"] * 1.05
    block = (tmp_path / "gpu_fp32_tiny.md").read_text()
    assert block.startswith(GPU_BEGIN)
    assert "| `eager` | " + format(peak["peak_mb"], ".1f") + " | " in block  # the memory table's row
    assert (tmp_path / "logs_fp32_tiny.tgz").is_file()
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n## GPU: by hand\n")
    assert gpu.main(["--render", str(tmp_path / "results_fp32_tiny.json"), "--markdown", str(md)]) == 0
    assert GPU_BEGIN in md.read_text()


def test_scalar_reads_are_placed_in_the_host_ranges_open_around_them():
    from benchmarks.kernels import summarize_kernels

    events = [
        _ev("bench::step", 0, 1000, kind="user_annotation"),
        # two reads inside a compiled graph's call, under an op that reads (a device wait on a GPU)
        _ev("## Call CompiledFxGraph f ##", 100, 400, kind="user_annotation"),
        _ev("aten::nonzero", 150, 250, kind="cpu_op"),
        _ev("aten::item", 160, 170, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 161, 169, kind="cpu_op"),
        _ev("cudaStreamSynchronize", 162, 168, kind="cuda_runtime"),  # a runtime call: never the place
        _ev("aten::nonzero", 260, 350, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 270, 280, kind="cpu_op"),
        # one read made by Python code in the optimizer's step: only its phase
        _ev("Optimizer.step#AdamW.step", 500, 700, kind="user_annotation"),
        _ev("aten::item", 600, 610, kind="cpu_op"),
        _ev("aten::_local_scalar_dense", 601, 609, kind="cpu_op"),
        # one on another thread, whose open ranges are its own
        _ev("aten::_local_scalar_dense", 300, 310, kind="cpu_op", thread=2),
        _ev("k", 120, 130, device="cuda", kind="kernel"),
    ]
    got = summarize_kernels(events)
    assert got["scalar_reads"] == 4
    assert got["scalar_read_where"] == [
        ["## Call CompiledFxGraph f ## > aten::nonzero", 2],
        ["Optimizer.step#AdamW.step", 1],
        ["(the step itself)", 1],
    ]
    assert "scalar_read_where" not in got["per_step"][0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_mode_at_one_precision_runs_there_only_and_a_stray_precision_is_refused():
    from benchmarks.gpu import _modes_at

    both = ("fp32", "bf16")
    assert _modes_at("torch_savvy,ours_step_in_backward_unfused@fp32,ours_step", both) == {
        "fp32": ("torch_savvy", "ours_step_in_backward_unfused", "ours_step"),
        "bf16": ("torch_savvy", "ours_step"),
    }
    assert _modes_at("eager@bf16", both) == {"fp32": (), "bf16": ("eager",)}
    with pytest.raises(ValueError, match="'fp16' is not one of this run's precisions"):
        _modes_at("eager@fp16", both)
    with pytest.raises(ValueError, match="'bf16' is not one of"):
        _modes_at("eager,ours_step@bf16", ("fp32",))


def test_timed_steps_wait_while_the_work_beside_the_compiles_holds_the_device(tmp_path, monkeypatch):
    import threading
    import time

    from benchmarks import gpu_phases

    lines = []
    budget = gpu_phases.Budget(300, log=lines.append)
    hold = tmp_path / "hold"
    monkeypatch.setenv(gpu_phases.HOLD_ENV, str(hold))
    t0 = time.monotonic()
    gpu_phases._wait_for_hold(budget)  # no file: no wait
    assert time.monotonic() - t0 < 0.5 and lines[-1].startswith("phase B: the work beside phase A had ended")
    hold.touch()
    threading.Timer(1.0, hold.unlink).start()
    gpu_phases._wait_for_hold(budget)
    assert time.monotonic() - t0 >= 1.0
    assert lines and lines[-1].startswith("phase B: waited"), lines
    hold.touch()
    monkeypatch.setattr(gpu_phases, "HOLD_MAX_S", 0.6)  # work that outlives the wait: timed anyway, said so
    gpu_phases._wait_for_hold(budget)
    assert "still there" in lines[-1], lines
