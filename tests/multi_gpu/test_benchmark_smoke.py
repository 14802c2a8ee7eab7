"""CI smoke of `python -m benchmarks --smoke`: every mode runs (or says why not) and finished modes agree.

No timing is asserted: the smoke preset makes no timing claims.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ("eager", "torch_ddpopt", "torch_nosplit", "torch_python_reducer", "ours_compile", "ours_step")


@pytest.mark.multi_gpu
@pytest.mark.timeout(300)
def test_smoke_benchmark_covers_every_mode_and_losses_agree(tmp_path):
    # one workload keeps this near a minute on 2 cores; aot_eager is the smoke default backend
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--workloads", "comm", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    result = json.loads((tmp_path / "results.json").read_text())
    assert result["config"]["backend"] == "aot_eager"
    modes = result["workloads"]["comm"]["modes"]
    assert set(modes) == set(MODES)
    for mode, agg in modes.items():
        # every mode runs on torch 2.13 + gloo; a failure must name the mode and the rank
        assert agg["status"] == "ok", f"{mode}: {agg.get('error')}"
    finished = {m: a["final_loss"] for m, a in modes.items() if a["status"] == "ok"}
    assert "eager" in finished, modes["eager"].get("error")
    agreement = result["workloads"]["comm"]["loss_agreement"]
    assert agreement["ok"], agreement
    for mode, loss in finished.items():
        assert loss == pytest.approx(finished["eager"], rel=1e-3), mode
    # every 2-step job ran exactly 2 steps
    for job in result["jobs"]:
        for rank in job["ranks"]:
            if rank.get("ok"):
                assert len(rank["losses"]) == 2, job["job_id"]

    assert (tmp_path / "step_ms.png").read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "BENCHMARKS.md").read_text()
    assert "python -m benchmarks --smoke" in report and "torch " in report
    assert "| mode |" in proc.stdout  # the markdown table went to stdout


# -- pure parts of the benchmark (no processes) ----------------------------------------------------------


def _agg(loss: float, jobs: list[float] | None = None) -> dict:
    return {"status": "ok", "final_loss": loss, "final_loss_jobs": jobs or [loss]}


def test_loss_agreement_flags_the_mode_that_drifted():
    from benchmarks.report import loss_agreement

    modes = {"eager": _agg(2.0), "ours_compile": _agg(2.0001), "torch_ddpopt": _agg(2.5),
             "ours_step": {"status": "unavailable", "error": "ours_step rank 0: missing"}}
    result = loss_agreement(modes, rtol=1e-3, atol=1e-4)
    assert result["ok"] is False and result["reference"] == "eager"
    assert [d["mode"] for d in result["disagree"]] == ["torch_ddpopt"]


def test_loss_agreement_flags_a_mode_unstable_across_its_own_jobs():
    from benchmarks.report import loss_agreement

    result = loss_agreement({"eager": _agg(2.0, [2.0, 2.3])}, rtol=1e-3, atol=1e-4)
    assert result["ok"] is False and result["unstable"][0]["mode"] == "eager"


def test_bad_benchmark_config_is_a_value_error_naming_the_value():
    from benchmarks.config import BenchConfig, Workload

    with pytest.raises(ValueError, match="n_heads=5"):
        Workload(name="w", d_model=64, n_heads=5)
    with pytest.raises(ValueError, match="'nope'"):
        BenchConfig(workloads=(Workload(name="w"),), modes=("nope",))
    with pytest.raises(ValueError, match="backend='tvm'"):
        BenchConfig(workloads=(Workload(name="w"),), backend="tvm")


def test_rounds_are_interleaved_and_rotated(tmp_path):
    from benchmarks.config import BenchConfig, Workload
    from benchmarks.suite import CacheDirs, plan_round

    cfg = BenchConfig(workloads=(Workload(name="w"),), modes=("eager", "torch_ddpopt", "ours_compile"),
                      scaling=False, out_dir=tmp_path)
    caches = CacheDirs(tmp_path)
    try:
        r1 = [(j.mode, j.kind) for j in plan_round(cfg, 1, caches)]
        r2 = [(j.mode, j.kind) for j in plan_round(cfg, 2, caches)]
        assert (caches.root.stat().st_mode & 0o777) == 0o700  # private cache root
    finally:
        caches.cleanup()
    assert r1 == [("eager", "warm"), ("torch_ddpopt", "cold"), ("torch_ddpopt", "warm"),
                  ("ours_compile", "cold"), ("ours_compile", "warm")]
    # round 2 starts one mode later and reuses round 1's compile cache (warm jobs only)
    assert r2 == [("torch_ddpopt", "warm"), ("ours_compile", "warm"), ("eager", "warm")]
