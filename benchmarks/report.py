"""Write an aggregated run out: results.json, the step-time chart, and BENCHMARKS.md (header, tables, details).

Aggregation is in benchmarks/aggregate.py, the tables in benchmarks/tables.py. The generator owns only the
part of the report between its `<!-- generated:begin ... -->` and `<!-- generated:end -->` lines: a
regenerated report keeps everything outside them (hand-written notes and sections) as it was. Raw data
(results.json) stays in the run's out dir; a report outside that dir (the repository's BENCHMARKS.md) gets
copies of the images it shows in docs/benchmarks/ next to it, so what it links can be committed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from benchmarks.aggregate import aggregate, loss_agreement, param_agreement  # noqa: F401 - the CLI's entry points
from benchmarks.config import (
    BRACKET_MODES,
    IN_GRAPH_MODES,
    MODE_HELP,
    OPTIMIZER_CLASSES,
    Workload,
    full_workloads,
)
from benchmarks.markers import GENERATED_BEGIN, GENERATED_END, merge_markdown
from benchmarks.tables import _short, all_tables

FULL_COMMAND = "python -m benchmarks --optimizer adamw --warmup 3 --steps 10"
"""The full comparison run (every mode, workloads compute, comm and compile, 2 rounds): what BENCHMARKS.md shows."""
QUICK_COMMAND = "python -m benchmarks --quick"
"""The quick run: comm workload on the tiny model, 1 round, overlap measured in the same job."""


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
        colors = [
            "#bbbbbb"
            if m in BRACKET_MODES
            else "#888888"
            if m == "eager"
            else "#cc6633"
            if m.startswith("torch")
            else "#3366cc"
            for m in labels
        ]
        bars = ax.bar(range(len(labels)), heights, yerr=[lo, hi], color=colors, capsize=3)
        for i, (m, bar) in enumerate(zip(labels, bars)):
            text = f"{heights[i]:.0f}" if modes[m]["status"] == "ok" else modes[m]["status"]
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel("median step ms (lower is better)")
        ax.set_title(f"{name}: {result['workloads'][name]['description']}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _optimizer_text(cfg: dict[str, Any]) -> str:
    kwargs = cfg.get("optimizer_kwargs") or {"lr": cfg.get("lr") or 0.05, "momentum": 0.9}  # older runs: SGD
    name = OPTIMIZER_CLASSES.get(cfg.get("optimizer", "sgd"), cfg.get("optimizer", "sgd"))
    return f"{name}(" + ", ".join(f"{k}={v:g}" for k, v in kwargs.items()) + ")"


def how_to_run() -> list[str]:
    """The static part of the header: what runs, and the commands (also in README.md)."""
    return [
        "## What runs",
        "",
        "Modes (every mode gets the same model, optimizer, batches and seed; every mode but floor the same DDP "
        "settings):",
        "",
        *[f"- `{m}`: {help_}" for m, help_ in MODE_HELP.items()],
        "",
        _workloads_text(),
        "",
        "Full comparison (about 2-4 hours on 2 CPU cores, an estimate: cold Inductor compiles of the compile "
        f"workload dominate): `{FULL_COMMAND}`. Quick look (comm workload, tiny "
        f"model, 1 round, about 10 minutes): `{QUICK_COMMAND}`. `--optimizer sgd` reruns the comparison with "
        "SGD (momentum 0.9), `--workloads compile` only the compile-time table; `--no-plot` runs without "
        "matplotlib. Rebuild this file from a results.json without running anything: "
        "`python -m benchmarks --render bench_out/full/results.json` (raw data stays in the run's out dir, "
        "uncommitted; the images shown here are copied to docs/benchmarks/; text outside the generated:begin/end "
        "markers is kept).",
        "",
        (
            "Speed claims are read against each workload's bracket: `floor` (the step with no communication) and "
            "floor + `comm_only` (every all-reduce exposed); each mode's overhead over the floor and the share of "
            "comm_only it hid are in the table. `--link-gbit X` runs every job in its own network namespace with "
            "its loopback shaped to X Gbit/s (tc tbf; root, `unshare`, `nsenter`, `ip` and `tc` needed, checked "
            "before the first job). `--comm-hook fp16` registers DDP's `fp16_compress_hook` on every mode's DDP "
            "object (comm_only then all-reduces fp16 buffers; floor has no DDP); `--reduce-dtype bf16|fp16` passes "
            "`reduce_dtype=` to our in-graph modes only."
        ),
        "",
    ]


def _workloads_text() -> str:
    """The standard workloads in one sentence, from their declaration (benchmarks/config.py)."""
    compute, comm, compile_ = full_workloads()

    def shape(w: Workload) -> str:
        return f"{w.batch}x{w.seq_len} tokens"

    return (
        f"Workloads: `compute` (GPT d={compute.model.d_model}, {compute.model.n_layers} layers, {shape(compute)} "
        f"per rank, DDP's 25 MiB buckets), `comm` (same model, {shape(comm)}, {comm.bucket_cap_mb:g} MiB buckets: "
        f"the communication-heavy comparison) and `compile` (GPT d={compile_.model.d_model}, "
        f"{compile_.model.n_layers} layers, {shape(compile_)}, {compile_.bucket_cap_mb:g} MiB buckets: cold/warm "
        "first-step compile time; no 1-rank or overlap jobs)."
    )


def method_lines(cfg: dict[str, Any]) -> list[str]:
    return [
        "## Method",
        "",
        f"- {cfg['rounds']} round(s); every round runs every mode once, in a rotated order, so machine drift "
        "hits all modes alike. Every job is a fresh set of rank processes.",
        f"- step ms: median of {cfg['steps']} timed steps after {cfg['warmup']} warm-up steps, slowest rank; "
        "the table shows the median over jobs and the min-max across jobs.",
        "- cold / warm 1st step s: wall time of the first step (compile included), slowest rank, with a fresh "
        "private TORCHINDUCTOR_CACHE_DIR (round 1), then in jobs reusing it (round 1 again and later rounds).",
        "- first-step breakdown: torch's own compile timers (`torch._dynamo.utils.compilation_time_metrics`, "
        "the `dynamo_timed` phases) and cache counters (`torch._dynamo.utils.counters`), read before and "
        "after the step: Dynamo = frame compile minus the backend; AOT + backend passes = the backend "
        "(AOTAutograd, DDPOptimizer's or our graph split, in-graph all-reduce passes) minus Inductor; "
        "Inductor = lowering and codegen (cache loads on a warm cache) minus C++ compile; other = running the "
        "step and waiting for the other rank's compile. The median job's slowest rank is shown, so the "
        "columns add up. 'later warm-up compile s': compiles in warm-up steps 2.. (optimizer recompiles, "
        "the optimizer-in-backward variant at update 2); see benchmarks/breakdown.py. 'to end of step 2, "
        "cold / warm / peer': wall time of steps 1 and 2 (slowest rank) against the peer's, the start-up a user "
        "waits for whichever step a mode compiles in.",
        "- steady peak RSS: VmHWM reset (`/proc/self/clear_refs`) right before the timed steps and read after "
        "them, per rank; in brackets, how far the timed steps raised it above the RSS at the reset (what the "
        "steps add, without the code and caches loaded before them); process peak RSS: the whole process "
        "(set by compilation). Step tensor peak: the most tensor memory a profiled step held above what was "
        "alive at its start (profiler memory events: "
        "gradients, activations, all-reduce buffers), per rank.",
        (
            "- bracket: floor = `torch.compile(model)` + `torch.compile`'d `optimizer.step()` on every rank at "
            "once, no DDP, no communication (each rank trains its own copy); comm_only = one all-reduce per DDP "
            "bucket (DDP's sizes, from `dist._compute_bucket_assignment_by_size` with the DDP object's caps; fp16 "
            "under --comm-hook fp16), issued back to back asynchronously, then all waited for, per step. Over floor "
            "= mode ms - floor ms (and % of floor). Comm hidden = 1 - (mode ms - floor ms) / comm_only ms, clamped "
            "to 0-100 % with the raw value shown: below 0 the mode is slower than floor + comm_only (overhead that "
            "is not communication, or all-reduces contending with compute), above 100 % faster than the floor. "
            "Neither bracket mode trains like eager DDP: both are left out of the loss and parameter gates."
        ),
        "- scaling eff: 1-rank step ms (one 1-rank job per mode, round 1) / 2-rank step ms at the same "
        "per-rank batch (1.0 = perfect).",
        "- overlap % / exposed comm ms: share of all-reduce wall time hidden behind backward compute, and what "
        "communication adds to the step, measured two ways: 'hook' = `ddp.overlap.OverlapRecorder` (a DDP "
        "comm hook; sees nothing in the in-graph modes), 'prof' = torch.profiler events of "
        f"{cfg.get('profile_steps', 2)} extra profiled step(s) with the same interval definitions "
        "(benchmarks/profile_overlap.py). "
        + (
            "Both come from a separate job per mode whose step times are not used."
            if not cfg.get("overlap_in_main_job")
            else "Both come from the measured job itself; profiled steps run after the timed ones and are not timed."
        ),
        "",
    ]


IMAGES_DIR = Path("docs") / "benchmarks"
"""Where a report outside the run's out dir keeps its images, relative to the report."""
_GENERATED_IMAGE = re.compile(r"^(step_ms|timeline_.+)\.png$")


