"""Kernels, compiled-graph calls and host time per step, read from torch.profiler events (pure functions).

What the GPU benchmark (benchmarks/gpu.py) reports per mode, and the CPU proxy of it (issue 34, item 6).

Note [what is counted, GPU and CPU]
-----------------------------------
Steps are the host's `bench::step` marks (the worker wraps each profiled step in one and synchronises the
device after it, outside the mark). Step k owns the interval [start_k, start_k+1): everything the step
launched has started before the next mark begins, because of that synchronisation.

With CUDA traced (a GPU rank), a *kernel* is a CUDA-side event that is neither a copy or a fill
(`Memcpy ...`, `Memset ...`: counted apart as copies) nor the GPU copy of an annotation (kineto mirrors
record_function ranges onto the GPU timeline; `user_annotation` kinds, or names also seen as host
annotations where the kind is missing). Per step: how many, the sum of their durations (`kernel_ms`) and the
union of their intervals (`busy_ms`: the GPU was running something; equal to the sum on one stream).

On the CPU the host runs every kernel itself, so a kernel is a *leaf compute op*: an `aten::` op that is not a view,
an allocation or a metadata query (`NO_KERNEL_OPS`), or a oneDNN op (`EXTERN_CPU_OPS`), with no such op nested
inside it on its thread; a multi-tensor op (a foreach op, `aten::_foreach_*`, or torch's fused optimizer kernel,
`aten::_fused_adam_`/`_fused_adamw_`/`_fused_sgd_`) counted once, without the per-tensor ops it loops over on the
CPU (a GPU runs it as one or a few multi-tensor launches); or an Inductor C++ kernel (`cpp_fused_*`, visible
only with `TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`, which the GPU benchmark sets on CPU runs). That is roughly
one GPU launch per counted op: Inductor launches one kernel per fused kernel and calls the same extern ops (mm,
attention) on either device. `kernel_ms` is then the host's time inside those ops; the rest of the host step is the
framework's own time: Python, the dispatcher, guards, wrappers, the autograd engine. On a GPU that host time runs
ahead of the kernels and stays hidden only while it is shorter than the kernels it launches.

Both: `lead_ms` is the time from the step's start to its first kernel's start (a GPU idles that long at the
start of every step, which begins after the previous step's sync; on the CPU: host work before the first
compute op: guards, wrappers, checks). `graph_calls` counts `## Call CompiledFxGraph` marks (one per compiled
Inductor graph called: forward, backward or optimizer), `regions` the Dynamo frames entered
(`Torch-Compiled Region`), `scalar_reads` the `aten::_local_scalar_dense` calls (`.item()`: a device sync when
the tensor is on the GPU; on the CPU it cannot be told from a read of a CPU tensor such as the optimizer's step
count), and on a GPU `syncs` the host's CUDA synchronize calls inside the step. `host_ops` counts the
host's `aten::` ops in the step (nested ones included) and `host_top` names the most frequent. On the CPU,
`host_ops`, `host_top` and `scalar_reads` leave out the ops nested inside a multi-tensor op: the CPU kernel's
own loop over the tensors (a fused Adam reads each step count with `.item()` there, a foreach add runs one
`add_` per tensor), which the CUDA kernel does on the device; counted, a mode on torch's fused step showed
about 1200 host ops and 149 scalar reads per step more than the same mode compiling its update (149 parameters,
session 45), work its GPU run does not have. `idle_top`
lists the step's longest stretches without a kernel, with what the host had open when the next one started;
`scalar_read_where` says where the scalar reads were made (the host ranges open around each: outermost, innermost).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any, Iterable, Sequence

from benchmarks.profile_overlap import STEP_MARK, Event

NO_KERNEL_OPS = frozenset(
    "aten::" + name
    for name in (
        "empty empty_strided empty_like new_empty new_empty_strided as_strided view _unsafe_view view_as reshape "
        "_reshape_alias t transpose permute expand expand_as unsqueeze squeeze slice select narrow split "
        "split_with_sizes unbind chunk flatten unflatten detach detach_ alias lift_fresh resolve_conj resolve_neg "
        "contiguous to _to_copy clone zeros zeros_like ones ones_like full full_like result_type size stride "
        "numel is_nonzero set_ resize_ record_stream _local_scalar_dense item _has_compatible_shallow_copy_type "
        "lift lift_fresh_copy _unsafe_split _unsafe_split_with_sizes view_as_real view_as_complex _nested_tensor "
        "scalar_tensor"
    ).split()
)
"""aten ops that launch no kernel of their own (views, allocations, metadata, scalar reads), or only through an
op nested inside them (to, clone, zeros, ...: their copy_ / fill_ is counted)."""

CPP_KERNEL = re.compile(r"^(graph_\d+_)?cpp_")
"""An Inductor C++ kernel's profiler name with the kernel profile on (`graph_<id>_cpp_fused_...`)."""
EXTERN_CPU_OPS = ("mkldnn::", "onednn::")
"""Library kernels Inductor's CPU code calls outside aten (a linear with its pointwise epilogue: a GEMM, as
cuBLAS's would be on a GPU)."""
GRAPH_CALL = "## Call CompiledFxGraph"
REGION = "Torch-Compiled Region"
SCALAR_READ = "aten::_local_scalar_dense"
MULTI_TENSOR = ("aten::_foreach_", "aten::_fused_")
"""A foreach op or torch's fused optimizer kernel: one multi-tensor launch (per chunk of tensors) on a GPU; on
the CPU it loops over per-tensor ops, which are not counted again."""
COPY_PREFIXES = ("memcpy", "memset")
RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")
"""A CUDA runtime or driver call (cudaLaunchKernel, cuLaunchKernel, cudaStreamSynchronize): host-side."""
NON_OP_KINDS = frozenset({"user_annotation", "gpu_user_annotation", "python_function"})


