"""Turn job results into per-mode numbers, a markdown table, a JSON file, a bar chart and BENCHMARKS.md."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from benchmarks.checksum import checksum_distance
from benchmarks.config import MODE_HELP, BenchConfig

TIMING_KINDS = ("cold", "warm", "smoke")
"""Jobs whose 2-rank step times, losses and memory enter the table (overlap jobs carry a recorder)."""


def _job_step_ms(job: dict[str, Any]) -> float:
    # the slowest rank sets the pace of a synchronous data-parallel step
    return max(r["median_step_ms"] for r in job["ranks"])


def _job_first_step_s(job: dict[str, Any]) -> float:
    return max(r["first_step_s"] for r in job["ranks"])


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def aggregate_mode(jobs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Per-mode numbers for one workload from all of its jobs."""
    mine = [j for j in jobs if j["mode"] == mode]
    timing = [j for j in mine if j["kind"] in TIMING_KINDS and j["ok"]]
    failures = [j for j in mine if not j["ok"]]
    out: dict[str, Any] = {"mode": mode, "description": MODE_HELP[mode]}
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
        vals = [_job_first_step_s(j) for j in timing if j["kind"] == kind]
        out[f"first_step_s_{kind}"] = _median(vals)
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for j in timing for r in j["ranks"])
    out["peak_rss_mb_per_rank"] = [max(j["ranks"][r]["peak_rss_mb"] for j in timing)
                                   for r in range(len(timing[0]["ranks"]))]
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
        **{k: rank0.get(k) for k in ("recorded", "median_exposed_ms", "median_comm_ms", "buckets",
                                      "observed_buckets", "alignment", "alignment_text", "timeline_png")},
        "overlap_percent_per_rank": per_rank,
        "overlap_percent": _median([p for p in per_rank if p is not None]),
    }


def loss_agreement(modes: dict[str, dict[str, Any]], *, rtol: float, atol: float) -> dict[str, Any]:
    """Do all finished modes end at the same loss? Reference: eager when it finished."""
    finished = {m: a["final_loss"] for m, a in modes.items() if a["status"] == "ok"}
    if not finished:
        return {"ok": None, "reference": None, "disagree": []}
    ref_mode = "eager" if "eager" in finished else next(iter(finished))
    ref = finished[ref_mode]
    tol = atol + rtol * abs(ref)
    disagree = [
        {"mode": m, "loss": v, "diff": v - ref} for m, v in finished.items() if abs(v - ref) > tol
    ]
    # the same mode must also agree with itself across jobs (cold vs warm, rounds)
    unstable = [
        {"mode": m, "losses": a["final_loss_jobs"]}
        for m, a in modes.items()
        if a["status"] == "ok" and max(a["final_loss_jobs"]) - min(a["final_loss_jobs"]) > tol
    ]
    return {"ok": not disagree and not unstable, "reference": ref_mode, "reference_loss": ref,
            "tolerance": tol, "disagree": disagree, "unstable": unstable}