def benchmarks_md(
    result: dict[str, Any],
    *,
    chart: Path | None,
    json_path: Path,
    md_path: Path,
    images: Mapping[str, Path] | None = None,
) -> str:
    """The generated part of BENCHMARKS.md, markers included (`merge_markdown` puts it into the file).

    `images` maps an image the run wrote to the copy the report links instead (`place_images`)."""
    cfg, machine = result["config"], result["machine"]
    rel = lambda p: os.path.relpath(p, md_path.parent)  # noqa: E731 - paths relative to the .md
    img = lambda p: rel((images or {}).get(str(p), p))  # noqa: E731
    claims = cfg["preset"] != "smoke"
    lines = [
        GENERATED_BEGIN,
        "",
        f"Generated {result['generated']} by:",
        "",
        "```",
        result["command"],
        "```",
        "",
        *how_to_run(),
        "## Machine",
        "",
        f"- {machine['cpu']}, {machine['cpu_count']} CPUs ({machine['affinity_cpus']} usable), "
        f"{machine['mem_gib']} GiB RAM; GPUs: {', '.join(machine['gpus']) or 'none'}",
        f"- {machine['platform']}, Python {machine['python']}, torch {machine['torch']}",
        f"- process group: {', '.join(machine['process_group']) or '-'}; {cfg['world_size']} ranks per job, "
        "one thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1))",
        f"- backend `{cfg['backend']}`, {_optimizer_text(cfg)} (constant lr), seed {cfg['seed']}; bucket caps "
        "per workload (in each table's title)",
        *run_condition_lines(cfg),
        "",
        *method_lines(cfg),
        "## Results",
        "",
        all_tables(result, timing_claims=claims),
        "",
    ]
    if chart is not None:
        lines += [
            f"Chart: [{img(chart)}]({img(chart)}) · raw data (the run's out dir): `{rel(json_path)}`",
            "",
            f"![step ms per mode]({img(chart)})",
            "",
        ]
    else:
        lines += [f"Raw data: `{rel(json_path)}` (run with --no-plot: no chart)", ""]
    lines += _details_section(result, img)
    lines += ["", GENERATED_END]
    return "\n".join(lines) + "\n"


