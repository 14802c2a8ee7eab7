"""The three phases of the GPU benchmark (`python -m benchmarks.gpu`, benchmarks/gpu.py) under one wall-clock
budget: A, every job's cold compile side by side up to its gate; B, each ready job let through alone for its
timed and profiled steps; C, warm start-ups on the caches phase A filled, while time is left.

benchmarks/gpu.py builds the jobs (`Entry`, one per mode and precision) from its command line and writes
what `run_phases` returns.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.config import BenchConfig
from benchmarks.gate import Gate
from benchmarks.runner import WORKER, JobSpec, finish_job, start_job

MARGIN_S = 15.0
"""Kept back at the end of the budget for collecting results and writing the outputs."""

HOLD_ENV = "GPU_BENCH_HOLD"
"""A file path: while that file exists, phase B waits before its first timed step (at most `HOLD_MAX_S`). What
runs beside phase A's compiles on the same GPU (benchmarks/gpu_check.sh's probe and update kernels) removes it
when it ends, so that no timed step shares the device or the host with it."""
HOLD_MAX_S = 90.0


@dataclasses.dataclass
class Running:
    """A started job: what it runs, its folder, processes and gate, and what the gate said on arrival."""

    entry: Entry
    spec: JobSpec
    job_dir: Path
    procs: list
    gate: Gate
    started: float
    ready: dict[str, Any] | None = None

    def exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def finish(self, *, timed_out: bool, timeout_s: float) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        res = finish_job(self.spec, self.job_dir, self.procs, timed_out=timed_out, timeout_s=timeout_s, wall_s=wall)
        res["tag"] = self.entry.tag
        res["ready"] = self.ready
        return res


class Budget:
    """The run's wall clock: a deadline, and one line per phase of what it may spend and what it spent."""

    def __init__(self, seconds: float, log: Callable[[str], None], *, margin_s: float = MARGIN_S) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + seconds
        self.margin_s = margin_s
        self.log = log
        self.phases: list[dict[str, Any]] = []

    def left(self) -> float:
        """Seconds left for work: the deadline less the margin kept for writing the outputs."""
        return self.deadline - self.margin_s - time.monotonic()

    def at(self) -> float:
        return time.monotonic() - self.t0

    def phase(self, name: str, budget_s: float, note: str) -> dict[str, Any]:
        entry = {"name": name, "budget_s": max(0.0, budget_s), "start": self.at(), "spent_s": 0.0, "note": note}
        self.phases.append(entry)
        self.log(f"budget: phase {name} may spend {entry['budget_s']:.0f} s (at {entry['start']:.0f} s; {note})")
        return entry

    def done(self, entry: dict[str, Any], summary: str) -> None:
        entry["spent_s"] = self.at() - entry["start"]
        entry["summary"] = summary
        self.log(f"budget: phase {entry['name']} spent {entry['spent_s']:.0f} s: {summary}; {self.left():.0f} s left")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One job of the run: a mode at a precision (`tag`), with that precision's config."""

    tag: str
    mode: str
    cfg: BenchConfig
    foreach: bool = False
    host_profile_steps: int = 0
    """Steps after the timed ones whose host Python runs under cProfile (before the kernel profile)."""
    back_to_back_steps: int = 0
    """Steps right after the timed ones run with no sync between them, timed together (ms per step)."""

    @property
    def label(self) -> str:
        return f"{self.tag}/{self.mode}"

    def spec(self, kind: str, cache: str, gate: Path | None) -> JobSpec:
        """The job: `cold` compiles (2 warm-up steps), waits at `gate`, then warms up, is timed and profiled
        (kernels, then memory) alone; `warm` reads the start-up on a filled cache (2 steps to read, 1 to time,
        nothing profiled); `warm_profiled` is a second warm start-up with its first two steps under cProfile."""
        from benchmarks.suite import _worker_spec

        cfg, w = self.cfg, self.cfg.workloads[0]
        steps = cfg.steps if kind == "cold" else 1
        worker = _worker_spec(cfg, w, self.mode, steps=steps, record_overlap=False, timeline_png=None)
        if kind == "cold":
            # the gate after step 2 (start-up is read to there); the other warm-up steps run alone, after it,
            # and refill the allocator's cache that the wait gave back
            worker.update(profile_steps=cfg.profile_steps, kernel_profile=True, gate_dir=str(gate), gate_after=2)
            worker["host_profile_steps"] = self.host_profile_steps
            worker["back_to_back_steps"] = self.back_to_back_steps
            # and one step more under the memory profiler: its peak by kind (benchmarks/memory_peak.py)
            worker["memory_profile_steps"] = 1
        else:  # warm, or warm_profiled: the same under cProfile (where a warm start-up spends its time)
            worker.update(warmup=2, profile_steps=0, startup_profile=kind == "warm_profiled")
        if self.foreach:
            worker["optimizer_kwargs"] = {**worker["optimizer_kwargs"], "foreach": True}
        return JobSpec(
            job_id=f"{self.tag}_{self.mode}_{kind}",
            kind=kind,
            round=1,
            mode=self.mode,
            workload=w.name,
            world_size=1,
            cache_dir=cache,
            worker=worker,
        )


