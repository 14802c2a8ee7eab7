"""CI smoke of `python -m benchmarks --smoke`: every mode runs (or says why not), every mode ends with
eager's parameters, and every metric the report shows is there (first-step breakdown, steady-state and
tensor peaks, overlap from the comm hook and from the profiler). The bracket modes run too: floor
without any communication (its ranks end apart), comm_only with DDP's own buckets (checked against
the buckets DDP's comm hook saw in the eager job), both outside the gates.

No timing is asserted: the smoke preset makes no timing claims. Losses agree too easily to be the gate
(after 3 steps a mode without any all-reduce ends within 1e-3 of eager's loss); the gate is each
mode's parameter fingerprint (benchmarks/checksum.py) against eager's, at a tolerance the test shows a
run without all-reduce (or with a doubled gradient) cannot meet, by replaying those runs itself. The
smoke runs SGD (its default): AdamW normalises the gradient's scale away, so a doubled gradient would
pass an AdamW gate (see BenchConfig.param_rtol); the AdamW plumbing is unit-tested in
tests/single/test_benchmark_config.py and tests/single/test_benchmark_cli.py.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.procs import kill_marked

REPO_ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 120  # per benchmark job (passed as --timeout); a normal smoke job takes 5-25 s
RUN_TIMEOUT_S = 600  # the whole benchmark (12 jobs): one hung job (killed at JOB_TIMEOUT_S) plus every other job
DDP_HOOK_MODES = ("eager", "torch_ddpopt", "torch_nosplit", "torch_savvy", "ours_compile", "ours_step")
"""Modes whose all-reduce goes through DDP's reducer: the comm-hook recorder sees their buckets."""


def _replay(result: dict, *, ranks: tuple[int, ...], grad_scale: float = 1.0) -> dict:
    """The smoke's training replayed in this process, one model, no process group: each step uses the
    mean of the given ranks' gradients times `grad_scale`. ranks=(0, 1) is what DDP computes; (0,) is
    rank 0 without any all-reduce; grad_scale=2 is a summed (doubled) all-reduce."""
    import torch

    from benchmarks.checksum import param_checksum
    from benchmarks.modes import make_optimizer
    from benchmarks.workloads import Workload
    from examples.gpt import GPT, GPTConfig, lm_loss, synthetic_batch

    cfg = result["config"]
    work = Workload.from_dict(cfg["workloads"][0])
    gpt = GPTConfig(**work.gpt_kwargs())
    torch.manual_seed(cfg["seed"])  # as benchmarks.worker builds the model
    model = GPT(gpt)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    opt = make_optimizer(cfg["optimizer"], params, cfg["optimizer_kwargs"])
    for step in range(cfg["warmup"] + cfg["steps"] + cfg["profile_steps"]):  # profiled steps train too
        grads = []
        for rank in ranks:
            x, y = synthetic_batch(gpt, work.batch, work.seq_len, step=step, rank=rank, seed=cfg["seed"])
            grads.append(torch.autograd.grad(lm_loss(model(x), y), params))
        for p, *per_rank in zip(params, *grads):
            p.grad = grad_scale * sum(per_rank) / len(per_rank)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return param_checksum(dict(model.named_parameters()), initial)


