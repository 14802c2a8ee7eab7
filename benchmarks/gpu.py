"""`python -m benchmarks.gpu`: the GPU benchmark of issue 34 in one device call (about 9 minutes).

Every mode runs as its own one-rank job (world size 1: nccl on a GPU, gloo on the CPU) in three phases:

- A, cold: every job starts at once (or `--parallel N` at a time), each with an empty Inductor cache of its
  own, and runs its warm-up steps; the compiles share the machine's cores, so the time to the end of step 2
  is measured under that contention (said so in the table). Each job then waits at its gate
  (benchmarks/gate.py).
- B, timed: the orchestrator lets one job at a time through: its timed steps and then its profiled steps
  (torch.profiler with CUDA: kernels, GPU-busy ms, graph calls per step; benchmarks/kernels.py), then one
  step under the memory profiler (what is live at its peak, by kind: benchmarks/memory_peak.py) run with
  nothing else on the device; the other jobs sleep at their gates.
- C, warm start-up (`--warm-modes`): while time is left, a fresh process per listed mode on the cache phase A
  filled, alone: the warm time to the end of step 2. With `--profile-warm`, one more such process per mode
  runs its first two steps under cProfile and reports its top functions (where a cache hit still spends its
  time; the profiler slows Python, so its own time to step 2 is not the warm figure).

A budget (`--budget-s`, default 540 s) bounds the whole: phase A ends in time to leave phase B its share
(`--reserve-s` per job), a job not ready then is killed and reported as failed, and no phase starts work it
cannot finish. Each phase prints a budget line. Out, under `--out-dir` (default `$OUT`, else `gpu_out`):
`results_<precision>.json` per precision, `gpu_<precisions>.md` (the BENCHMARKS.md GPU block of this run) and
`logs_<precisions>.tgz` (every job's spec, log and result); `--tag T` adds `_T` to the names.
`--render A.json [B.json] --markdown BENCHMARKS.md` writes the block of one or more runs (fp32, bf16) between the
file's `generated-gpu` markers and runs nothing.

On a machine without CUDA the same script runs on the CPU (tiny sizes for a test; the CPU proxy of issue 34,
item 6): gloo, no CUDA peak, and kernels are the host's leaf compute ops with Inductor's C++ kernels made
visible to the profiler (`TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.cli import _batch, _compile_threads
from benchmarks.config import MODES, OPTIMIZERS, BenchConfig
from benchmarks.gpu_phases import Budget, Entry, run_phases
from benchmarks.runner import WORKER
from benchmarks.workloads import Workload

GPU_MODES = (
    "eager",
    "torch_savvy",
    "torch_fused",
    "torch_ddpopt",
    "ours_compile",
    "ours_step",
    "ours_step_in_graph",
    "ours_step_in_backward",
)
"""Issue 34's modes, in table order."""
WARM_MODES = ("torch_savvy", "ours_step_in_graph", "ours_step_in_backward")
"""Phase C's default: PyTorch's best and our one-graph steps (issue 34, item 3: warm start-up)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--precision",
        default="fp32",
        help="fp32, bf16 (torch.autocast(bfloat16) around forward and loss) or fp32,bf16: both in one run, every "
        "job's cold compile side by side, one table each",
    )
    p.add_argument(
        "--modes",
        default=",".join(GPU_MODES),
        help=f"comma list from {','.join(MODES)}; MODE@PRECISION runs that mode at that precision only",
    )
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--compute-batch", type=_batch, default=(8, 256), help="BATCHxSEQ (default 8x256)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket cap (default DDP's 25 MiB)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument(
        "--foreach",
        action="store_true",
        help="build the optimizer with foreach=True (its default on CUDA; on the CPU torch picks the per-tensor loop)",
    )
    p.add_argument(
        "--host-profile-steps",
        type=int,
        default=3,
        help="steps after the timed ones under cProfile: where a steady step's host time goes, per mode (0: none)",
    )
    p.add_argument(
        "--back-to-back-steps",
        type=int,
        default=10,
        help="steps after the timed ones with no sync between them, timed together: a loop's ms per step (0: none)",
    )
    p.add_argument("--backend", default="inductor")
    p.add_argument(
        "--compile-mode", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (>= 2: start-up is read to step 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps after the timed ones")
    p.add_argument("--parallel", type=int, default=0, help="cold compiles side by side (0: every mode at once)")
    p.add_argument(
        "--compile-threads",
        default="auto",
        metavar="auto|torch|N",
        help="TORCHINDUCTOR_COMPILE_THREADS per job (auto: the CPU count / --parallel, at least 1)",
    )
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    p.add_argument("--reserve-s", type=float, default=12.0, help="phase-B seconds kept per job while A runs")
    p.add_argument(
        "--warm-modes",
        default=",".join(WARM_MODES),
        help="phase C: warm start-up of these modes while time is left ('' for none)",
    )
    p.add_argument(
        "--profile-warm",
        action="store_true",
        help="phase C: after each warm start-up, one more under cProfile (its first two steps' top functions)",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=None, help="default $OUT, else ./gpu_out")
    p.add_argument("--tag", default=None, help="a suffix for the output names")
    p.add_argument("--render", type=Path, nargs="+", default=None, metavar="RESULTS_JSON")
    p.add_argument("--markdown", type=Path, default=None, help="with --render: the file whose GPU block is written")
    return p


# -- the run (its phases: benchmarks/gpu_phases.py) ----------------------------------------------------


def _config(
    args: argparse.Namespace, modes: tuple[str, ...], threads: int | None, command: str, precision: str
) -> BenchConfig:
    from examples.gpt_config import GPTConfig

    model = GPTConfig.preset(
        "bench", d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab
    )
    b, t = args.compute_batch
    workload = Workload(name="compute", model=model, batch=b, seq_len=t, bucket_cap_mb=args.bucket_cap_mb)
    return BenchConfig(
        workloads=(workload,),
        modes=modes,
        rounds=1,
        warmup=args.warmup,
        steps=args.steps,
        backend=args.backend,
        world_size=1,
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        cold_warm=False,
        scaling=False,
        overlap=False,
        profile_steps=args.profile_steps,
        plot=False,
        timeout_s=args.budget_s,
        preset="full",
        command=command,
        compile_mode=None if args.compile_mode in (None, "default") else args.compile_mode,
        autocast=None if precision == "fp32" else precision,
        compile_threads=threads,
    )


# -- outputs -------------------------------------------------------------------------------------------


def _machine(jobs: list[dict[str, Any]], device: str) -> dict[str, Any]:
    ok = [j["ranks"][0] for j in jobs if j["ok"] and j["ranks"]]
    versions = dict(ok[0].get("versions") or {}) if ok else {}
    name = versions.pop("device_name", None)
    return {
        "device_name": name or ("CPU" if device == "cpu" else None),
        "versions": {"torch": versions.get("torch"), "CUDA": versions.get("cuda"), "Triton": versions.get("triton")},
        "pg_backend": ok[0].get("pg_backend") if ok else None,
        "cpu_count": os.cpu_count(),
    }


def build_result(
    cfg: BenchConfig, args: argparse.Namespace, jobs, *, tag: str, device: str, phases, threads_text: str, parallel: int
) -> dict[str, Any]:
    """One precision's results: its config, the machine, the run's phases, per-mode rows and raw jobs."""
    from benchmarks.gpu_report import aggregate

    jobs = [j for j in jobs if j.get("tag") == tag]
    w = cfg.workloads[0]
    config = {
        "precision": tag,
        "autocast": cfg.autocast,
        "modes": list(cfg.modes),
        "model": w.describe(),
        "optimizer": cfg.describe_optimizer() + (" foreach=True" if args.foreach else ""),
        "backend": cfg.backend,
        "compile_mode": cfg.compile_mode,
        "warmup": cfg.warmup,
        "steps": cfg.steps,
        "profile_steps": cfg.profile_steps,
        "parallel": parallel,
        "compile_threads_text": threads_text,
        "budget_s": args.budget_s,
        "command": cfg.command,
    }
    return {
        "kind": "gpu_bench",
        "device": device,
        "config": config,
        "machine": _machine(jobs, device),
        "phases": [{k: p[k] for k in ("name", "budget_s", "spent_s", "note", "summary") if k in p} for p in phases],
        "modes": aggregate(config, jobs),
        "jobs": jobs,
    }


LOG_TAIL_BYTES = 1 << 20
"""The most of one file that goes into the logs archive (its end): a device call brings back 16 MiB a file."""


def _pack_logs(work: Path, path: Path) -> None:
    """Every job's spec, rank log and rank result, each cut to its last `LOG_TAIL_BYTES`."""
    with tarfile.open(path, "w:gz") as tar:
        for log in sorted((work / "jobs").glob("*/*")):
            if log.suffix not in (".log", ".json"):
                continue
            data = log.read_bytes()[-LOG_TAIL_BYTES:]
            info = tarfile.TarInfo(str(log.relative_to(work / "jobs")))
            info.size = len(data)
            info.mtime = int(log.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))