def run_phases(
    entries: list[Entry],
    *,
    parallel: int,
    reserve_s: float,
    warm: list[Entry],
    budget: Budget,
    work: Path,
    worker: tuple[str, ...] = WORKER,
    profile_warm: bool = False,
) -> list[dict[str, Any]]:
    """Phases A and B per group of `parallel` entries, then C for `warm` (each followed by a `warm_profiled`
    job with `profile_warm`); one result per job (each with its `tag`), failures included."""
    jobs_dir = work / "jobs"
    caches: dict[str, str] = {}
    results: list[dict[str, Any]] = []
    groups = [entries[i : i + parallel] for i in range(0, len(entries), parallel)]
    for g, group in enumerate(groups):
        later = sum(len(x) for x in groups[g:])  # this group's and every later group's timed steps
        allowed = budget.left() - reserve_s * later
        if allowed < reserve_s:
            budget.log(f"phase A: no time left to start {', '.join(e.label for e in group)} (and later groups)")
            break
        running = {}
        for e in group:
            caches[e.label] = tempfile.mkdtemp(prefix=f"inductor_{e.tag}_{e.mode}_", dir=work)
            gate = work / "gates" / f"{e.tag}_{e.mode}"
            spec = e.spec("cold", caches[e.label], gate)
            job_dir, procs = start_job(spec, jobs_dir, worker=worker)
            running[e.label] = Running(e, spec, job_dir, procs, Gate(gate), started=time.monotonic())
        results += _phase_a(running, budget, allowed)
        results += _phase_b(running, budget, reserve_s)
    entry = budget.phase("C", budget.left(), f"warm start-up, alone, of {', '.join(e.label for e in warm) or '-'}")
    done = 0
    for e in warm:
        cold = next((r for r in results if r["tag"] == e.tag and r["mode"] == e.mode), None)
        if cold is None or not cold["ok"]:
            continue
        if budget.left() < reserve_s * 2:
            budget.log(f"phase C: no time left for {e.label} and after")
            break
        for kind in ("warm", "warm_profiled") if profile_warm else ("warm",):
            if kind != "warm" and budget.left() < reserve_s * 2:
                budget.log(f"phase C: no time left for the profiled warm start-up of {e.label}")
                break
            spec = e.spec(kind, caches[e.label], None)
            job_dir, procs = start_job(spec, jobs_dir, worker=worker)
            job = Running(e, spec, job_dir, procs, Gate(work / "gates" / "unused"), started=time.monotonic())
            left = budget.left()
            res = job.finish(timed_out=not _wait(job, left), timeout_s=left)
            results.append(res)
            done += 1
            two = res["ranks"][0].get("two_steps_s") if res["ok"] else None
            said = f"to end of step 2 {two:.1f} s" if res["ok"] else res["errors"][0][:300]
            budget.log(f"[{kind}] {e.label}: {said}")
    budget.done(entry, f"{done} warm start-up(s)")
    return results