@pytest.mark.multi_gpu
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_smoke_benchmark_every_mode_ends_with_eagers_parameters(tmp_path):
    from benchmarks.checksum import checksum_distance
    from benchmarks.config import BRACKET_MODES, IN_GRAPH_MODES, MODES

    # A marker in the environment of the benchmark and of every rank it starts: the runner starts ranks
    # in sessions of their own, so on a timeout killing the benchmark's process group is not enough.
    marker = f"benchsmoke_{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "BENCH_SMOKE_TEST_MARKER": marker, "TMPDIR": str(tmp_path)}  # cache dirs under tmp_path
    # one workload of one block: every mode's plumbing at the least compile time; aot_eager is the smoke default
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "--smoke",
        "--workloads",
        "comm",
        "--modes",
        ",".join(MODES),  # the variants too, which a run leaves out unless named
        "--layers",
        "1",
        "--timeout",
        str(JOB_TIMEOUT_S),
        "--out-dir",
        str(tmp_path / "out"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"benchmark did not finish within {RUN_TIMEOUT_S}s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        kill_marked(marker)  # ranks outlive their runner when it is killed: nothing may stay behind
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"

    out_dir = tmp_path / "out"
    result = json.loads((out_dir / "results.json").read_text())
    assert result["config"]["backend"] == "aot_eager" and result["config"]["optimizer"] == "sgd"
    assert result["config"]["timeout_s"] == JOB_TIMEOUT_S < RUN_TIMEOUT_S
    workload = result["workloads"]["comm"]
    modes = workload["modes"]
    assert set(modes) == set(MODES)
    # Modes that need what this machine or torch lacks say so; every other mode runs (on torch 2.11-2.14 + gloo),
    # and a failure names the mode and the rank.
    import torch

    lacking = set()
    if not torch.cuda.is_available():
        lacking.add("torch_reducer_overlap")  # Inductor's overlap scheduler estimates with a GPU's figures
    if not hasattr(torch.compiler.config, "compile_on_one_rank"):
        lacking.add("torch_savvy_one_rank")  # torch 2.14's
    lacking.add("ours_step_in_backward_cpp")  # an Inductor option (cpp_wrapper); the smoke compiles with aot_eager
    if "_bucket_config" not in inspect.getsource(torch.nn.parallel.DistributedDataParallel.__init__):
        lacking.add("comm_only")  # copies DDP's bucket layout, which torch 2.13 made readable (`_bucket_config`)
    for mode, agg in modes.items():
        expected = "unavailable" if mode in lacking else "ok"
        assert agg["status"] == expected, f"{mode}: {agg['status']}: {agg.get('error')}"
        if mode in lacking:
            assert agg.get("error"), f"{mode}: unavailable without a reason"
    modes = {m: a for m, a in modes.items() if m not in lacking}

    # The gate: every mode's final parameters are eager's, on every rank.
    params = workload["param_agreement"]
    rtol = params["rtol"]
    assert rtol == 1e-5  # the aot_eager default (BenchConfig.param_rtol)
    assert params["reference"] == "eager" and params["ok"], params
    assert params["exempt"] == workload["loss_agreement"]["exempt"] == list(BRACKET_MODES)
    trained = {m: a for m, a in modes.items() if m not in BRACKET_MODES}
    for mode, agg in trained.items():
        assert checksum_distance(agg["param_checksum"], modes["eager"]["param_checksum"]) <= rtol, mode
        assert agg["rank_param_distance"] <= rtol, f"{mode}: ranks ended with different parameters"

    # ... and that tolerance really separates a correct run from a broken one: replayed here, DDP's
    # averaged gradient lands on eager's fingerprint, while no all-reduce or a doubled gradient land
    # orders of magnitude outside the tolerance.
    eager = modes["eager"]["param_checksum"]
    assert checksum_distance(_replay(result, ranks=(0, 1)), eager) <= rtol
    for broken in (
        _replay(result, ranks=(0,)),
        _replay(result, ranks=(1,)),
        _replay(result, ranks=(0, 1), grad_scale=2),
    ):
        assert checksum_distance(broken, eager) > 1000 * rtol

    # Losses still agree (the weaker check the table reports)
    finished = {m: a["final_loss"] for m, a in trained.items()}
    assert workload["loss_agreement"]["ok"], workload["loss_agreement"]
    for mode, loss in finished.items():
        assert loss == pytest.approx(finished["eager"], rel=1e-3), mode
    # every job ran 1 warm-up, 1 timed and 1 profiled step (the bracket modes are never profiled), its ranks
    # forked from the run's server (Note [Forked benchmark ranks]: one environment for the whole run)
    for job in result["jobs"]:
        assert job["forked_ranks"] == job["world_size"] == 2, job["job_id"]
        for rank in job["ranks"]:
            if rank.get("ok"):
                profiled = 0 if job["mode"] in BRACKET_MODES else 1
                assert len(rank["losses"]) == 2 + profiled and len(rank["step_ms"]) == 1, job["job_id"]
                assert len(rank["profiled_step_ms"]) == profiled, job["job_id"]

    _check_metrics(modes)
    _check_bracket(result, rtol)

    assert (out_dir / "step_ms.png").read_bytes()[:4] == b"\x89PNG"
    report = (out_dir / "BENCHMARKS.md").read_text()
    assert "python -m benchmarks --smoke" in report and "torch " in report
    assert "Parameter agreement: OK" in report
    assert "First step of comm, where the time goes" in report and "Ours vs PyTorch on comm" in report
    assert "Not gated: floor, comm_only" in report and "- link: plain loopback" in report
    if "comm_only" in lacking:
        assert "Bracket: floor " in report and " only (comm_only unavailable" in report
    else:
        assert "**Bracket: floor " in report
        buckets = len(modes["comm_only"]["info"]["buckets"])
        assert buckets >= 2, modes["comm_only"]["info"]  # the tiny model at the smoke's 1 MiB cap
        assert f"- comm / `comm_only`: {buckets} all-reduces per step" in report
    for mode in IN_GRAPH_MODES - lacking:  # their overlap timeline comes from the profiler
        assert (out_dir / f"timeline_comm_{mode}.png").read_bytes()[:4] == b"\x89PNG", mode
    assert "| mode |" in out  # the markdown table went to stdout
    assert not list(tmp_path.glob("bench_inductor_*")), "the benchmark left its Inductor cache dirs behind"


def _check_bracket(result: dict, rtol: float) -> None:
    """floor never communicated, comm_only all-reduced DDP's own buckets and trained nothing, and every other
    mode has its place in the bracket."""
    import torch

    from benchmarks.workloads import Workload
    from examples.gpt import GPT, GPTConfig

    workload = result["workloads"]["comm"]
    modes = workload["modes"]
    floor, comm = modes["floor"], modes["comm_only"]
    # each floor rank followed its own gradient: the ranks end far apart (with any all-reduce they would match)
    assert floor["rank_param_distance"] > 1000 * rtol, floor["rank_param_distance"]
    assert floor["first_step"]["smoke"]["compile_s"] > 0 and floor["info"]["optimizer_compiled"]
    b = workload["bracket"]
    if comm["status"] == "unavailable":  # torch 2.11 (see `lacking`): the bracket says what it misses
        assert b["comm_only_ms"] is None and [m.split(":")[0] for m in b["missing"]] == ["comm_only unavailable"], b
        assert b["modes"] and all("comm_hidden" not in row for row in b["modes"].values()), b  # over floor only
        return
    assert set(comm["param_checksum"]["update_norm"]) == {0.0}, "comm_only changed the parameters"
    # comm_only's buckets are the ones DDP's reducer really reduced in the eager job (after its rebuild), and
    # they hold every parameter's gradient once
    observed = modes["eager"]["overlap"]["observed_buckets"]
    assert [set(b) for b in comm["info"]["buckets"]] == [set(b) for b in observed]
    model = GPT(GPTConfig(**Workload.from_dict(result["config"]["workloads"][0]).gpt_kwargs()))
    assert sum(comm["info"]["bucket_bytes"]) == sum(4 * p.numel() for p in model.parameters())
    assert comm["info"]["wire_dtype"] == str(torch.float32).removeprefix("torch.")
    assert b["floor_ms"] == floor["step_ms"] > 0 and b["comm_only_ms"] == comm["step_ms"] > 0 and not b["missing"]
    assert set(b["modes"]) == {m for m, a in modes.items() if m not in ("floor", "comm_only") and a["status"] == "ok"}
    for mode, row in b["modes"].items():
        assert row["over_floor_ms"] == pytest.approx(modes[mode]["step_ms"] - floor["step_ms"]), mode
        assert 0.0 <= row["comm_hidden"] <= 1.0, (mode, row)


def _check_metrics(modes: dict) -> None:
    """Every metric of the report is there, for the modes that can have it."""
    from benchmarks.config import BRACKET_MODES, IN_GRAPH_MODES, NO_COMPILE_MODES

    for mode, agg in modes.items():
        first = agg["first_step"]["smoke"]
        compiled = mode not in NO_COMPILE_MODES
        if mode == "ours_step_in_backward":
            # update 1 runs as eager DDP by design (compile_core/in_backward/path.py) and compiles nothing; the
            # model compiles at update 2, a timed step of the smoke run (one warm-up step)
            assert first["compile_s"] == 0 and first["timed_compile_s"] > 0, (mode, first)
        elif mode == "ours_step_in_backward_unfused":
            # the same, but `fused=False` keeps the fused kernel out: update 1 ends with the capture of the
            # update graph (one graph, traced for the backward to splice in)
            assert first["graphs"] == 1 and first["timed_compile_s"] > 0, (mode, first)
        else:
            assert (first["compile_s"] > 0) == compiled and (first["dynamo_s"] > 0) == compiled, (mode, first)
        parts = sum(first[k] for k in ("dynamo_s", "aot_s", "inductor_s", "cpp_compile_s", "other_s"))
        assert parts == pytest.approx(first["wall_s"], rel=0.05, abs=0.05), (mode, first)
        assert all(v and v > 0 for v in agg["steady_peak_rss_mb_per_rank"]), mode
        assert agg["peak_rss_mb"] >= max(agg["steady_peak_rss_mb_per_rank"]) - 1, mode
        if mode in BRACKET_MODES:  # no recorder, no profiler: nothing to overlap
            assert agg["profile"] is None and agg["overlap"] is None, mode
            continue
        prof = agg["profile"]
        assert prof["measured"] and prof["all_reduces"] >= 1 and prof["overlap_percent"] is not None, (mode, prof)
        assert all(p and p > 0 for p in prof["tensor_peak_mb_per_rank"]), (mode, prof)
        # what the job held between steps: DDP's bucket copy of the gradients unless the compiled backward
        # reduces (then released), and no gradient at all once each bucket is updated inside the backward
        states = prof["state_mb_per_rank"]
        assert all(s["parameters"] == pytest.approx(s["gradient_bytes"]) for s in states), (mode, states)
        buckets = [s["ddp_buckets"] / s["gradient_bytes"] for s in states]
        assert all(b < 0.01 if mode in IN_GRAPH_MODES else b == pytest.approx(1.0) for b in buckets), (mode, states)
        if mode in ("ours_step_in_backward", "ours_step_in_backward_unfused"):
            assert all(s["gradients"] == 0.0 for s in states), states
        absolute = [h + p for h, p in zip(prof["held_mb_per_rank"], prof["tensor_peak_mb_per_rank"])]
        assert prof["absolute_peak_mb_per_rank"] == pytest.approx(absolute), (mode, prof)
        hook = agg["overlap"]
        if mode in IN_GRAPH_MODES:
            assert not hook["recorded"] and "in_graph" in hook["reason"], mode
        elif mode in DDP_HOOK_MODES:
            assert hook["recorded"] and hook["overlap_percent"] is not None, mode
    for mode in ("ours_step_in_backward", "ours_step_in_backward_unfused"):
        in_backward = modes[mode]["info"]["optimizer_in_backward"]
        assert in_backward["active"] and in_backward["from_update"] == 2, (mode, in_backward)
    assert modes["ours_in_graph"]["info"]["in_graph_variants"], "no in-graph graph was compiled"


# -- pure parts of the benchmark (no processes; more in tests/single/test_benchmark_*.py) ------------------


def _agg(loss: float, jobs: list[float] | None = None) -> dict:
    return {"status": "ok", "final_loss": loss, "final_loss_jobs": jobs or [loss]}


def test_loss_agreement_flags_the_mode_that_drifted():
    from benchmarks.aggregate import loss_agreement

    modes = {
        "eager": _agg(2.0),
        "ours_compile": _agg(2.0001),
        "torch_ddpopt": _agg(2.5),
        "ours_step": {"status": "unavailable", "error": "ours_step rank 0: missing"},
    }
    result = loss_agreement(modes, rtol=1e-3, atol=1e-4)
    assert result["ok"] is False and result["reference"] == "eager"
    assert [d["mode"] for d in result["disagree"]] == ["torch_ddpopt"]


def test_loss_agreement_flags_a_mode_unstable_across_its_own_jobs():
    from benchmarks.aggregate import loss_agreement

    result = loss_agreement({"eager": _agg(2.0, [2.0, 2.3])}, rtol=1e-3, atol=1e-4)
    assert result["ok"] is False and result["unstable"][0]["mode"] == "eager"


def _fingerprint(deltas: dict) -> dict:
    import torch

    from benchmarks.checksum import param_checksum

    return param_checksum(
        {n: torch.tensor(v) for n, v in deltas.items()}, {n: torch.zeros(len(v)) for n, v in deltas.items()}
    )


def test_checksum_distance_is_relative_to_the_update_and_sees_direction():
    from benchmarks.checksum import checksum_distance

    ref = _fingerprint({"w": [1.0, -2.0, 0.5], "b": [0.1]})
    assert checksum_distance(ref, ref) == 0.0
    assert checksum_distance(_fingerprint({"w": [1.0, -2.0, 0.5 + 1e-7], "b": [0.1]}), ref) < 1e-6
    # same norms, another direction: only the dot product can tell
    swapped = _fingerprint({"w": [-2.0, 1.0, 0.5], "b": [0.1]})
    assert swapped["update_norm"] == pytest.approx(ref["update_norm"])
    assert checksum_distance(swapped, ref) > 0.1
    assert checksum_distance(_fingerprint({"w": [2.0, -4.0, 1.0], "b": [0.2]}), ref) == pytest.approx(1.0, rel=0.5)
    assert checksum_distance(_fingerprint({"v": [1.0, -2.0, 0.5], "b": [0.1]}), ref) == float("inf")


def test_param_agreement_flags_wrong_modes_ranks_and_jobs():
    from benchmarks.aggregate import param_agreement

    good = _fingerprint({"w": [1.0, -2.0, 0.5]})
    local = _fingerprint({"w": [1.3, -1.6, 0.2]})  # a rank that followed its own gradient

    def agg(c, ranks=0.0, jobs=None):
        return {"status": "ok", "param_checksum": c, "rank_param_distance": ranks, "param_checksum_jobs": jobs or [c]}

    modes = {
        "eager": agg(good),
        "ours_compile": agg(good),
        "torch_nosplit": agg(local),
        "ours_step": agg(good, ranks=0.3),
        "torch_ddpopt": agg(good, jobs=[good, local]),
        "torch_python_reducer": {"status": "failed", "error": "x"},
    }
    result = param_agreement(modes, rtol=1e-5)
    assert result["ok"] is False and result["reference"] == "eager"
    assert [d["mode"] for d in result["disagree"]] == ["torch_nosplit"]
    assert [d["mode"] for d in result["ranks_disagree"]] == ["ours_step"]
    assert [d["mode"] for d in result["unstable"]] == ["torch_ddpopt"]
    assert param_agreement({"eager": agg(good), "ours_compile": agg(good)}, rtol=1e-5)["ok"] is True
    # results from before the fingerprint existed are not judged, and say so
    old = param_agreement({"eager": {"status": "ok", "final_loss": 1.0}}, rtol=1e-5)
    assert old["ok"] is None and old["missing"] == ["eager"]


def test_bad_benchmark_config_is_a_value_error_naming_the_value():
    from benchmarks.config import BenchConfig
    from benchmarks.workloads import Workload
    from examples.gpt_config import GPTConfig

    with pytest.raises(ValueError, match="n_heads=5"):
        Workload(name="w", model=GPTConfig(d_model=64, n_heads=5))
    with pytest.raises(ValueError, match="'nope'"):
        BenchConfig(workloads=(Workload(name="w"),), modes=("nope",))
    with pytest.raises(ValueError, match="backend='tvm'"):
        BenchConfig(workloads=(Workload(name="w"),), backend="tvm")
    with pytest.raises(ValueError, match="param_rtol=0"):
        BenchConfig(workloads=(Workload(name="w"),), param_rtol=0)
    # the parameter gate's default follows the backend: eager kernels match tightly, Inductor's less
    assert BenchConfig(workloads=(Workload(name="w"),), backend="aot_eager").param_tolerance() == 1e-5
    assert BenchConfig(workloads=(Workload(name="w"),), backend="inductor").param_tolerance() == 1e-3


def test_rounds_are_interleaved_and_rotated(tmp_path):
    from benchmarks.config import BenchConfig
    from benchmarks.suite import CacheDirs, plan_round
    from benchmarks.workloads import Workload

    cfg = BenchConfig(
        workloads=(Workload(name="w"),),
        modes=("eager", "torch_ddpopt", "ours_compile"),
        scaling=False,
        out_dir=tmp_path,
    )
    caches = CacheDirs(tmp_path)
    try:
        r1 = [(j.mode, j.kind) for j in plan_round(cfg, 1, caches)]
        r2 = [(j.mode, j.kind) for j in plan_round(cfg, 2, caches)]
        assert (caches.root.stat().st_mode & 0o777) == 0o700  # private cache root
    finally:
        caches.cleanup()
    assert r1 == [
        ("eager", "warm"),
        ("torch_ddpopt", "cold"),
        ("torch_ddpopt", "warm"),
        ("ours_compile", "cold"),
        ("ours_compile", "warm"),
    ]
    # round 2 starts one mode later and reuses round 1's compile cache (warm jobs only)
    assert r2 == [("torch_ddpopt", "warm"), ("ours_compile", "warm"), ("eager", "warm")]
