"""Plan and run every job of a benchmark, round by round, so machine drift hits all modes alike."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks.config import BRACKET_MODES, NO_COMPILE_MODES, BenchConfig
from benchmarks.rank_start import RankServer
from benchmarks.runner import JobSpec, run_job
from benchmarks.workloads import Workload

COMPILED_KINDS = ("cold", "warm")


def _worker_spec(
    cfg: BenchConfig, w: Workload, mode: str, *, steps: int, record_overlap: bool, timeline_png: Path | None
) -> dict[str, Any]:
    # overlap is measured twice where it can be: the DDP comm-hook recorder (DDP modes) and the profiler
    # (every mode, on extra steps after the timed ones: benchmarks/profile_overlap.py)
    return {
        "mode": mode,
        "workload": w.name,
        "gpt": w.gpt_kwargs(),
        "batch": w.batch,
        "seq_len": w.seq_len,
        "warmup": cfg.warmup,
        "steps": steps,
        "backend": cfg.backend,
        "bucket_cap_mb": w.cap_mb(cfg.bucket_cap_mb),
        "optimizer": cfg.optimizer,
        "optimizer_kwargs": cfg.optimizer_kwargs(),
        "seed": cfg.seed,
        "timeout_s": cfg.timeout_s,
        "record_overlap": record_overlap,
        "profile_steps": cfg.profile_steps if record_overlap else 0,
        "timeline_png": None if timeline_png is None else str(timeline_png),
        "plot": cfg.plot,
        "comm_hook": cfg.comm_hook,
        "reduce_dtype": cfg.reduce_dtype,
        "compile_mode": cfg.compile_mode,
        "autocast": cfg.autocast,
        "nested_regions": cfg.nested_regions,
        "compile_threads": cfg.compile_threads,  # read by the runner: it sets each rank's environment
        "link_gbit": cfg.link_gbit,  # recorded only: the runner shapes the link (benchmarks/link.py)
    }


def _rotated(modes: tuple[str, ...], round_no: int) -> list[str]:
    # Rotating the start each round means no mode always runs first (cold page cache, cooler CPU).
    k = (round_no - 1) % len(modes)
    return list(modes[k:] + modes[:k])


class CacheDirs:
    """Private (0700) Inductor cache dirs, one per workload/mode/round; removed at the end."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="bench_inductor_", dir=root))  # mkdtemp: mode 0700
        self._dirs: dict[tuple[str, str], str] = {}

    def fresh(self, workload: str, mode: str, round_no: int) -> str:
        path = tempfile.mkdtemp(prefix=f"{workload}_{mode}_r{round_no}_", dir=self.root)
        self._dirs[(workload, mode)] = path
        return path

    def current(self, workload: str, mode: str) -> str:
        return self._dirs[(workload, mode)]

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def plan_round(cfg: BenchConfig, round_no: int, caches: CacheDirs) -> Iterator[JobSpec]:
    """Jobs of one round: every workload, every mode (rotated order), cold then warm then 1-rank."""
    for w in cfg.workloads:
        for mode in _rotated(cfg.modes, round_no):
            yield from _mode_jobs(cfg, w, mode, round_no, caches)


def _mode_jobs(cfg: BenchConfig, w: Workload, mode: str, round_no: int, caches: CacheDirs) -> Iterator[JobSpec]:
    reuse = cfg.cold_warm and round_no > 1 and mode not in NO_COMPILE_MODES
    # With cold/warm on, the cold compile is measured once (round 1); later rounds reuse that cache and
    # add warm samples. That keeps a full run affordable: the cold Inductor compile dominates job time.
    cache = caches.current(w.name, mode) if reuse else caches.fresh(w.name, mode, round_no)
    if cfg.preset == "smoke":
        kinds = ["smoke"]
    elif mode in NO_COMPILE_MODES or reuse:
        kinds = ["warm"]  # eager and comm_only compile nothing: one 2-rank job is all there is to time
    else:
        kinds = list(COMPILED_KINDS) if cfg.cold_warm else ["cold"]  # the cache dir is fresh: cold
    # the bracket modes get no 1-rank or overlap jobs: floor never communicates, comm_only has no backward
    bracket = mode in BRACKET_MODES
    if cfg.scaling and w.scaling and cfg.world_size > 1 and cfg.preset != "smoke" and round_no == 1 and not bracket:
        kinds.append("single")  # the 1-rank reference: once, in round 1
    for kind in kinds:
        in_job_recorder = cfg.overlap and cfg.overlap_in_main_job and w.overlap and kind != "single" and not bracket
        yield JobSpec(
            job_id=f"r{round_no}_{w.name}_{mode}_{kind}",
            kind=kind,
            round=round_no,
            mode=mode,
            workload=w.name,
            world_size=1 if kind == "single" else cfg.world_size,
            cache_dir=cache,
            worker=_worker_spec(
                cfg,
                w,
                mode,
                steps=cfg.steps,
                record_overlap=in_job_recorder,
                timeline_png=cfg.out_dir / f"timeline_{w.name}_{mode}.png" if in_job_recorder else None,
            ),
        )


