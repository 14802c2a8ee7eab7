"""One rank of one benchmark job: `python -m benchmarks.worker SPEC.json` with RANK/WORLD_SIZE/MASTER_* set.

Writes `rank{R}.json` next to the spec, success or failure; exits non-zero on failure so the runner can stop
the other ranks instead of letting them wait in a collective.
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gate import Gate


def _init_process_group(rank: int, world_size: int, timeout_s: float) -> tuple[Any, str]:
    import torch
    import torch.distributed as dist

    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    backend = "nccl" if use_nccl else "gloo"
    device = torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return device, backend


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_peak_mb(device) -> float | None:
    """GPU memory the timed steps allocated at most (on GPU ranks the RSS peak misses the device memory)."""
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def run(spec: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from benchmarks import memory
    from benchmarks.bracket_modes import BRACKET_BUILDERS
    from benchmarks.breakdown import StepClock
    from benchmarks.checksum import param_checksum
    from benchmarks.config import IN_GRAPH_MODES
    from benchmarks.mode_context import ModeContext
    from benchmarks.modes import BUILDERS, configure_dynamo, make_optimizer
    from examples.gpt import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)  # one core per rank: 2 ranks share the 2 cores of the dev machine
    mode = spec["mode"]
    device, pg_backend = _init_process_group(rank, world_size, spec["timeout_s"])
    configure_dynamo(mode)

    cfg = GPTConfig(**spec["gpt"])
    torch.manual_seed(spec["seed"])
    model = GPT(cfg, regions=bool(spec.get("nested_regions"))).to(device)
    ddp = None if mode == "floor" else _make_ddp(model, device, spec)  # floor: no DDP, no reducer hooks at all
    optimizer = make_optimizer(spec["optimizer"], model.parameters(), spec["optimizer_kwargs"])

    # the fingerprint of the final parameters is taken against these (see benchmarks/checksum.py)
    initial = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    recorder = None
    # in-graph modes bypass DDP's comm hooks; a registered --comm-hook holds DDP's one hook slot
    if spec["record_overlap"] and mode not in IN_GRAPH_MODES and not spec.get("comm_hook"):
        from ddp.overlap import OverlapRecorder

        recorder = OverlapRecorder.attach(ddp)
    mark = recorder.mark_backward_start if recorder is not None else (lambda: None)
    reduce_dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.get("reduce_dtype")]
    autocast = {None: None, "bf16": torch.bfloat16}[spec.get("autocast")]
    step = {**BUILDERS, **BRACKET_BUILDERS}[mode](
        ModeContext(
            ddp=ddp,
            model=model,
            optimizer=optimizer,
            backend=spec["backend"],
            mark_backward=mark,
            comm_hook=spec.get("comm_hook"),
            reduce_dtype=reduce_dtype,
            compile_mode=spec.get("compile_mode"),
            autocast=autocast,
        )
    )

    warmup, steps, profiled = spec["warmup"], spec["steps"], spec.get("profile_steps", 0)
    # the GPU benchmark's jobs compile side by side, then wait here for their turn to be timed alone
    gate = Gate(spec["gate_dir"]) if spec.get("gate_dir") else None
    gate_after = min(int(spec.get("gate_after") or warmup), warmup)  # steps run before the gate (>= 2)
    gate_wait_s = None
    kernel_profile = bool(spec.get("kernel_profile"))
    kernel_error = None
    memory_steps = int(spec.get("memory_profile_steps") or 0)  # after all others: benchmarks/memory_peak.py
    # after the timed steps, before the kernel profile: a steady step's host Python under cProfile
    host_steps = int(spec.get("host_profile_steps") or 0)
    host_profile = cProfile.Profile() if host_steps else None
    # right after the timed steps: this many more with no sync between them (a training loop's pace, where the
    # host runs ahead and a step's lead hides behind the previous step's kernels), timed together
    back_to_back = int(spec.get("back_to_back_steps") or 0)
    back_to_back_ms = None
    # the first two steps under cProfile (a warm start-up's Python: where a cache hit still spends its time)
    startup = cProfile.Profile() if spec.get("startup_profile") else None

    def batch(i: int) -> tuple[torch.Tensor, ...]:
        made = synthetic_batch(cfg, spec["batch"], spec["seq_len"], step=i, rank=rank, seed=spec["seed"])
        return tuple(t.to(device) for t in made)

    batches = [batch(i) for i in range(warmup + steps + host_steps + profiled + memory_steps)]
    back_to_back_batches = [batch(len(batches) + i) for i in range(back_to_back)]

    def time_back_to_back() -> float:
        _sync(device)
        t0 = time.perf_counter()
        for bx, by in back_to_back_batches:
            step.run(bx, by)
        _sync(device)
        return 1e3 * (time.perf_counter() - t0) / len(back_to_back_batches)

    clock = StepClock()
    peaks = memory.PeakTracker()
    state_mb = None
    cuda_peak = None
    profiler = None
    step_s: list[float] = []
    host_s: list[float] = []  # until step.run returned, before the sync: the host's share of the step
    losses: list[float] = []
    with contextlib.ExitStack() as stack:
        for i, (x, y) in enumerate(batches[: len(batches) - memory_steps]):
            if gate is not None and 0 < i <= gate_after and device.type == "cuda":
                # many jobs share the GPU while they compile and wait: each holds only what is live between steps
                torch.cuda.empty_cache()
            if i == gate_after and gate is not None:
                gate.arrive({"first_step_s": step_s[0], "two_steps_s": sum(step_s[:2]), "warmup_s": sum(step_s)})
                gate_wait_s = gate.wait(spec["timeout_s"])
            if i == warmup:
                peaks.start_steady()  # the steady-state peak covers the timed steps only
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            if i == warmup + steps:
                peaks.stop_steady()
                cuda_peak = _cuda_peak_mb(device)
                # what the job holds between steps, before the profiler starts (it allocates for a moment)
                state_mb = memory.training_state_mb(model, optimizer, ddp)
                if back_to_back_batches:
                    back_to_back_ms = time_back_to_back()
            if i == warmup + steps + host_steps:
                # extra steps after the timed ones: never timed. The GPU benchmark's kernel profile may fail
                # (CUPTI missing, a torch that traces differently) without losing the job's timings
                try:
                    profiler = stack.enter_context(
                        _profiler(cuda=device.type == "cuda" and kernel_profile, memory=not kernel_profile)
                    )
                except Exception as err:
                    if not kernel_profile:
                        raise
                    kernel_error = f"the profiler did not start: {type(err).__name__}: {err}"
            mark_step = profiler.mark_step() if profiler is not None else contextlib.nullcontext()
            profiling_startup = startup is not None and i < 2
            cprofile = startup if profiling_startup else None
            if host_profile is not None and warmup + steps <= i < warmup + steps + host_steps:
                cprofile = host_profile
            clock.start()
            _sync(device)
            if cprofile is not None:
                cprofile.enable()
            t0 = time.perf_counter()
            with mark_step:
                loss = step.run(x, y)
            host_s.append(time.perf_counter() - t0)
            if cprofile is not None:
                cprofile.disable()  # the host's own work: not the wait for the device below
            _sync(device)
            step_s.append(time.perf_counter() - t0)
            clock.stop(step_s[-1])
            losses.append(float(loss))  # outside the timed region
    if back_to_back_batches and back_to_back_ms is None:  # no step after the timed ones came to run them
        back_to_back_ms = time_back_to_back()
    if profiled == 0 and host_steps == 0:
        peaks.stop_steady()
        cuda_peak = _cuda_peak_mb(device)
    memory_at_peak = None
    for x, y in batches[len(batches) - memory_steps :]:  # the last such step is the one reported
        if state_mb is None:
            state_mb = memory.training_state_mb(model, optimizer, ddp)
        memory_at_peak, loss = _memory_at_peak(step, x, y, device, state_mb)
        losses.append(float(loss))

    # report() reads the other ranks' compile summaries from the store that rank 0 hosts: every rank reads
    # it before the all-reduce below, which no rank leaves before all have arrived
    info = step.info()
    final = torch.tensor([losses[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(final)
    timed = step_s[warmup : warmup + steps]
    result: dict[str, Any] = {
        "ok": True,
        "mode": mode,
        "rank": rank,
        "world_size": world_size,
        "pg_backend": pg_backend,
        "device": str(device),
        "first_step_s": step_s[0],
        "warmup_s": sum(step_s[:warmup]),
        # what a user waits for before training runs at speed: a mode may move compiles to update 2
        # (the optimizer-in-backward variant), so start-up is read to the end of step 2
        "two_steps_s": sum(step_s[:2]) if len(step_s) >= 2 else None,
        "step_ms": [1e3 * s for s in timed],
        "median_step_ms": 1e3 * statistics.median(timed),
        "median_host_ms": 1e3 * statistics.median(host_s[warmup : warmup + steps]),
        "back_to_back_ms": back_to_back_ms,
        "gate_wait_s": gate_wait_s,
        "versions": _versions(device),
        "profiled_step_ms": [1e3 * s for s in step_s[warmup + steps + host_steps :]],
        "losses": losses,
        "final_loss": float(final.item()) / world_size,
        "param_checksum": param_checksum(dict(model.named_parameters()), initial),
        "peak_rss_mb": peaks.process_peak_mb(),
        "steady_peak_rss_mb": peaks.steady_mb,
        "steady_growth_rss_mb": peaks.growth_mb,
        "steady_peak_cuda_mb": cuda_peak,
        "compile": clock.summary(warmup),
        "info": info,
    }
    if memory_at_peak is not None:
        result["memory_at_peak"] = memory_at_peak
    if startup is not None or host_profile is not None:
        from benchmarks.breakdown import top_functions

        if startup is not None:
            result["startup_profile"] = {"two_steps_s": result["two_steps_s"], **top_functions(startup)}
        if host_profile is not None:
            result["host_profile"] = {"steps": host_steps, **top_functions(host_profile)}
    if kernel_profile:
        result["kernels"] = _kernels(profiler, kernel_error)
        result["state_mb"] = state_mb  # what the job held between steps, by kind (benchmarks/memory.py)
    if profiler is not None and not kernel_profile:
        result["profile"] = {
            **_profile_result(profiler.events(), spec, rank, pg_backend, result["info"]),
            "state_mb": state_mb,
        }
    if recorder is not None:
        result["overlap"] = _overlap_result(recorder, spec, rank, result["info"])
    elif spec["record_overlap"] and mode in IN_GRAPH_MODES:
        result["overlap"] = {
            "recorded": False,
            "reason": "ddp='in_graph': the compiled backward all-reduces, DDP's "
            "comm hooks see nothing (see the profiler columns)",
        }
    elif spec["record_overlap"]:
        result["overlap"] = {
            "recorded": False,
            "reason": f"comm hook {spec['comm_hook']}: DDP takes one comm hook, "
            "so the recorder's cannot be registered (see the profiler columns)",
        }
    dist.barrier()  # rank 0 hosts the store: it exits (os._exit) only once no rank can still need it
    return result


def _make_ddp(model, device, spec: dict[str, Any]):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_kwargs = {} if spec["bucket_cap_mb"] is None else {"bucket_cap_mb": spec["bucket_cap_mb"]}
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    if spec.get("comm_hook") == "fp16" and spec["mode"] != "comm_only":  # comm_only all-reduces fp16 itself
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


def _profiler(*, cuda: bool, memory: bool):
    from benchmarks.profile_overlap import StepProfiler

    return StepProfiler(cuda=cuda, memory=memory, tolerant=not memory)


def _kernels(profiler, error: str | None) -> dict[str, Any]:
    """The GPU benchmark's per-step kernel figures (benchmarks/kernels.py), or why there are none."""
    error = error or (profiler.error if profiler is not None else "no step was profiled")
    if error:
        return {"measured": False, "reason": error}
    try:
        from benchmarks.kernels import summarize_kernels

        return summarize_kernels(profiler.events())
    except Exception as err:  # a trace this code cannot read must not cost the job its timings
        return {"measured": False, "reason": f"reading the trace failed: {type(err).__name__}: {err}"}


