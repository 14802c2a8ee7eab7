"""The benchmark's forked ranks (Note [Forked benchmark ranks], benchmarks/rank_start.py): a forked rank runs the
worker with the environment the runner made for it, and a job that wants other import-time settings than the
server has gets fresh interpreters. In a subprocess: pytest's worker may run the tests' own fork server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from benchmarks.rank_start import RankServer

    out = Path(sys.argv[1])
    spec = out / "spec.json"
    spec.write_text(json.dumps({"mode": "no_such_mode"}))  # the worker fails at once, writing rankN.json
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(out / "cache")}
    report = {}
    with RankServer() as server:
        rank = server.start(spec, env=env, log_path=out / "rank1.log", cwd=Path.cwd())
        report["forked"] = rank is not None
        report["code"] = rank.wait(timeout=120) if rank is not None else None
        # another job of the run: its own RANK and cache dir fork; another thread count does not
        other_rank = {**env, "RANK": "0", "TORCHINDUCTOR_CACHE_DIR": str(out / "cache0")}
        other_threads = {**env, "OMP_NUM_THREADS": "2"}
        report["other_rank_forked"] = server.start(spec, env=other_rank, log_path=out / "rank0.log",
                                                   cwd=Path.cwd()).wait(timeout=120) is not None
        report["other_threads_forked"] = server.start(spec, env=other_threads, log_path=out / "x.log",
                                                      cwd=Path.cwd()) is not None
        report["why"] = server.fresh_why
        report["forked_total"] = server.forked
    print(json.dumps(report))
    """
)


@pytest.mark.timeout(240)
def test_a_forked_rank_runs_the_worker_in_its_own_environment_and_other_settings_start_fresh(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "forked": True,
        "code": 1,  # the worker's exit code for a failed job
        "other_rank_forked": True,
        "other_threads_forked": False,
        "why": "the job's environment differs from the rank server's in OMP_NUM_THREADS",
        "forked_total": 2,
    }
    # the rank read RANK=1 from the environment it was given, and named the mode in its result
    result = json.loads((tmp_path / "rank1.json").read_text())
    assert result["ok"] is False and result["rank"] == 1 and result["mode"] == "no_such_mode"
    assert json.loads((tmp_path / "rank0.json").read_text())["rank"] == 0
    assert result["error"].startswith("KeyError") and "benchmarks/worker.py" in result["traceback"], result


def test_fresh_ranks_are_asked_for_through_the_environment(tmp_path, monkeypatch):
    from benchmarks.rank_start import FRESH_RANKS_ENV, RankServer

    monkeypatch.setenv(FRESH_RANKS_ENV, "1")
    with RankServer() as server:
        assert server.start(tmp_path / "spec.json", env={}, log_path=tmp_path / "log", cwd=tmp_path) is None
        assert server.forked == 0 and server.fresh_why == f"{FRESH_RANKS_ENV}=1"
