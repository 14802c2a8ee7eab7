"""Launch benchmark jobs: every job is a fresh set of rank processes (fresh Dynamo/Inductor state).

Each rank runs `python -m benchmarks.worker` with one thread; a job has a wall-clock timeout, and when one
rank fails or hangs the others are killed and the failure names the mode and the rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.link import LinkError, LinkShape, ShapedNamespace
from benchmarks.rank_start import ForkedRank, RankServer
from launch.net import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 10.0
"""How long the other ranks get to finish after one rank failed (they are usually stuck in a collective)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One job: a mode on a workload with a number of ranks."""

    job_id: str
    """Unique name; also the job's folder under out_dir/jobs."""
    kind: str
    """cold (fresh Inductor cache), warm (reused cache), single (1 rank), overlap (recorder attached) or smoke."""
    round: int
    """1-based round number."""
    mode: str
    """Benchmark mode."""
    workload: str
    """Workload name."""
    world_size: int
    """Ranks in this job."""
    cache_dir: str
    """TORCHINDUCTOR_CACHE_DIR for every rank of the job."""
    worker: dict[str, Any]
    """Everything the worker reads (see benchmarks.worker.run)."""


def _rank_env(spec: JobSpec, rank: int, port: int, *, shaped: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if shaped:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the namespace has nothing else; say so rather than let gloo guess
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=spec.cache_dir,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
    )
    # By default one compile thread per rank: no worker pool competing with the other rank for the cores.
    # None (--compile-threads torch) leaves torch's own choice, the CPU count, as a user's job has it.
    threads = spec.worker.get("compile_threads", 1)
    if threads is None:
        env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    else:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)
    return env