def _render(args: argparse.Namespace) -> int:
    from benchmarks.gpu_report import merge_gpu_section, section

    results = []
    for path in args.render:
        if not path.is_file():
            print(f"error: --render {path}: no such file", file=sys.stderr)
            return 2
        results.append(json.loads(path.read_text()))
    block = section(results)
    print(block)
    if args.markdown is not None:
        previous = args.markdown.read_text() if args.markdown.is_file() else None
        args.markdown.write_text(merge_gpu_section(previous, block, where=str(args.markdown)))
        print(f"report: {args.markdown} (its generated-gpu block replaced; the rest kept)")
    return 0


def _modes_at(text: str, precisions: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """`--modes` per precision: a plain mode runs at every precision, `MODE@PRECISION` at that one only (a
    variant worth its device time in one precision)."""
    out: dict[str, list[str]] = {p: [] for p in precisions}
    for item in (m.strip() for m in text.split(",")):
        if not item:
            continue
        mode, at, only = item.partition("@")
        if at and only not in precisions:
            raise ValueError(f"--modes {item!r}: {only!r} is not one of this run's precisions {list(precisions)}")
        for p in precisions:
            if (not at or p == only) and mode not in out[p]:
                out[p].append(mode)
    if not any(out.values()):
        raise ValueError(f"--modes {text!r}: no mode")
    return {p: tuple(m) for p, m in out.items()}


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here")
    return choice


def main(argv: list[str] | None = None, *, worker: tuple[str, ...] = WORKER) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.render:
        return _render(args)
    precisions = tuple(dict.fromkeys(p.strip() for p in args.precision.split(",") if p.strip()))
    if not precisions or set(precisions) - {"fp32", "bf16"}:
        print(f"error: --precision {args.precision!r}: use fp32, bf16 or fp32,bf16", file=sys.stderr)
        return 2
    try:
        modes_at = _modes_at(args.modes, precisions)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    precisions = tuple(p for p in precisions if modes_at[p])  # a precision left without modes runs nothing
    modes = tuple(dict.fromkeys(m for p in precisions for m in modes_at[p]))
    if args.warmup < 2:
        print("error: --warmup must be >= 2 (start-up is read to the end of step 2)", file=sys.stderr)
        return 2
    jobs_total = sum(len(modes_at[p]) for p in precisions)
    parallel = args.parallel if args.parallel > 0 else jobs_total
    if args.compile_threads == "auto":
        threads: int | None = max(1, (os.cpu_count() or 1) // max(1, min(parallel, jobs_total)))
    else:
        try:
            threads = _compile_threads(args.compile_threads)
        except argparse.ArgumentTypeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    threads_text = "torch's default compile threads" if threads is None else f"TORCHINDUCTOR_COMPILE_THREADS={threads}"
    command = "python -m benchmarks.gpu " + shlex.join(argv)
    try:
        device = _device(args.device)
        cfgs = {p: _config(args, modes_at[p], threads, command, p) for p in precisions}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the ranks' own choice of device follows what they see
        os.environ.setdefault("TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE", "1")  # C++ kernels seen by the profiler
    out_dir = (args.out_dir or Path(os.environ.get("OUT") or "gpu_out")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    name = "_".join(precisions) + suffix
    budget = Budget(args.budget_s, log=lambda line: print(line, flush=True))
    first = cfgs[precisions[0]]
    budget.log(
        f"gpu bench ({', '.join(precisions)}, {device}): {len(modes)} modes, {first.workloads[0].describe()}, "
        f"{first.describe_optimizer()}, {parallel} cold compile(s) side by side, {threads_text}"
    )
    # precision-major: with --parallel below the job count, a whole precision compiles before the next
    entries = [
        Entry(p, m, cfgs[p], args.foreach, args.host_profile_steps, args.back_to_back_steps)
        for p in precisions
        for m in modes_at[p]
    ]
    warm_names = {m.strip() for m in args.warm_modes.split(",") if m.strip()}
    warm = [e for e in entries if e.tag == precisions[0] and e.mode in warm_names]  # start-up: first precision
    work = Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    try:
        jobs = run_phases(
            entries,
            parallel=parallel,
            reserve_s=args.reserve_s,
            warm=warm,
            budget=budget,
            work=work,
            worker=worker,
            profile_warm=args.profile_warm,
        )
        results = [
            build_result(
                cfgs[p],
                args,
                jobs,
                tag=p,
                device=device,
                phases=budget.phases,
                threads_text=threads_text,
                parallel=min(parallel, jobs_total),
            )
            for p in precisions
        ]
        _pack_logs(work, out_dir / f"logs_{name}.tgz")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from benchmarks.gpu_report import console_details, section

    paths = []
    for p, result in zip(precisions, results):
        paths.append(out_dir / f"results_{p}{suffix}.json")
        paths[-1].write_text(json.dumps(result, indent=1, default=str))
    block = section(results)
    md = out_dir / f"gpu_{name}.md"
    md.write_text(block)
    print("\n".join(console_details(zip(precisions, results))))
    print()
    print(block)
    print(f"JSON: {' '.join(map(str, paths))}")
    print(f"markdown: {md} (into BENCHMARKS.md: python -m benchmarks.gpu --render JSON... --markdown BENCHMARKS.md)")
    print(f"total {budget.at():.0f} s of {args.budget_s:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