def param_agreement(modes: dict[str, dict[str, Any]], *, rtol: float) -> dict[str, Any]:
    """Did every finished mode end with eager's parameters? The gate of the cross-mode comparison.

    Each mode's rank-0 parameter fingerprint must be within `rtol` (`checksum_distance`) of eager's;
    within a mode the ranks must agree to the same tolerance (DDP keeps replicas identical), and so must
    the mode's own jobs. Modes without a fingerprint (results of an older run) are listed, not judged.
    """
    finished = {m: a for m, a in modes.items() if a["status"] == "ok"}
    with_sum = {m: a for m, a in finished.items() if "param_checksum" in a}
    missing = sorted(set(finished) - set(with_sum))
    if not with_sum:
        return {"ok": None, "reference": None, "rtol": rtol, "distance": {}, "disagree": [],
                "ranks_disagree": [], "unstable": [], "missing": missing}
    ref_mode = "eager" if "eager" in with_sum else next(iter(with_sum))
    ref = with_sum[ref_mode]["param_checksum"]
    distance = {m: checksum_distance(a["param_checksum"], ref) for m, a in with_sum.items()}
    disagree = [{"mode": m, "distance": d} for m, d in distance.items() if not d <= rtol]
    ranks_disagree = [{"mode": m, "distance": a["rank_param_distance"]}
                      for m, a in with_sum.items() if not a["rank_param_distance"] <= rtol]
    unstable = [{"mode": m, "distance": max(checksum_distance(c, a["param_checksum"]) for c in a["param_checksum_jobs"])}
                for m, a in with_sum.items()
                if not all(checksum_distance(c, a["param_checksum"]) <= rtol for c in a["param_checksum_jobs"])]
    return {"ok": not disagree and not ranks_disagree and not unstable and not missing, "reference": ref_mode,
            "rtol": rtol, "distance": distance, "disagree": disagree, "ranks_disagree": ranks_disagree,
            "unstable": unstable, "missing": missing}