def plan_overlap(cfg: BenchConfig, caches: CacheDirs) -> Iterator[JobSpec]:
    """One extra job per mode with the recorder and the profiler attached (warm cache; its step times are not
    used)."""
    if not cfg.overlap or cfg.overlap_in_main_job or cfg.world_size < 2:
        return
    for w in (w for w in cfg.workloads if w.overlap):
        for mode in (m for m in cfg.modes if m not in BRACKET_MODES):
            yield JobSpec(
                job_id=f"overlap_{w.name}_{mode}",
                kind="overlap",
                round=cfg.rounds,
                mode=mode,
                workload=w.name,
                world_size=cfg.world_size,
                cache_dir=caches.current(w.name, mode),
                worker=_worker_spec(
                    cfg,
                    w,
                    mode,
                    steps=max(3, min(cfg.steps, 5)),
                    record_overlap=True,
                    timeline_png=cfg.out_dir / f"timeline_{w.name}_{mode}.png",
                ),
            )


def run_suite(cfg: BenchConfig, *, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every job; return one result dict per job (see benchmarks.runner.run_job)."""
    jobs_dir = cfg.out_dir / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    caches = CacheDirs()
    link = cfg.link()
    if link is not None:
        log(f"link: {link.describe()}")
    results: list[dict[str, Any]] = []
    dead: dict[tuple[str, ...], str] = {}  # (workload, mode[, kind]) -> why later jobs are skipped
    ranks = RankServer()
    try:
        rounds = [plan_round(cfg, r, caches) for r in range(1, cfg.rounds + 1)]
        for spec in (s for plan in rounds + [plan_overlap(cfg, caches)] for s in plan):
            key = (spec.workload, spec.mode)
            why = dead.get(key) or dead.get(key + (spec.kind,))
            if why:
                results.append(_skipped(spec, why))
                continue
            t0 = time.monotonic()
            res = run_job(spec, jobs_dir, timeout_s=cfg.timeout_s, link=link, ranks=ranks)
            results.append(res)
            status = "ok" if res["ok"] else ("UNAVAILABLE" if res["unavailable"] else "FAILED")
            fresh = res.get("forked_ranks", spec.world_size) < spec.world_size and not link
            log(
                f"[{spec.job_id}] {status} in {time.monotonic() - t0:.1f}s"
                + (f" (ranks started fresh: {ranks.fresh_why})" if fresh else "")
                + ("" if res["ok"] else f": {res['errors'][0][:300]}")
            )
            if not res["ok"]:
                # the same mode would fail the same way again: don't burn the time budget on it. A failed
                # 1-rank job only stops the other 1-rank jobs of that mode.
                dead[key + (spec.kind,) if spec.kind == "single" else key] = res["errors"][0]
    finally:
        ranks.close()
        caches.cleanup()
    return results


def _skipped(spec: JobSpec, why: str) -> dict[str, Any]:
    return {
        "job_id": spec.job_id,
        "kind": spec.kind,
        "round": spec.round,
        "mode": spec.mode,
        "workload": spec.workload,
        "world_size": spec.world_size,
        "ok": False,
        "unavailable": False,
        "skipped": True,
        "errors": [f"skipped after an earlier failure: {why}"],
        "wall_s": 0.0,
        "ranks": [],
    }