def place_images(result: dict[str, Any], chart: Path | None, *, md_path: Path, out_dir: Path) -> dict[str, Path]:
    """Copy the images the report shows (chart, overlap timelines) to `IMAGES_DIR` next to a report that lies
    outside the run's out dir, removing generated images of earlier runs there; return {image: its copy}.

    A report inside the out dir links the run's own files (returns {}). An image the run did not write
    (a re-render from another machine's results.json) keeps an earlier copy if there is one."""
    if md_path.resolve().is_relative_to(out_dir.resolve()):
        return {}
    dest_dir = md_path.parent / IMAGES_DIR
    sources = [chart] if chart is not None else []
    for data in result["workloads"].values():
        for a in data["modes"].values():
            sources += [
                Path(p)
                for p in ((a.get("overlap") or {}).get("timeline_png"), (a.get("profile") or {}).get("timeline_png"))
                if p
            ]
    placed: dict[str, Path] = {}
    for src in sources:
        dest = dest_dir / src.name
        if src.is_file():
            dest_dir.mkdir(parents=True, exist_ok=True)
            if not dest.exists() or not dest.samefile(src):
                shutil.copyfile(src, dest)
        if dest.is_file():
            placed[str(src)] = dest
    if dest_dir.is_dir():
        for old in dest_dir.iterdir():
            if _GENERATED_IMAGE.match(old.name) and old not in placed.values():
                old.unlink()
    return placed


def write_report(result: dict[str, Any], *, chart: Path | None, json_path: Path, md_path: Path, out_dir: Path) -> Path:
    """Regenerate the report at `md_path`: its images placed (`place_images`), its generated part replaced,
    everything hand-written around it kept (`merge_markdown`)."""
    images = place_images(result, chart, md_path=md_path, out_dir=out_dir)
    generated = benchmarks_md(result, chart=chart, json_path=json_path, md_path=md_path, images=images)
    previous = md_path.read_text() if md_path.is_file() else None
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(merge_markdown(previous, generated, where=str(md_path)))
    return md_path