HOST_OPS_SCOPE = "outside multi-tensor ops"
"""How a CPU step's host ops and scalar reads are counted (the module Note), recorded with them."""


def _is_device(e: Event) -> bool:
    return e.device != "cpu"


def _is_copy(e: Event) -> bool:
    return e.kind in ("gpu_memcpy", "gpu_memset") or e.name.lower().startswith(COPY_PREFIXES)


def gpu_kernels(events: Iterable[Event], host_annotations: frozenset[str]) -> list[Event]:
    """The device events that are kernels (see the module Note)."""
    out = []
    for e in events:
        if not _is_device(e) or _is_copy(e) or e.kind in NON_OP_KINDS:
            continue
        if not e.kind and (e.name in host_annotations or RUNTIME_CALL.match(e.name)):
            continue  # a mirrored annotation or a runtime call, on a torch that does not say the kind
        if e.kind in ("", "kernel", "concurrent_kernel"):
            out.append(e)
    return out


def _is_cpu_candidate(e: Event) -> bool:
    if _is_device(e) or e.kind in NON_OP_KINDS:
        return False
    if CPP_KERNEL.match(e.name):
        return True
    if e.name.startswith(EXTERN_CPU_OPS):
        return True
    return e.name.startswith("aten::") and e.name not in NO_KERNEL_OPS


def cpu_leaf_kernels(events: Iterable[Event]) -> list[Event]:
    """Leaf compute ops on the host (see the module Note): candidates with no candidate nested inside."""
    by_thread: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if _is_cpu_candidate(e):
            by_thread[e.thread].append(e)
    leaves = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start_us, -e.end_us))
        counted = [True] * len(evs)
        stack: list[int] = []  # indices of open candidates, outermost first
        for i, e in enumerate(evs):
            while stack and evs[stack[-1]].end_us < e.start_us:
                stack.pop()
            inside = [j for j in stack if e.end_us <= evs[j].end_us]
            if any(evs[j].name.startswith(MULTI_TENSOR) for j in inside):
                counted[i] = False  # a per-tensor op of a multi-tensor op: the multi-tensor op is the kernel
            elif inside:
                counted[inside[-1]] = False
            stack.append(i)
        leaves.extend(e for e, keep in zip(evs, counted) if keep)
    return leaves


def outside_multi_tensor(host: Iterable[Event]) -> list[Event]:
    """The host events not nested inside a multi-tensor op on their thread (the CPU kernel's own loop; the
    module Note)."""
    by_thread: dict[int, list[Event]] = defaultdict(list)
    for e in host:
        by_thread[e.thread].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start_us, -e.end_us))
        open_until = float("-inf")  # the end of the multi-tensor op the sweep is inside
        for e in evs:
            if e.start_us <= open_until and e.end_us <= open_until:
                continue
            out.append(e)
            if e.name.startswith(MULTI_TENSOR):
                open_until = e.end_us
    return out