def _memory_at_peak(step, x, y, device, held: dict[str, float]) -> tuple[dict[str, Any], Any]:
    """One step under the memory profiler, its peak taken apart by kind (benchmarks/memory_peak.py), and the
    step's loss. A trace this code cannot read costs the job this figure only; a failing step fails the job."""
    import tempfile

    from benchmarks.memory_peak import profiled_peak

    fd, path = tempfile.mkstemp(prefix="memory_step_", suffix=".json")
    os.close(fd)
    out: list[Any] = []

    def run_step() -> None:
        out.append(step.run(x, y))
        _sync(device)

    where = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    try:
        found = profiled_peak(run_step, device=where, held=held, trace_path=path)
    except Exception as err:
        if not out:  # the step itself failed: that is the job's error
            raise
        found = {"measured": False, "reason": f"reading the memory profile failed: {type(err).__name__}: {err}"}
    finally:
        Path(path).unlink(missing_ok=True)
    return found, out[0]


def _versions(device) -> dict[str, Any]:
    """torch, CUDA and Triton versions and the device's name: which stack produced these figures."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        try:
            import triton

            out["triton"] = triton.__version__
        except ImportError:
            out["triton"] = None
    return out


def _profile_result(events, spec: dict[str, Any], rank: int, pg_backend: str, info: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.config import IN_GRAPH_MODES
    from benchmarks.profile_overlap import label_buckets, summarize

    out = summarize(events)
    if pg_backend != "gloo" and out.get("measured"):
        # nccl's host-side events mark enqueueing, not completion (benchmarks/profile_overlap.py, Limitation)
        out = {
            "measured": False,
            "reason": f"{pg_backend}: profiler overlap is measured on gloo only",
            "tensor_peak_mb": out.get("tensor_peak_mb"),
        }
    if out.get("measured"):
        out["last_step"] = label_buckets(out["last_step"], info.get("in_graph_buckets"))
        if rank == 0 and spec.get("timeline_png") and spec.get("plot", True) and spec["mode"] in IN_GRAPH_MODES:
            from ddp.overlap.plot import plot_timeline

            title = f"{spec['mode']} / {spec['workload']} (from the profiler)"
            out["timeline_png"] = str(plot_timeline(out["last_step"], spec["timeline_png"], title=title))
    return out


def _overlap_result(recorder, spec: dict[str, Any], rank: int, info: dict[str, Any]) -> dict[str, Any]:
    from ddp.overlap import check_alignment

    if not recorder.steps():
        why = (
            "DDP's python reducer reduces per parameter under compiled autograd: no buckets to time"
            if recorder.bypassed
            else "no comm-hook call seen"
        )
        return {"recorded": False, "reason": why}
    out: dict[str, Any] = {"recorded": True, **recorder.summary(skip_first=min(2, spec["warmup"]))}
    out["observed_buckets"] = recorder.observed_buckets()
    planned = info.get("planned_buckets")
    if planned:
        alignment = check_alignment(planned, out["observed_buckets"])
        out["alignment"] = alignment.to_dict()
        out["alignment_text"] = str(alignment)
    if rank == 0 and spec.get("timeline_png") and spec.get("plot", True):
        title = f"{spec['mode']} / {spec['workload']}"
        out["timeline_png"] = str(recorder.plot_timeline(spec["timeline_png"], title=title))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.worker SPEC.json  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)")
        return 2
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_path = spec_path.parent / f"rank{rank}.json"
    try:
        result = run(spec, rank, world_size)
        code = 0
    except BaseException as err:  # every failure becomes a result that names the mode and the rank
        from benchmarks.memory import process_peak_rss_mb
        from benchmarks.mode_context import ModeUnavailable

        unavailable = isinstance(err, ModeUnavailable)
        result = {
            "ok": False,
            "unavailable": unavailable,
            "mode": spec["mode"],
            "rank": rank,
            "error": f"{type(err).__name__}: {err}".strip()[:2000],
            "traceback": traceback.format_exc()[-8000:],
            "peak_rss_mb": process_peak_rss_mb(),
        }
        code = 3 if unavailable else 1
    out_path.write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a rank whose peer already died can block in process-group destruction.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