def _phase_a(running: dict[str, Running], budget: Budget, allowed: float) -> list[dict[str, Any]]:
    n = len(running)
    entry = budget.phase("A", allowed, f"{n} cold compile(s) side by side: {', '.join(running)}")
    end = time.monotonic() + allowed
    out = []
    pending = dict(running)
    while pending and time.monotonic() < end:
        for label, job in list(pending.items()):
            job.ready = job.gate.ready()
            if job.ready is not None:
                job.ready["cold_parallel"] = n
                budget.log(
                    f"[cold] {label} ready at {budget.at():.0f} s: step 1 {job.ready['first_step_s']:.1f} s, "
                    f"to end of step 2 {job.ready['two_steps_s']:.1f} s ({n} side by side)"
                )
                del pending[label]
            elif job.exited():
                res = job.finish(timed_out=False, timeout_s=allowed)
                budget.log(f"[cold] {label} FAILED: {res['errors'][0][:300] if res['errors'] else 'no result'}")
                out.append(res)
                del pending[label]
        time.sleep(0.2)
    for label, job in pending.items():  # not ready in time: end it before any timed step runs
        res = job.finish(timed_out=True, timeout_s=allowed)
        res["errors"] = [f"{job.entry.mode}: cold warm-up not finished within phase A's {allowed:.0f} s (killed)"]
        budget.log(f"[cold] {label} FAILED: not ready within {allowed:.0f} s")
        out.append(res)
    for res in out:
        res["cold_parallel"] = n
    ready = sum(j.ready is not None for j in running.values())
    budget.done(entry, f"{ready}/{n} ready")
    return out


def _wait_for_hold(budget: Budget) -> None:
    """Before the first timed step: wait while the `HOLD_ENV` file exists (work beside phase A still running)."""
    hold = os.environ.get(HOLD_ENV)
    if not hold:
        return
    if not os.path.exists(hold):
        budget.log(f"phase B: the work beside phase A had ended ({hold} gone)")
        return
    t0 = time.monotonic()
    while os.path.exists(hold) and time.monotonic() - t0 < HOLD_MAX_S and budget.left() > 60:
        time.sleep(0.5)
    waited = time.monotonic() - t0
    if os.path.exists(hold):
        budget.log(f"phase B: {hold} still there after {waited:.0f} s: timing beside the work that holds it")
    else:
        budget.log(f"phase B: waited {waited:.0f} s for the work beside phase A to end ({hold})")


def _phase_b(running: dict[str, Running], budget: Budget, reserve_s: float) -> list[dict[str, Any]]:
    _wait_for_hold(budget)
    ready = {label: j for label, j in running.items() if j.ready is not None}
    entry = budget.phase("B", budget.left(), f"timed steps of {len(ready)} job(s), one at a time")
    out = []
    for label, job in ready.items():
        left = budget.left()
        if left < reserve_s / 2:
            job.gate.stop()
            _wait(job, 10.0)
            res = job.finish(timed_out=False, timeout_s=left)
            budget.log(f"[timed] {label}: not timed, {left:.0f} s left")
        else:
            t0 = time.monotonic()
            job.gate.release()
            exited = _wait(job, left)
            res = job.finish(timed_out=not exited, timeout_s=left)
            spent = time.monotonic() - t0
            if res["ok"]:
                r0 = res["ranks"][0]
                budget.log(f"[timed] {label}: median step {r0['median_step_ms']:.1f} ms ({spent:.0f} s)")
            else:
                budget.log(f"[timed] {label} FAILED in {spent:.0f} s: {res['errors'][0][:300]}")
        res["cold_parallel"] = job.ready.get("cold_parallel")
        out.append(res)
    budget.done(entry, f"{sum(r['ok'] for r in out)}/{len(ready)} timed")
    return out


def _wait(job: Running, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if job.exited():
            return True
        time.sleep(0.05)
    return job.exited()