def union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start_us, end_us) intervals, in ms."""
    total = 0.0
    end = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def step_kernel_stats(events: Sequence[Event]) -> list[dict[str, Any]]:
    """One dict per profiled step (see the module Note); empty when no step was marked."""
    marks = sorted((e for e in events if e.name == STEP_MARK and not _is_device(e)), key=lambda e: e.start_us)
    if not marks:
        return []
    annotations = frozenset(e.name for e in events if not _is_device(e) and e.kind in ("", "user_annotation"))
    traced_gpu = any(_is_device(e) for e in events)
    kernels_all = gpu_kernels(events, annotations) if traced_gpu else []
    out = []
    for k, mark in enumerate(marks):
        lo = mark.start_us
        hi = marks[k + 1].start_us if k + 1 < len(marks) else float("inf")
        host = [e for e in events if not _is_device(e) and mark.start_us <= e.start_us <= mark.end_us]
        # the CPU's loops inside multi-tensor ops are device work on a GPU (module Note); a GPU rank's host
        # events are all host work
        issued = host if traced_gpu else outside_multi_tensor(host)
        row: dict[str, Any] = {
            "step": k,
            "host_ms": (mark.end_us - mark.start_us) / 1e3,
            "graph_calls": sum(e.name.startswith(GRAPH_CALL) for e in host),
            "regions": sum(e.name.startswith(REGION) for e in host),
            "scalar_reads": sum(e.name == SCALAR_READ for e in issued),
            "lead_ms": None,
        }
        row["host_ops"] = sum(e.name.startswith("aten::") for e in issued)
        row["host_top"] = _top_host_ops(issued)
        row["scalar_read_where"] = scalar_read_where([e for e in issued if e.name == SCALAR_READ], host)
        if traced_gpu:
            mine = [e for e in kernels_all if lo <= e.start_us < hi]
            copies = [e for e in events if _is_device(e) and _is_copy(e) and lo <= e.start_us < hi]
            row.update(
                device="cuda",
                lead_ms=(min(e.start_us for e in mine) - lo) / 1e3 if mine else None,
                kernels=len(mine),
                kernel_ms=sum(e.end_us - e.start_us for e in mine) / 1e3,
                busy_ms=union_ms((e.start_us, e.end_us) for e in mine),
                copies=len(copies),
                syncs=sum("Synchronize" in e.name for e in host),
                top=_top(mine),
                idle_top=idle_gaps(mine, host, lo),
            )
        else:
            mine = cpu_leaf_kernels(host)
            row.update(
                device="cpu",
                lead_ms=(min(e.start_us for e in mine) - lo) / 1e3 if mine else None,
                kernels=len(mine),
                kernel_ms=sum(e.end_us - e.start_us for e in mine) / 1e3,
                cpp_kernels=sum(bool(CPP_KERNEL.match(e.name)) for e in mine),
                top=_top(mine),
                idle_top=idle_gaps(mine, host, lo),
            )
        out.append(row)
    return out


def _top(kernels: Sequence[Event], n: int = 8) -> list[dict[str, Any]]:
    """The n kernel names with the most time in the step: name (cut to 90 characters), calls, ms."""
    calls: dict[str, int] = defaultdict(int)
    ms: dict[str, float] = defaultdict(float)
    for e in kernels:
        calls[e.name] += 1
        ms[e.name] += (e.end_us - e.start_us) / 1e3
    names = sorted(ms, key=lambda name: -ms[name])[:n]
    return [{"name": name[:90], "calls": calls[name], "ms": round(ms[name], 3)} for name in names]


def idle_gaps(kernels: Sequence[Event], host: Sequence[Event], start_us: float, n: int = 6) -> list[dict[str, Any]]:
    """The n longest stretches of the step with no kernel running, longest first: `at_ms` (from the step's
    start), `ms`, the kernels `before` and `after` it (None before the first: the step's lead), and `host`:
    the host's ranges open when the next kernel started (outermost first, the last four; runtime calls left
    out). On a GPU this is where the device waited for the host (or for a sync); on the CPU, where the host
    ran framework code between compute ops."""
    spans = sorted(kernels, key=lambda e: e.start_us)
    gaps = []
    end, before = start_us, None
    for e in spans:
        if e.start_us > end:
            gaps.append((e.start_us - end, end, before, e))
        if e.end_us >= end:
            end, before = e.end_us, e
    gaps.sort(key=lambda g: -g[0])
    out = []
    for length, at, prev, nxt in gaps[:n]:
        opened = _open_around(host, nxt.start_us, nxt.start_us)
        out.append(
            {
                "at_ms": round((at - start_us) / 1e3, 3),
                "ms": round(length / 1e3, 3),
                "before": prev.name[:70] if prev is not None else None,
                "after": nxt.name[:70],
                "host": [h.name[:70] for h in opened[-4:]],
            }
        )
    return out


def scalar_read_where(reads: Sequence[Event], host: Sequence[Event], n: int = 6) -> list[list[Any]]:
    """Where a step's scalar reads were made: [[outermost > innermost host range open around the read, reads]],
    the n most frequent. The step's mark, runtime calls and the read's own `aten::item` are left out; the
    outermost names the phase (a compiled graph's call, the optimizer's step, the autograd engine), the
    innermost the op that read (a read made by Python code has only its phase). On a GPU each read of a device
    tensor waits for the stream, so this is where a step's unexpected waits come from."""
    ignored = (STEP_MARK, "aten::item", SCALAR_READ)
    where: dict[str, int] = defaultdict(int)
    for r in reads:
        same_thread = (h for h in host if h.thread == r.thread and h.name not in ignored)
        opened = _open_around(same_thread, r.start_us, r.end_us)
        names = [opened[0].name[:60], opened[-1].name[:60]] if opened else ["(the step itself)"]
        where[" > ".join(dict.fromkeys(names))] += 1
    return [[k, where[k]] for k in sorted(where, key=lambda k: -where[k])[:n]]


