"""The prose of the BENCHMARKS.md report around its tables: what runs and how to run it, the method, the run's
conditions and the details per workload and mode. benchmarks/report.py puts them together with the tables
(benchmarks/tables.py) into the generated part of the report.
"""

from __future__ import annotations

from typing import Any

from benchmarks.config import IN_GRAPH_MODES, MODE_HELP, OPTIMIZER_CLASSES
from benchmarks.tables import _short
from benchmarks.workloads import Workload, full_workloads

FULL_COMMAND = "python -m benchmarks --optimizer adamw --warmup 3 --steps 10"
"""The full comparison run (every mode, workloads compute, comm and compile, 2 rounds): what BENCHMARKS.md shows."""
QUICK_COMMAND = "python -m benchmarks --quick"
"""The quick run: comm workload on the tiny model, 1 round, overlap measured in the same job."""


def optimizer_text(cfg: dict[str, Any]) -> str:
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
    """The standard workloads in one sentence, from their declaration (benchmarks/workloads.py)."""
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


def details_section(result: dict[str, Any], img) -> list[str]:
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