def run_condition_lines(cfg: dict[str, Any]) -> list[str]:
    """Link, comm hook, reduce dtype and compile mode of the run (results of older runs: the plain defaults)."""
    from benchmarks.link import LinkShape

    link = cfg.get("link_gbit")
    hook, reduce_dtype = cfg.get("comm_hook"), cfg.get("reduce_dtype")
    in_graph = [m for m in cfg.get("modes", ()) if m in IN_GRAPH_MODES]
    return [
        "- link: " + (LinkShape(rate_gbit=link).describe() if link else "plain loopback (no --link-gbit)"),
        "- DDP comm hook: "
        + (
            f"{hook}_compress_hook on every mode's DDP object (comm_only all-reduces {hook}; floor has no DDP)"
            if hook
            else "none (DDP's default all-reduce)"
        ),
        "- reduce dtype: "
        + (
            f"reduce_dtype={reduce_dtype} for {', '.join(in_graph)} only; every other mode, "
            "comm_only included, all-reduces as without it"
            if reduce_dtype
            else "none"
        ),
        f"- torch.compile mode: {cfg.get('compile_mode') or 'default'} (every compiled mode)",
        "- precision: "
        + (
            f"forward and loss under torch.autocast({cfg['autocast']}) in every mode; parameters, gradients and "
            "optimizer state fp32"
            if cfg.get("autocast")
            else "fp32 (no autocast)"
        ),
        "- blocks: "
        + (
            "each block's forward is a torch.compiler.nested_compile_region (every mode)"
            if cfg.get("nested_regions")
            else "plain modules"
        ),
        "- Inductor compile threads per rank: "
        + (
            "torch's default (the CPU count)"
            if cfg.get("compile_threads", 1) is None
            else f"{cfg.get('compile_threads', 1)} (TORCHINDUCTOR_COMPILE_THREADS)"
        ),
    ]


def _details_section(result: dict[str, Any], img) -> list[str]:
    lines = ["## Details", ""]
    for name, data in result["workloads"].items():
        for mode, a in data["modes"].items():
            if a["status"] != "ok":
                lines.append(f"- {name} / `{mode}` {a['status']}: `{_short(a['error'], 600)}`")
                continue
            info = a.get("info") or {}
            if mode == "comm_only" and info.get("bucket_bytes"):
                mib = ", ".join(f"{b / 2**20:.2f}" for b in info["bucket_bytes"])
                lines.append(
                    f"- {name} / `comm_only`: {len(info['bucket_bytes'])} all-reduces per step of {mib} "
                    f"MiB ({info.get('wire_dtype')}); bucket sizes: {info.get('bucket_source')}"
                )
            ov = a.get("overlap") or {}
            if ov.get("timeline_png"):
                lines.append(
                    f"- {name} / `{mode}` overlap timeline: [{img(ov['timeline_png'])}]"
                    f"({img(ov['timeline_png'])}), {ov.get('buckets')} buckets"
                )
            if ov.get("observed_buckets"):
                sizes = [len(b) for b in ov["observed_buckets"]]
                pieces = "eager (no graph)" if mode == "eager" else f"{a.get('pieces') or '?'} graph piece(s)"
                lines.append(
                    f"- {name} / `{mode}`: {pieces}; DDP really used "
                    f"{len(sizes)} bucket(s) with {sizes} params (recorded by the comm hook)"
                )
            if ov.get("alignment_text"):
                text = ov["alignment_text"].replace("\n", "; ")
                lines.append(f"- {name} / `{mode}` planned pieces vs DDP buckets: {text}")
            if a.get("scaling_error"):
                lines.append(f"- {name} / `{mode}` 1-rank job failed: `{_short(a['scaling_error'], 300)}`")
            prof = a.get("profile") or {}
            if prof.get("timeline_png"):
                lines.append(
                    f"- {name} / `{mode}` overlap timeline (from the profiler): [{img(prof['timeline_png'])}]"
                    f"({img(prof['timeline_png'])}), {prof.get('all_reduces')} all-reduces"
                )
            if prof.get("measured") is False and prof.get("reason"):
                lines.append(f"- {name} / `{mode}` profiler overlap not measured: {_short(prof['reason'], 300)}")
            in_backward = (a.get("info") or {}).get("optimizer_in_backward")
            if in_backward and in_backward.get("requested"):
                state = (
                    "active from update " + str(in_backward.get("from_update"))
                    if in_backward.get("active")
                    else f"NOT active: {in_backward.get('reason')}"
                )
                lines.append(f"- {name} / `{mode}` optimizer in backward: {state}")
            if a.get("compiles_after_warmup"):
                where = "; ".join(
                    f"{job} rank {rank} step(s) {steps}" for job, rank, steps in a["compiles_after_warmup"]
                )
                lines.append(
                    f"- {name} / `{mode}` compiled after the warm-up (0-based steps; timed or profiled "
                    f"steps include compile time): {where}"
                )
            if a.get("partial_failures"):
                lines.append(f"- {name} / `{mode}` some jobs failed: `{_short(a['partial_failures'][0], 300)}`")
    return lines
