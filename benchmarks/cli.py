"""`python -m benchmarks`: side-by-side DDP + compile benchmark (see BENCHMARKS.md for the last full run)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from benchmarks.config import DEFAULT_MODES, MODES, OPTIMIZERS, VARIANT_MODES, BenchConfig
from benchmarks.deps import missing
from benchmarks.runner import REPO_ROOT
from benchmarks.workloads import COMPILE_WORKLOAD, TINY_PRESET, WORKLOAD_NAMES, Workload, full_workloads
from examples.gpt_config import GPTConfig

PRESETS = {
    # (rounds, warmup, steps); quick and smoke also shrink the model (GPT preset TINY_PRESET)
    "full": (2, 3, 10),
    "quick": (1, 2, 10),
    "smoke": (1, 1, 1),
}


def _batch(text: str) -> tuple[int, int]:
    try:
        b, t = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch {text!r}: write it as BATCHxSEQ, e.g. 8x128") from None
    return b, t


AUTO_THREADS = "auto"
"""--compile-threads default: 1 on a machine without a GPU (the 2-core bed: ranks' compiles in-process, no worker
pool competing for the cores), torch's own default where a GPU is (the machine users train on)."""


def _compile_threads(text: str) -> int | str | None:
    if text == "torch":
        return None
    if text == AUTO_THREADS:
        return AUTO_THREADS
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"--compile-threads {text!r}: pass a count >= 1, 'torch' for its default, or 'auto'"
        )
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 1 round, one job per mode with the overlap measured inside it (about 10 minutes on 2 cores)",
    )
    preset.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model, 2 steps (+1 profiled), every mode, one job per mode, no timing claims (CI)",
    )
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma list from {','.join(MODES)} (default: all but {', '.join(VARIANT_MODES)})",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help="comma list from compute,comm,compile (default all three; --quick: comm only; "
        f"compile = GPT {COMPILE_WORKLOAD.model.n_layers} blocks d={COMPILE_WORKLOAD.model.d_model}, "
        "1 MiB buckets, for cold/warm first-step times)",
    )
    p.add_argument("--backend", default=None, help="inductor (default), aot_eager (smoke default) or eager")
    p.add_argument(
        "--optimizer",
        default=None,
        choices=sorted(OPTIMIZERS),
        help="adamw (default: AdamW lr 1e-3, weight decay 0.01) or sgd (smoke default: SGD lr 0.05, "
        "momentum 0.9, the sharper parameter gate); the same optimizer in every mode",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the optimizer's, above)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per job (first one compiles)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per job")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--compute-batch", type=_batch, default=None, help="per-rank BATCHxSEQ (default 8x128)")
    p.add_argument("--comm-batch", type=_batch, default=None, help="per-rank BATCHxSEQ (default 2x64)")
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP bucket cap for EVERY workload (default: compute 25 = DDP's, comm 4, compile 1; --quick/--smoke: 1)",
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=None, help="seconds per job before its ranks are killed")
    p.add_argument("--no-cold-warm", action="store_true", help="one job per compiled mode per round")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1-rank jobs")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlap measurements (recorder, profiler)")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="steps profiled for the profiler overlap and tensor peak (default 2; smoke 1; 0: none)",
    )
    p.add_argument("--no-plot", action="store_true", help="no chart or timeline PNGs (then matplotlib is not needed)")
    p.add_argument("--loss-rtol", type=float, default=1e-3)
    p.add_argument(
        "--param-rtol",
        type=float,
        default=None,
        help="max distance of a mode's final parameters from eager's (default: SGD 1e-5 for "
        "aot_eager/eager, 1e-3 for inductor; AdamW 1e-3 and 1e-2; see BenchConfig.param_rtol)",
    )
    p.add_argument(
        "--link-gbit",
        type=float,
        default=None,
        metavar="X",
        help="run every job in its own network namespace with its loopback shaped to X Gbit/s "
        "(tc tbf; needs root, unshare, nsenter, ip, tc: checked before the first job)",
    )
    p.add_argument(
        "--comm-hook",
        choices=("none", "fp16"),
        default="none",
        help="fp16: register DDP's fp16_compress_hook on every mode's DDP object (comm_only then "
        "all-reduces fp16; floor has no DDP)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=("bf16", "fp16"),
        default=None,
        help="reduce_dtype= for our ddp='in_graph' modes only; other modes unchanged",
    )
    p.add_argument(
        "--autocast",
        choices=("none", "bf16"),
        default="none",
        help="bf16: every mode's forward and loss under torch.autocast(device, bfloat16) (train_step modes: "
        "autocast=torch.bfloat16); parameters, gradients and optimizer state stay fp32",
    )
    p.add_argument(
        "--compile-mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile mode of every compiled mode, ours and PyTorch's (reduce-overhead: CUDA graphs, "
        "GPU only); needs --backend inductor",
    )
    p.add_argument(
        "--nested-regions",
        action="store_true",
        help="mark each GPT block's forward as a torch.compiler.nested_compile_region, as a user would (every "
        "mode gets the same model): Dynamo traces one block and calls it per layer (README, Limits: a torch 2.13 "
        "Inductor defect with such graphs, and our workaround)",
    )
    p.add_argument(
        "--compile-threads",
        type=_compile_threads,
        default=AUTO_THREADS,
        metavar="N|torch|auto",
        help="TORCHINDUCTOR_COMPILE_THREADS of every rank; 'torch' leaves torch's default (the CPU count), as a "
        "user's job has it; default 'auto': torch's default where a GPU is, else 1 (C++ compiled in-process, "
        "seen by the breakdown, no worker pool competing with the other rank for 2 cores)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="default bench_out/<preset>; with --render, where results.json and the chart are rewritten "
        "(default: the out dir the results.json recorded)",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS_JSON",
        help="run nothing: rebuild table, chart, JSON and report from an earlier results.json",
    )
    p.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="report path (default: BENCHMARKS.md in the repo for full runs, OUT_DIR/BENCHMARKS.md otherwise)",
    )
    return p


