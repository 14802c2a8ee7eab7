"""Turn job results into per-mode numbers: step time, first-step breakdown, memory, overlap, agreement gates.

Every function here is pure (dicts in, dicts out) except `machine_description`; results.json of older runs
(no breakdown, no profiler, no steady-state peak) aggregate too, with those fields left out.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from benchmarks.bracket import bracket
from benchmarks.checksum import checksum_distance
from benchmarks.config import BRACKET_MODES, IN_GRAPH_MODES, MODE_HELP, VARIANT_MODES, BenchConfig
from benchmarks.memory import gradient_savings, tensor_memory

TIMING_KINDS = ("cold", "warm", "smoke")
"""Jobs whose 2-rank step times, losses and memory enter the table (overlap jobs carry a recorder)."""

PEERS: dict[str, str] = {
    "ours_compile": "torch_ddpopt",
    "ours_in_graph": "torch_ddpopt",
    "ours_step": "torch_savvy",
    "ours_step_in_graph": "torch_savvy",
    "ours_step_in_graph_auto": "torch_savvy",
    "ours_step_in_backward": "torch_savvy",
    **{mode: "torch_savvy" for mode in VARIANT_MODES},
}
"""Each of our modes and the PyTorch-only mode its compile-time claims are made against: compile_core.compile
against torch.compile(ddp_model) (DDPOptimizer), train_step against torch_savvy (model and optimizer.step
compiled)."""


def _job_step_ms(job: dict[str, Any]) -> float:
    # the slowest rank sets the pace of a synchronous data-parallel step
    return max(r["median_step_ms"] for r in job["ranks"])


def _job_first_step_s(job: dict[str, Any]) -> float:
    return max(r["first_step_s"] for r in job["ranks"])


def _job_two_steps_s(job: dict[str, Any]) -> float | None:
    """Seconds to the end of step 2 on the slowest rank (None: results without it, or a 1-step job)."""
    values = [r.get("two_steps_s") for r in job["ranks"]]
    return None if any(v is None for v in values) else max(values)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _per_rank_max(jobs: list[dict[str, Any]], key: str) -> list[float | None]:
    """Per rank, the largest value of `key` over the jobs (None where no job reported it)."""
    out = []
    for r in range(len(jobs[0]["ranks"])):
        values = [j["ranks"][r].get(key) for j in jobs if r < len(j["ranks"])]
        values = [v for v in values if v is not None]
        out.append(max(values) if values else None)
    return out


def first_step_breakdown(jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first-step breakdown of the slowest rank of the median job (by first-step wall time).

    One real job's numbers rather than per-field medians, so the phases add up to its wall time.
    """
    rows = []
    for job in jobs:
        rank = max(range(len(job["ranks"])), key=lambda r: job["ranks"][r]["first_step_s"])
        compile_ = job["ranks"][rank].get("compile")
        if compile_ and compile_.get("first_step"):
            rows.append((job["ranks"][rank]["first_step_s"], job["job_id"], rank, compile_))
    if not rows:
        return None
    rows.sort(key=lambda row: row[0])
    _, job_id, rank, compile_ = rows[(len(rows) - 1) // 2]
    return {
        "job_id": job_id,
        "rank": rank,
        "jobs": len(rows),
        **compile_["first_step"],
        "later_warmup_compile_s": compile_.get("later_warmup_compile_s"),
        "timed_compile_s": compile_.get("timed_compile_s"),
    }


def aggregate_mode(jobs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Per-mode numbers for one workload from all of its jobs."""
    mine = [j for j in jobs if j["mode"] == mode]
    timing = [j for j in mine if j["kind"] in TIMING_KINDS and j["ok"]]
    failures = [j for j in mine if not j["ok"]]
    out: dict[str, Any] = {"mode": mode, "description": MODE_HELP.get(mode, mode)}
    if not timing:
        first = failures[0] if failures else None
        out["status"] = "unavailable" if first and first.get("unavailable") else "failed"
        out["error"] = first["errors"][0] if first else "no job ran"
        return out
    out["status"] = "ok"
    step_ms = [_job_step_ms(j) for j in timing]
    out["step_ms"] = _median(step_ms)
    out["step_ms_jobs"] = step_ms
    out["step_ms_min"], out["step_ms_max"] = min(step_ms), max(step_ms)
    for kind in ("cold", "warm", "smoke"):
        of_kind = [j for j in timing if j["kind"] == kind]
        out[f"first_step_s_{kind}"] = _median([_job_first_step_s(j) for j in of_kind])
        two = [_job_two_steps_s(j) for j in of_kind]
        out[f"two_steps_s_{kind}"] = None if None in two else _median(two)
        breakdown = first_step_breakdown(of_kind)
        if breakdown is not None:
            out.setdefault("first_step", {})[kind] = breakdown
    steady_compiles = [
        (j["job_id"], r["rank"], r["compile"]["timed_steps_with_compile"])
        for j in timing
        for r in j["ranks"]
        if (r.get("compile") or {}).get("timed_steps_with_compile")
    ]
    if steady_compiles:
        out["compiles_after_warmup"] = steady_compiles
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for j in timing for r in j["ranks"])
    out["peak_rss_mb_per_rank"] = _per_rank_max(timing, "peak_rss_mb")
    for key in ("steady_peak_rss_mb", "steady_growth_rss_mb", "steady_peak_cuda_mb"):  # cuda: GPU ranks only
        steady = _per_rank_max(timing, key)
        if any(v is not None for v in steady):
            out[f"{key}_per_rank"] = steady
    losses = [j["ranks"][0]["final_loss"] for j in timing]
    out["final_loss"] = losses[0]
    out["final_loss_jobs"] = losses
    # rank 0's parameter fingerprint per job, and how far the job's other ranks ended from rank 0
    checksums = [j["ranks"][0].get("param_checksum") for j in timing]
    if all(c is not None for c in checksums):
        out["param_checksum"] = checksums[0]
        out["param_checksum_jobs"] = checksums
        out["rank_param_distance"] = max(
            checksum_distance(r["param_checksum"], j["ranks"][0]["param_checksum"]) for j in timing for r in j["ranks"]
        )
    info = timing[0]["ranks"][0].get("info", {})
    out["pieces"] = info.get("pieces")
    out["info"] = info
    single = [j for j in mine if j["kind"] == "single" and j["ok"]]
    if single:
        out["step_ms_1rank"] = _median([_job_step_ms(j) for j in single])
        out["scaling_efficiency"] = out["step_ms_1rank"] / out["step_ms"]
    elif any(j["kind"] == "single" for j in mine):
        out["scaling_error"] = next(j["errors"][0] for j in mine if j["kind"] == "single" and not j["ok"])
    out["overlap"] = _overlap_of(mine)
    out["profile"] = _profile_of(mine)
    if any(not j["ok"] for j in mine if j["kind"] in TIMING_KINDS):
        out["partial_failures"] = [j["errors"][0] for j in mine if j["kind"] in TIMING_KINDS and not j["ok"]]
    return out


def _overlap_of(jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    with_rec = [j for j in jobs if j["ok"] and "overlap" in j["ranks"][0]]
    if not with_rec:
        failed = [j for j in jobs if j["kind"] == "overlap" and not j["ok"]]
        return {"recorded": False, "reason": failed[0]["errors"][0]} if failed else None
    job = with_rec[-1]
    rank0 = job["ranks"][0]["overlap"]
    if not rank0.get("recorded"):
        return rank0
    per_rank = [r["overlap"].get("median_overlap_percent") for r in job["ranks"]]
    return {
        **{
            k: rank0.get(k)
            for k in (
                "recorded",
                "median_exposed_ms",
                "median_comm_ms",
                "buckets",
                "observed_buckets",
                "alignment",
                "alignment_text",
                "timeline_png",
            )
        },
        "overlap_percent_per_rank": per_rank,
        "overlap_percent": _median([p for p in per_rank if p is not None]),
    }


def _profile_of(jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Profiler overlap (same definitions as the recorder's) and tensor peak, from the last profiled job."""
    profiled = [j for j in jobs if j["ok"] and "profile" in j["ranks"][0]]
    if not profiled:
        failed = [j for j in jobs if j["kind"] == "overlap" and not j["ok"]]
        return {"measured": False, "reason": failed[0]["errors"][0]} if failed else None
    job = profiled[-1]
    ranks = [r["profile"] for r in job["ranks"]]
    out: dict[str, Any] = {"job_id": job["job_id"], **tensor_memory(ranks)}
    rank0 = ranks[0]
    if not rank0.get("measured"):
        return {**out, "measured": False, "reason": rank0.get("reason")}
    per_rank = [p.get("median_overlap_percent") for p in ranks]
    return {
        **out,
        "measured": True,
        "overlap_percent_per_rank": per_rank,
        "overlap_percent": _median([p for p in per_rank if p is not None]),
        **{k: rank0.get(k) for k in ("median_exposed_ms", "median_comm_ms", "all_reduces", "paired", "timeline_png")},
    }


def comparisons(modes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of our finished modes against its PyTorch peer (cold/warm first step) and the best PyTorch mode
    (step ms): ratios < 1 mean ours is faster. The claims' targets are read against these."""
    torch_ok = {m: a for m, a in modes.items() if m.startswith("torch_") and a["status"] == "ok"}
    best = min(torch_ok, key=lambda m: torch_ok[m]["step_ms"]) if torch_ok else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out = []
    for mode, peer in PEERS.items():
        mine, theirs = modes.get(mode), modes.get(peer)
        if not mine or mine["status"] != "ok":
            continue
        row: dict[str, Any] = {"mode": mode, "peer": peer, "best_torch": best}
        if theirs and theirs["status"] == "ok":
            for kind in ("cold", "warm", "smoke"):
                key = f"first_step_s_{kind}"
                row[f"first_step_{kind}_vs_peer"] = ratio(mine.get(key), theirs.get(key))
                key = f"two_steps_s_{kind}"
                row[f"two_steps_{kind}_vs_peer"] = ratio(mine.get(key), theirs.get(key))
            # compiles can move out of the first step (optimizer recompile at update 2, the optimizer-in-backward
            # variant): the whole warm-up's compile seconds keep such a mode honest
            row["warmup_compile_cold_vs_peer"] = ratio(_warmup_compile(mine, "cold"), _warmup_compile(theirs, "cold"))
        if best is not None:
            row["step_ms_vs_best_torch"] = ratio(mine["step_ms"], torch_ok[best]["step_ms"])
        out.append(row)
    return out


def _warmup_compile(agg: dict[str, Any], kind: str) -> float | None:
    """Compile seconds of all warm-up steps of the job shown in the breakdown (first + later)."""
    b = (agg.get("first_step") or {}).get(kind)
    if b is None:
        return None
    return b["compile_s"] + (b.get("later_warmup_compile_s") or 0.0)


def _gated(modes: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(the modes the gates judge, the bracket modes present): floor trains every rank on its own data and
    comm_only trains nothing, so neither can end where eager DDP ends; they are listed, not judged."""
    return ({m: a for m, a in modes.items() if m not in BRACKET_MODES}, [m for m in modes if m in BRACKET_MODES])


def loss_agreement(modes: dict[str, dict[str, Any]], *, rtol: float, atol: float) -> dict[str, Any]:
    """Do all finished modes end at the same loss? Reference: eager when it finished. Bracket modes: exempt."""
    modes, exempt = _gated(modes)
    finished = {m: a["final_loss"] for m, a in modes.items() if a["status"] == "ok"}
    if not finished:
        return {"ok": None, "reference": None, "disagree": [], "unstable": [], "exempt": exempt}
    ref_mode = "eager" if "eager" in finished else next(iter(finished))
    ref = finished[ref_mode]
    tol = atol + rtol * abs(ref)
    disagree = [{"mode": m, "loss": v, "diff": v - ref} for m, v in finished.items() if abs(v - ref) > tol]
    # the same mode must also agree with itself across jobs (cold vs warm, rounds)
    unstable = [
        {"mode": m, "losses": a["final_loss_jobs"]}
        for m, a in modes.items()
        if a["status"] == "ok" and max(a["final_loss_jobs"]) - min(a["final_loss_jobs"]) > tol
    ]
    return {
        "ok": not disagree and not unstable,
        "reference": ref_mode,
        "reference_loss": ref,
        "tolerance": tol,
        "disagree": disagree,
        "unstable": unstable,
        "exempt": exempt,
    }


def param_agreement(
    modes: dict[str, dict[str, Any]],
    *,
    rtol: float,
    rtol_by_mode: dict[str, float] | None = None,
    loosened_because: str = "",
) -> dict[str, Any]:
    """Did every finished mode end with eager's parameters? The gate of the cross-mode comparison.

    Each mode's rank-0 parameter fingerprint must be within `rtol` (`checksum_distance`) of eager's, or
    within `rtol_by_mode[mode]` where given (`loosened_because` says why: 16-bit reductions); within a
    mode the ranks must agree to `rtol` (DDP keeps replicas identical), and so must the mode's own jobs.
    Modes without a fingerprint (results of an older run) are listed, not judged; so are the bracket
    modes (`exempt`).
    """
    by_mode = dict(rtol_by_mode or {})
    modes, exempt = _gated(modes)
    finished = {m: a for m, a in modes.items() if a["status"] == "ok"}
    with_sum = {m: a for m, a in finished.items() if "param_checksum" in a}
    missing = sorted(set(finished) - set(with_sum))
    if not with_sum:
        return {
            "ok": None,
            "reference": None,
            "rtol": rtol,
            "distance": {},
            "disagree": [],
            "ranks_disagree": [],
            "unstable": [],
            "missing": missing,
            "exempt": exempt,
        }
    ref_mode = "eager" if "eager" in with_sum else next(iter(with_sum))
    ref = with_sum[ref_mode]["param_checksum"]
    distance = {m: checksum_distance(a["param_checksum"], ref) for m, a in with_sum.items()}
    disagree = [{"mode": m, "distance": d} for m, d in distance.items() if not d <= by_mode.get(m, rtol)]
    ranks_disagree = [
        {"mode": m, "distance": a["rank_param_distance"]}
        for m, a in with_sum.items()
        if not a["rank_param_distance"] <= rtol
    ]
    unstable = [
        {"mode": m, "distance": max(checksum_distance(c, a["param_checksum"]) for c in a["param_checksum_jobs"])}
        for m, a in with_sum.items()
        if not all(checksum_distance(c, a["param_checksum"]) <= rtol for c in a["param_checksum_jobs"])
    ]
    return {
        "ok": not disagree and not ranks_disagree and not unstable and not missing,
        "reference": ref_mode,
        "rtol": rtol,
        "distance": distance,
        "disagree": disagree,
        "ranks_disagree": ranks_disagree,
        "unstable": unstable,
        "missing": missing,
        "exempt": exempt,
        **({"rtol_by_mode": by_mode, "loosened_because": loosened_because} if by_mode else {}),
    }


def aggregate(cfg: BenchConfig, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    workloads = {}
    for w in cfg.workloads:
        mine = [j for j in jobs if j["workload"] == w.name]
        modes = {m: aggregate_mode(mine, m) for m in cfg.modes}
        workloads[w.name] = {
            "description": w.describe(cfg.bucket_cap_mb),
            "purpose": w.purpose,
            "modes": modes,
            "comparisons": comparisons(modes),
            "gradient_savings": gradient_savings(modes),
            "loss_agreement": loss_agreement(modes, rtol=cfg.loss_rtol, atol=cfg.loss_atol),
            "param_agreement": param_agreement(
                modes,
                rtol=cfg.param_tolerance(),
                rtol_by_mode=cfg.param_tolerances(),
                loosened_because=f"reduce_dtype={cfg.reduce_dtype}: 16-bit all-reduce, eager's is fp32",
            ),
            "bracket": bracket(modes),
            # --reduce-dtype reaches our in-graph modes only: their rows say so
            "labels": {
                m: f"reduce_dtype={cfg.reduce_dtype}" for m in cfg.modes if cfg.reduce_dtype and m in IN_GRAPH_MODES
            },
        }
    return {
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "config": cfg.to_dict(),
        "machine": machine_description(jobs),
        "workloads": workloads,
        "jobs": jobs,
    }


def machine_description(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem_gib = round(kib / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    pg = sorted({r.get("pg_backend") for j in jobs for r in j["ranks"] if r.get("pg_backend")})
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "process_group": pg,
    }