def aggregate(cfg: BenchConfig, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    workloads = {}
    for w in cfg.workloads:
        mine = [j for j in jobs if j["workload"] == w.name]
        modes = {m: aggregate_mode(mine, m) for m in cfg.modes}
        workloads[w.name] = {
            "description": w.describe(),
            "modes": modes,
            "loss_agreement": loss_agreement(modes, rtol=cfg.loss_rtol, atol=cfg.loss_atol),
            "param_agreement": param_agreement(modes, rtol=cfg.param_tolerance()),
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


# -- text output -----------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def markdown_table(result: dict[str, Any], workload: str, *, timing_claims: bool = True) -> str:
    data = result["workloads"][workload]
    agreement = data["loss_agreement"]
    bad = {d["mode"] for d in agreement["disagree"]} | {d["mode"] for d in agreement["unstable"]}
    header = ("| mode | status | pieces | step ms (median) | min-max | cold 1st step s | warm 1st step s | "
              "peak RSS MB/rank | final loss | scaling eff | overlap % | exposed comm ms |")
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for mode, a in data["modes"].items():
        if a["status"] != "ok":
            rows.append(f"| {mode} | {a['status']}: {_short(a['error'])} |" + " |" * 10)
            continue
        ov = a.get("overlap") or {}
        loss = f"{a['final_loss']:.5f}" + (" **DISAGREES**" if mode in bad else "")
        warm = a["first_step_s_warm"] if a["first_step_s_warm"] is not None else a["first_step_s_smoke"]
        cold = a["first_step_s_cold"] if mode != "eager" else None
        rows.append(
            f"| {mode} | ok | {_fmt(a['pieces'], 'd')} | {_fmt(a['step_ms'])} | "
            f"{_fmt(a['step_ms_min'])}-{_fmt(a['step_ms_max'])} | "
            f"{_fmt(cold, '.1f', 'no compile' if mode == 'eager' else '-')} | {_fmt(warm, '.1f')} | "
            f"{_fmt(a['peak_rss_mb'], '.0f')} | {loss} | {_fmt(a.get('scaling_efficiency'), '.2f')} | "
            f"{_overlap_cell(ov)} | {_fmt(ov.get('median_exposed_ms'))} |"
        )
    lines = [f"### {workload}: {data['description']}", ""]
    if not timing_claims:
        lines.append("_smoke run: numbers below are not timing claims_\n")
    lines += rows + ["", _agreement_line(agreement)]
    if "param_agreement" in data:  # results.json of runs before the parameter fingerprint have none
        lines += ["", _param_agreement_line(data["param_agreement"])]
    return "\n".join(lines)


def _param_agreement_line(agreement: dict[str, Any]) -> str:
    if agreement["ok"] is None:
        if agreement["missing"]:
            return "Parameter agreement: not checked (these results hold no parameter fingerprints)."
        return "Parameter agreement: no mode finished."
    if agreement["ok"]:
        worst = max(agreement["distance"].values())
        return (f"Parameter agreement: OK (every mode's final parameters within {worst:.1e} of "
                f"{agreement['reference']}'s update; tolerance {agreement['rtol']:.0e}).")
    parts = [f"{d['mode']} {d['distance']:.2g} from {agreement['reference']}" for d in agreement["disagree"]]
    parts += [f"{d['mode']}: ranks {d['distance']:.2g} apart" for d in agreement["ranks_disagree"]]
    parts += [f"{d['mode']} varies across jobs ({d['distance']:.2g})" for d in agreement["unstable"]]
    parts += [f"{m}: no parameter fingerprint" for m in agreement["missing"]]
    return f"**WARNING: parameter disagreement** beyond {agreement['rtol']:.0e}: " + "; ".join(parts)


def _overlap_cell(ov: dict[str, Any]) -> str:
    if not ov:
        return "-"
    if not ov.get("recorded"):
        return "n/a (python reducer)" if "python reducer" in str(ov.get("reason", "")) else "n/a"
    return _fmt(ov.get("overlap_percent"), ".0f")


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _agreement_line(agreement: dict[str, Any]) -> str:
    if agreement["ok"] is None:
        return "Loss agreement: no mode finished."
    if agreement["ok"]:
        return (f"Loss agreement: OK (all finished modes within {agreement['tolerance']:.2g} of "
                f"{agreement['reference']}'s {agreement['reference_loss']:.5f}).")
    parts = [f"{d['mode']} {d['loss']:.5f} ({d['diff']:+.2g})" for d in agreement["disagree"]]
    parts += [f"{d['mode']} varies across jobs {d['losses']}" for d in agreement["unstable"]]
    return (f"**WARNING: loss disagreement** beyond {agreement['tolerance']:.2g} vs "
            f"{agreement['reference']} ({agreement['reference_loss']:.5f}): " + "; ".join(parts))


def all_tables(result: dict[str, Any], *, timing_claims: bool = True) -> str:
    return "\n\n".join(markdown_table(result, w, timing_claims=timing_claims) for w in result["workloads"])


# -- files -----------------------------------------------------------------------------------------------


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path


def plot_step_ms(result: dict[str, Any], path: Path) -> Path:
    """Bar chart of median step ms per mode (min-max whiskers), one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6.5 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        modes = result["workloads"][name]["modes"]
        labels = list(modes)
        heights = [modes[m].get("step_ms") or 0.0 for m in labels]
        lo = [h - (modes[m].get("step_ms_min") or h) for m, h in zip(labels, heights)]
        hi = [(modes[m].get("step_ms_max") or h) - h for m, h in zip(labels, heights)]
        colors = ["#888888" if m == "eager" else "#cc6633" if m.startswith("torch") else "#3366cc" for m in labels]
        bars = ax.bar(range(len(labels)), heights, yerr=[lo, hi], color=colors, capsize=3)
        for i, (m, bar) in enumerate(zip(labels, bars)):
            text = f"{heights[i]:.0f}" if modes[m]["status"] == "ok" else modes[m]["status"]
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel("median step ms (lower is better)")
        ax.set_title(f"{name}: {result['workloads'][name]['description']}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def benchmarks_md(result: dict[str, Any], *, chart: Path, json_path: Path, md_path: Path) -> str:
    """The whole BENCHMARKS.md text (regenerated by every run; never edit by hand)."""
    cfg, machine = result["config"], result["machine"]
    rel = lambda p: os.path.relpath(p, md_path.parent)  # noqa: E731 - paths relative to the .md
    claims = cfg["preset"] != "smoke"
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by `python -m benchmarks`; do not edit by hand, rerun the command below -->",
        "",
        f"Generated {result['generated']} by:",
        "",
        "```",
        result["command"],
        "```",
        "",
        "## Machine",
        "",
        f"- {machine['cpu']}, {machine['cpu_count']} CPUs ({machine['affinity_cpus']} usable), "
        f"{machine['mem_gib']} GiB RAM; GPUs: {', '.join(machine['gpus']) or 'none'}",
        f"- {machine['platform']}, Python {machine['python']}, torch {machine['torch']}",
        f"- process group: {', '.join(machine['process_group']) or '-'}; {cfg['world_size']} ranks per job, "
        "one thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1))",
        f"- backend `{cfg['backend']}`, DDP bucket cap "
        f"{cfg['bucket_cap_mb'] if cfg['bucket_cap_mb'] is not None else 'default (25)'} MiB, "
        f"SGD(lr={cfg['lr']}, momentum=0.9), seed {cfg['seed']}",
        "",
        "## Method",
        "",
        f"- {cfg['rounds']} round(s); every round runs every mode once, in a rotated order, so machine drift "
        "hits all modes alike. Every job is a fresh set of rank processes.",
        f"- step ms: median of {cfg['steps']} timed steps after {cfg['warmup']} warm-up steps, slowest rank; "
        "the table shows the median over jobs and the min-max across jobs.",
        "- cold / warm 1st step s: wall time of the first step (compile included) with a fresh private "
        "TORCHINDUCTOR_CACHE_DIR (round 1), then in jobs reusing it (round 1 again and later rounds).",
        "- scaling eff: 1-rank step ms (one 1-rank job per mode, round 1) / 2-rank step ms at the same "
        "per-rank batch (1.0 = perfect).",
        "- overlap %: share of all-reduce wall time hidden behind backward compute, from a separate job "
        "with `ddp.overlap.OverlapRecorder` attached (see the Note in ddp/overlap.py); exposed comm ms is "
        "what communication adds to the step. Its step times are not used in the table.",
        "- modes: " + "; ".join(f"`{m}` = {MODE_HELP[m]}" for m in cfg["modes"]),
        "",
        "## Results",
        "",
        all_tables(result, timing_claims=claims),
        "",
        f"Chart: [{rel(chart)}]({rel(chart)}) · raw data: `{rel(json_path)}`",
        "",
        f"![step ms per mode]({rel(chart)})",
        "",
    ]
    lines += _details_section(result, rel)
    return "\n".join(lines) + "\n"


def _details_section(result: dict[str, Any], rel) -> list[str]:
    lines = ["## Details", ""]
    for name, data in result["workloads"].items():
        for mode, a in data["modes"].items():
            if a["status"] != "ok":
                lines.append(f"- {name} / `{mode}` {a['status']}: `{_short(a['error'], 600)}`")
                continue
            ov = a.get("overlap") or {}
            if ov.get("timeline_png"):
                lines.append(f"- {name} / `{mode}` overlap timeline: [{rel(ov['timeline_png'])}]"
                             f"({rel(ov['timeline_png'])}), {ov.get('buckets')} buckets")
            if ov.get("observed_buckets"):
                sizes = [len(b) for b in ov["observed_buckets"]]
                pieces = "eager (no graph)" if mode == "eager" else f"{a.get('pieces') or '?'} graph piece(s)"
                lines.append(f"- {name} / `{mode}`: {pieces}; DDP really used "
                             f"{len(sizes)} bucket(s) with {sizes} params (recorded by the comm hook)")
            if ov.get("alignment_text"):
                text = ov["alignment_text"].replace("\n", "; ")
                lines.append(f"- {name} / `{mode}` planned pieces vs DDP buckets: {text}")
            if a.get("scaling_error"):
                lines.append(f"- {name} / `{mode}` 1-rank job failed: `{_short(a['scaling_error'], 300)}`")
            if a.get("partial_failures"):
                lines.append(f"- {name} / `{mode}` some jobs failed: `{_short(a['partial_failures'][0], 300)}`")
    return lines