def config_from_args(args: argparse.Namespace, command: str) -> BenchConfig:
    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    rounds, warmup, steps = PRESETS[preset]
    tiny = preset != "full"
    overrides = {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads, "vocab_size": args.vocab}
    try:
        model = GPTConfig.preset(TINY_PRESET if tiny else "bench", **{k: v for k, v in overrides.items() if v})
    except ValueError as err:
        raise ValueError(f"--d-model/--layers/--heads/--vocab: {err}") from None
    all_workloads = full_workloads(
        model=model,
        compute_batch=args.compute_batch or ((4, 64) if tiny else (8, 128)),
        comm_batch=args.comm_batch or ((1, 32) if tiny else (2, 64)),
    )
    if preset == "smoke":
        # smoke checks plumbing, not compile time: the compile workload shrinks to the tiny model too
        tiny_compile = dataclasses.replace(COMPILE_WORKLOAD, model=GPTConfig.preset(TINY_PRESET))
        all_workloads = all_workloads[:2] + (tiny_compile,)
    if args.bucket_cap_mb is not None or tiny:
        # one cap for every workload: the one asked for, or 1 MiB for the tiny model (~3.7 MB, one default
        # bucket; 1 MiB gives several). Not lower: DDPOptimizer asserts when the cap is under DDP's 1 MiB
        # first bucket.
        cap = args.bucket_cap_mb if args.bucket_cap_mb is not None else 1.0
        all_workloads = tuple(dataclasses.replace(w, bucket_cap_mb=cap) for w in all_workloads)
    workloads = args.workloads or ("comm" if preset == "quick" else ",".join(WORKLOAD_NAMES))
    wanted = [w.strip() for w in workloads.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in WORKLOAD_NAMES]
    if unknown or not wanted:
        raise ValueError(
            f"--workloads {workloads!r}: unknown {unknown}; use a comma list from {','.join(WORKLOAD_NAMES)}"
        )
    if args.profile_steps is not None and args.profile_steps < 0:
        raise ValueError(f"--profile-steps {args.profile_steps}: pass 0 (no profiling) or more")
    out_dir = args.out_dir or (REPO_ROOT / "bench_out" / preset)
    markdown = args.markdown or (REPO_ROOT / "BENCHMARKS.md" if preset == "full" else out_dir / "BENCHMARKS.md")
    return BenchConfig(
        workloads=tuple(w for w in all_workloads if w.name in wanted),
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        rounds=args.rounds or rounds,
        warmup=args.warmup or warmup,
        steps=args.steps or steps,
        backend=args.backend or ("aot_eager" if preset == "smoke" else "inductor"),
        world_size=args.world_size,
        optimizer=args.optimizer or ("sgd" if preset == "smoke" else "adamw"),
        lr=args.lr,
        seed=args.seed,
        loss_rtol=args.loss_rtol,
        param_rtol=args.param_rtol,
        # quick and smoke trade rigour for time: one (cold-cache) job per mode, overlap measured inside it,
        # no 1-rank jobs. The full preset keeps every job kind.
        cold_warm=not args.no_cold_warm and preset == "full",
        scaling=not args.no_scaling and preset == "full",
        overlap=not args.no_overlap,
        overlap_in_main_job=preset != "full" and not args.no_overlap,
        profile_steps=args.profile_steps if args.profile_steps is not None else (1 if preset == "smoke" else 2),
        plot=not args.no_plot,
        # full: the compile workload's cold Inductor compiles (12 blocks, ~40 pieces, the in-backward
        # variant at update 2) take many minutes on 2 cores
        timeout_s=args.timeout or (300.0 if tiny else 1800.0),
        out_dir=out_dir.resolve(),
        markdown=markdown.resolve(),
        preset=preset,
        command=command,
        link_gbit=args.link_gbit,
        comm_hook=None if args.comm_hook == "none" else args.comm_hook,
        reduce_dtype=args.reduce_dtype,
        compile_mode=None if args.compile_mode == "default" else args.compile_mode,
        autocast=None if args.autocast == "none" else args.autocast,
        nested_regions=args.nested_regions,
        compile_threads=_resolve_threads(args.compile_threads),
    )