def _open_around(host: Iterable[Event], start_us: float, end_us: float) -> list[Event]:
    """The host ranges open over the whole of [start_us, end_us], outermost first; runtime calls left out."""
    opened = (h for h in host if h.start_us <= start_us and end_us <= h.end_us and not RUNTIME_CALL.match(h.name))
    return sorted(opened, key=lambda h: (h.start_us, -h.end_us))


def _top_host_ops(host: Sequence[Event], n: int = 12) -> list[list[Any]]:
    """The n host op names called most often in the step ([name, calls]): where two modes that launch the
    same kernels differ in host time, the extra ops name the cause."""
    calls: dict[str, int] = defaultdict(int)
    for e in host:
        if e.name.startswith("aten::") or e.name.startswith(REGION) or e.name.startswith(GRAPH_CALL):
            calls[e.name[:60]] += 1
    return [[name, calls[name]] for name in sorted(calls, key=lambda name: -calls[name])[:n]]


SUMMED = (
    "host_ops",
    "host_ms",
    "lead_ms",
    "graph_calls",
    "regions",
    "scalar_reads",
    "kernels",
    "kernel_ms",
    "busy_ms",
    "copies",
    "syncs",
)


def summarize_kernels(events: Sequence[Event]) -> dict[str, Any]:
    """Per-step medians of `step_kernel_stats` (each figure's own median), the steps themselves, and the last
    step's top kernels; {"measured": False, ...} when no step was marked."""
    steps = step_kernel_stats(events)
    if not steps:
        return {"measured": False, "reason": f"no '{STEP_MARK}' event: no step was profiled"}
    out: dict[str, Any] = {"measured": True, "device": steps[0]["device"], "steps": len(steps)}
    if out["device"] == "cpu":
        out["host_ops_scope"] = HOST_OPS_SCOPE  # results written before it counted the loops too
    for key in SUMMED + ("cpp_kernels",):
        values = [s[key] for s in steps if s.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["top"] = steps[-1]["top"]
    out["host_top"] = steps[-1]["host_top"]
    out["idle_top"] = steps[-1].get("idle_top") or []
    out["scalar_read_where"] = steps[-1]["scalar_read_where"]
    shown_once = ("top", "host_top", "idle_top", "scalar_read_where")
    out["per_step"] = [{k: v for k, v in s.items() if k not in shown_once} for s in steps]
    return out