def _kill_group(proc: subprocess.Popen | ForkedRank) -> None:
    """Kill a rank we started and whatever it spawned (it leads its own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # a forked rank killed before it made its group
            proc.kill()
    proc.wait(timeout=10)


def _tail(path: Path, lines: int = 6) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def run_job(
    spec: JobSpec,
    jobs_dir: Path,
    *,
    timeout_s: float,
    link: LinkShape | None = None,
    ranks: RankServer | None = None,
) -> dict[str, Any]:
    """Run one job to completion; return the per-rank results plus a job-level status.

    With `link`, the job's ranks share a network namespace of their own with a shaped loopback
    (benchmarks/link.py); a namespace that cannot be made fails the job, not the run. With `ranks`, they are
    forked from that server where they can be (Note [Forked benchmark ranks]), else started fresh.
    """
    job_dir = jobs_dir / spec.job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    spec_path = job_dir / "spec.json"
    spec_path.write_text(json.dumps(spec.worker, indent=1))
    with contextlib.ExitStack() as stack:
        prefix: list[str] = []
        if link is not None:
            try:
                prefix = stack.enter_context(ShapedNamespace(link)).prefix()
            except LinkError as err:
                return _link_failed(spec, job_dir, err)
        return _run_ranks(spec, job_dir, spec_path, prefix=prefix, timeout_s=timeout_s, ranks=ranks)


WORKER = ("-m", "benchmarks.worker")
"""How a rank is started: `python -m benchmarks.worker SPEC.json`."""


def start_job(
    spec: JobSpec, jobs_dir: Path, *, worker: tuple[str, ...] = WORKER
) -> tuple[Path, list[subprocess.Popen]]:
    """Start a job's ranks and return at once (its folder and processes): for a caller that runs several jobs
    side by side (benchmarks/gpu.py) and ends each with `finish_job`. No shaped link. `worker`: the arguments
    after the interpreter (tests pass a stand-in script)."""
    job_dir = jobs_dir / spec.job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    spec_path = job_dir / "spec.json"
    spec_path.write_text(json.dumps(spec.worker, indent=1))
    return job_dir, _start_ranks(spec, job_dir, spec_path, prefix=[], worker=worker)


def finish_job(
    spec: JobSpec, job_dir: Path, procs: list[subprocess.Popen], *, timed_out: bool, timeout_s: float, wall_s: float
) -> dict[str, Any]:
    """Kill whatever of a started job still runs and collect its result (as `run_job` returns it)."""
    for p in procs:
        _kill_group(p)
    return _collect(spec, job_dir, procs, timed_out=timed_out, timeout_s=timeout_s, wall_s=wall_s)


def _start_ranks(
    spec: JobSpec,
    job_dir: Path,
    spec_path: Path,
    *,
    prefix: list[str],
    worker: tuple[str, ...] = WORKER,
    ranks: RankServer | None = None,
) -> list[subprocess.Popen | ForkedRank]:
    port = free_port()  # a fresh namespace has every port free: the host's pick is as good as any there
    procs: list[subprocess.Popen | ForkedRank] = []
    for rank in range(spec.world_size):
        env = _rank_env(spec, rank, port, shaped=bool(prefix))
        log_path = job_dir / f"rank{rank}.log"
        forked = None
        if ranks is not None and not prefix and worker == WORKER:
            forked = ranks.start(spec_path, env=env, log_path=log_path, cwd=REPO_ROOT)
        if forked is not None:
            procs.append(forked)
            continue
        with open(log_path, "w") as log:
            procs.append(
                subprocess.Popen(
                    [*prefix, sys.executable, *worker, str(spec_path)],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return procs


def _run_ranks(
    spec: JobSpec, job_dir: Path, spec_path: Path, *, prefix: list[str], timeout_s: float, ranks: RankServer | None
):
    procs = _start_ranks(spec, job_dir, spec_path, prefix=prefix, ranks=ranks)
    started = time.monotonic()
    deadline = started + timeout_s
    failed_at: float | None = None
    timed_out = False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            timed_out = now > deadline
            break
        time.sleep(0.2)
    for p in procs:
        _kill_group(p)
    res = _collect(spec, job_dir, procs, timed_out=timed_out, timeout_s=timeout_s, wall_s=time.monotonic() - started)
    res["forked_ranks"] = sum(isinstance(p, ForkedRank) for p in procs)
    return res


def _link_failed(spec: JobSpec, job_dir: Path, err: LinkError) -> dict[str, Any]:
    why = f"{spec.mode}: the shaped link (--link-gbit) could not be set up for this job: {err}"
    return {
        "job_id": spec.job_id,
        "kind": spec.kind,
        "round": spec.round,
        "mode": spec.mode,
        "workload": spec.workload,
        "world_size": spec.world_size,
        "ok": False,
        "unavailable": False,
        "errors": [why],
        "wall_s": 0.0,
        "ranks": [],
        "log_dir": str(job_dir),
    }


def _collect(spec: JobSpec, job_dir: Path, procs, *, timed_out: bool, timeout_s: float, wall_s: float):
    ranks: list[dict[str, Any]] = []
    errors: list[str] = []
    unavailable = False
    for rank, proc in enumerate(procs):
        path = job_dir / f"rank{rank}.json"
        if path.exists():
            res = json.loads(path.read_text())
        elif timed_out:
            res = {"ok": False, "rank": rank, "error": f"timed out after {timeout_s:.0f}s"}
        else:
            res = {
                "ok": False,
                "rank": rank,
                "error": f"exited with code {proc.returncode} without a result; "
                f"log tail: {_tail(job_dir / f'rank{rank}.log')}",
            }
        ranks.append(res)
        if not res.get("ok"):
            unavailable = unavailable or bool(res.get("unavailable"))
            errors.append(f"{spec.mode} rank {rank}: {res.get('error', 'unknown error')}")
    return {
        "job_id": spec.job_id,
        "kind": spec.kind,
        "round": spec.round,
        "mode": spec.mode,
        "workload": spec.workload,
        "world_size": spec.world_size,
        "ok": not errors,
        "unavailable": unavailable,
        "errors": errors,
        "wall_s": wall_s,
        "ranks": ranks,
        "log_dir": str(job_dir),
    }