def _resolve_threads(value: int | str | None) -> int | None:
    if value != AUTO_THREADS:
        return value  # type: ignore[return-value]
    import torch

    return None if torch.cuda.is_available() else 1


def config_from_json(
    data: dict, *, markdown: Path | None, plot: bool = True, out_dir: Path | None = None
) -> BenchConfig:
    """The BenchConfig an earlier run recorded in its results.json (older runs: SGD, no profiler, the model's
    shape recorded flat); `markdown` and `out_dir` replace the recorded ones when given."""
    raw = dict(data["config"])
    raw.pop("optimizer_kwargs", None)  # derived from optimizer and lr
    raw["workloads"] = tuple(Workload.from_dict(w) for w in raw["workloads"])
    raw["modes"] = tuple(raw["modes"])
    raw["out_dir"] = out_dir.resolve() if out_dir is not None else Path(raw["out_dir"])
    raw["markdown"] = markdown or (Path(raw["markdown"]) if raw.get("markdown") else None)
    raw["plot"] = plot and raw.get("plot", True)
    if "optimizer" not in raw and raw.get("lr") == 0.05:
        raw["lr"] = None  # runs before --optimizer recorded SGD's default lr; keep it the default
    return BenchConfig(**raw)


def _publish(cfg: BenchConfig, jobs: list[dict]) -> None:
    from benchmarks.report import aggregate, all_tables, plot_step_ms, write_json, write_report

    result = aggregate(cfg, jobs)
    json_path = write_json(result, cfg.out_dir / "results.json")
    chart = plot_step_ms(result, cfg.out_dir / "step_ms.png") if cfg.plot else None
    print()
    print(all_tables(result, timing_claims=cfg.preset != "smoke"))
    print(f"\nJSON: {json_path}" + (f"\nchart: {chart}" if chart else ""))
    if cfg.markdown is not None:
        write_report(result, chart=chart, json_path=json_path, md_path=cfg.markdown, out_dir=cfg.out_dir)
        print(f"report: {cfg.markdown} (generated part replaced; text outside its markers kept)")


def _markdown_problem(markdown: Path | None) -> bool:
    """The report's generated:begin/end markers are broken (checked before any job: it is written last)."""
    from benchmarks.markers import check_markdown

    try:
        if markdown is not None:
            check_markdown(markdown)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return True
    return False


def _missing_dependencies(plot: bool) -> bool:
    problems = missing(plot=plot)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return bool(problems)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["nodes"]:  # 1 node x 2 ranks vs 2 nodes x 1 rank, and a restart (benchmarks/nodes.py)
        from benchmarks import nodes

        return nodes.main(argv[1:])
    args = build_parser().parse_args(argv)
    # before anything slow: a missing package must not fail the run after minutes of measurements
    if _missing_dependencies(plot=not args.no_plot):
        return 2
    if args.render is not None:
        if not args.render.is_file():
            print(f"error: --render {args.render}: no such results.json; pass the file a run wrote", file=sys.stderr)
            return 2
        data = json.loads(args.render.read_text())
        cfg = config_from_json(data, markdown=args.markdown, plot=not args.no_plot, out_dir=args.out_dir)
        if _markdown_problem(cfg.markdown):
            return 2
        _publish(cfg, data["jobs"])
        return 0
    try:
        cfg = config_from_args(args, command="python -m benchmarks " + shlex.join(argv))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if _markdown_problem(cfg.markdown):
        return 2
    if cfg.link_gbit is not None:  # before the first job: a run must not fail on its link halfway through
        from benchmarks.link import unavailable_reason

        problem = unavailable_reason(cfg.link())
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    from benchmarks.suite import run_suite

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"benchmark ({cfg.preset}): {len(cfg.workloads)} workload(s) x {len(cfg.modes)} modes x "
        f"{cfg.rounds} round(s), backend {cfg.backend}, {cfg.describe_optimizer()}; output in {cfg.out_dir}",
        flush=True,
    )
    jobs = run_suite(cfg, log=lambda line: print(line, flush=True))
    _publish(cfg, jobs)
    return 0
