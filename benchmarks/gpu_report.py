"""The GPU benchmark's results: per-mode rows from its jobs, the markdown table, and BENCHMARKS.md's GPU block.

Pure (dicts in, text out). The block sits between its own markers, `GPU_BEGIN` and `GPU_END`, which the CPU
benchmark's generator (benchmarks/markers.py, `generated:begin/end`) does not see: each generator rewrites only
its own block, and everything written by hand around both is kept.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from benchmarks.checksum import checksum_distance
from benchmarks.config import MODE_HELP
from benchmarks.kernels import HOST_OPS_SCOPE

GPU_BEGIN = (
    "<!-- generated-gpu:begin: `python -m benchmarks.gpu --render ...` rewrites everything from here to "
    "generated-gpu:end; write by hand only outside these markers -->"
)
GPU_END = "<!-- generated-gpu:end -->"
_BEGIN_RE = re.compile(r"^<!-- generated-gpu:begin\b.*$", re.MULTILINE)
_END_RE = re.compile(r"^<!-- generated-gpu:end -->[ \t]*$", re.MULTILINE)

REFERENCE = "torch_savvy"
"""The mode every ratio is read against: PyTorch's best (torch.compile of the model and of optimizer.step)."""
EAGER = "eager"
"""Where the parameter check is read against: eager DDP with the eager optimizer."""

STOPPED = "GateStopped"
"""The worker's error when it was told to leave before its timed steps (benchmarks/gate.py)."""


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def mode_row(
    mode: str, cold: dict[str, Any] | None, warm: dict[str, Any] | None, profiled: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One mode's figures from its cold job (compiled side by side, then timed alone), its optional warm
    start-up job and its optional profiled warm start-up (`startup_profile_warm`: the first two steps' top
    functions under cProfile). A mode whose job failed keeps what it measured before failing (start-up) and
    its error."""
    row: dict[str, Any] = {"mode": mode, "description": MODE_HELP.get(mode, mode)}
    if cold is None:
        return {**row, "status": "not run", "error": "no time left to start it"}
    ready = cold.get("ready") or {}
    row["first_step_s"] = ready.get("first_step_s")
    row["two_steps_s_cold"] = ready.get("two_steps_s")
    row["cold_parallel"] = cold.get("cold_parallel")
    rank0 = cold["ranks"][0] if cold.get("ranks") else {}
    if not cold["ok"]:
        error = cold["errors"][0] if cold.get("errors") else "failed without an error"
        status = "unavailable" if cold.get("unavailable") else "not timed" if STOPPED in error else "failed"
        return {**row, "status": status, "error": error}
    kernels = rank0.get("kernels") or {}
    row.update(
        status="ok",
        step_ms=rank0.get("median_step_ms"),
        step_ms_all=rank0.get("step_ms"),
        host_ms=rank0.get("median_host_ms"),
        back_to_back_ms=rank0.get("back_to_back_ms"),
        first_step_s=rank0.get("first_step_s"),
        two_steps_s_cold=rank0.get("two_steps_s"),
        cuda_peak_mb=rank0.get("steady_peak_cuda_mb"),
        steady_peak_rss_mb=rank0.get("steady_peak_rss_mb"),
        final_loss=rank0.get("final_loss"),
        param_checksum=rank0.get("param_checksum"),
        later_warmup_compile_s=(rank0.get("compile") or {}).get("later_warmup_compile_s"),
        pieces=(rank0.get("info") or {}).get("pieces"),
        kernels=kernels if kernels.get("measured") else None,
        memory_at_peak=rank0.get("memory_at_peak"),
        host_profile=rank0.get("host_profile"),
        versions=rank0.get("versions"),
        device=rank0.get("device"),
        pg_backend=rank0.get("pg_backend"),
    )
    if profiled is not None:
        ranks = profiled.get("ranks") or [{}]
        found = ranks[0].get("startup_profile") if profiled["ok"] else None
        row["startup_profile_warm"] = found or {"error": (profiled.get("errors") or ["failed"])[0]}
    if warm is not None:
        if warm["ok"]:
            row["two_steps_s_warm"] = warm["ranks"][0].get("two_steps_s")
        else:
            row["warm_error"] = warm["errors"][0] if warm.get("errors") else "failed"
    return row


def aggregate(config: dict[str, Any], jobs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every mode of the run, in the run's order, with ratios to `REFERENCE` and the parameter distance to
    `EAGER` (None where either did not finish)."""
    rows = {}
    for mode in config["modes"]:
        cold = next((j for j in jobs if j["mode"] == mode and j["kind"] == "cold"), None)
        warm = next((j for j in jobs if j["mode"] == mode and j["kind"] == "warm"), None)
        profiled = next((j for j in jobs if j["mode"] == mode and j["kind"] == "warm_profiled"), None)
        rows[mode] = mode_row(mode, cold, warm, profiled)
    ref, eager = rows.get(REFERENCE, {}), rows.get(EAGER, {})
    for row in rows.values():
        row["step_vs_ref"] = _ratio(row.get("step_ms"), ref.get("step_ms"))
        row["back_to_back_vs_ref"] = _ratio(row.get("back_to_back_ms"), ref.get("back_to_back_ms"))
        row["two_steps_cold_vs_ref"] = _ratio(row.get("two_steps_s_cold"), ref.get("two_steps_s_cold"))
        row["two_steps_warm_vs_ref"] = _ratio(row.get("two_steps_s_warm"), ref.get("two_steps_s_warm"))
        mine, theirs = row.get("param_checksum"), eager.get("param_checksum")
        row["param_distance"] = checksum_distance(mine, theirs) if mine and theirs else None
    return rows


# -- markdown ------------------------------------------------------------------------------------------


def _f(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _x(value: float | None) -> str:
    return "" if value is None else f" ({value:.2f}x)"


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loops_left_out(result: dict[str, Any]) -> bool:
    """Whether this run's CPU host ops leave out the loops inside multi-tensor ops (runs from before that
    counted them: benchmarks/kernels.py, `HOST_OPS_SCOPE`)."""
    return any(
        (row.get("kernels") or {}).get("host_ops_scope") == HOST_OPS_SCOPE for row in result.get("modes", {}).values()
    )


def _k(row: dict[str, Any], key: str, spec: str = ".1f") -> str:
    return _f((row.get("kernels") or {}).get(key), spec)


def table(result: dict[str, Any]) -> list[str]:
    """The run's table: one row per mode, failed modes included (their error below the table)."""
    cpu = result.get("device") == "cpu"
    busy = "kernel ms/step (host, in ops)" if cpu else "GPU busy ms/step"
    outside = "step ms - kernel ms" if cpu else "step ms - busy ms"
    head = [
        "mode",
        "status",
        f"median step ms (x {REFERENCE})",
        f"back-to-back ms/step (x {REFERENCE})",
        "host ms/step",
        f"to end of step 2, cold s (x {REFERENCE})",
        "warm s (x)",
        "CUDA steady peak MB",
        "kernels/step",
        busy,
        outside,
        "ms to the first kernel",
        "graph calls/step",
        "scalar reads/step",
        "host ops/step",
        "params vs eager",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for mode, row in result["modes"].items():
        k = row.get("kernels") or {}
        gap = _minus(row.get("step_ms"), k.get("kernel_ms" if cpu else "busy_ms")) if k else None
        cells = [
            f"`{mode}`",
            row["status"],
            _f(row.get("step_ms")) + _x(row.get("step_vs_ref")),
            _f(row.get("back_to_back_ms")) + _x(row.get("back_to_back_vs_ref")),
            _f(row.get("host_ms")),
            _f(row.get("two_steps_s_cold")) + _x(row.get("two_steps_cold_vs_ref")),
            _f(row.get("two_steps_s_warm")) + _x(row.get("two_steps_warm_vs_ref")),
            _f(row.get("cuda_peak_mb"), ".0f"),
            _k(row, "kernels", ".0f"),
            _k(row, "kernel_ms" if cpu else "busy_ms"),
            _f(gap),
            _k(row, "lead_ms", ".2f"),
            _k(row, "graph_calls", ".0f"),
            _k(row, "scalar_reads", ".0f"),
            _k(row, "host_ops", ".0f"),
            _f(row.get("param_distance"), ".1e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if row.get("error"):
            notes.append(f"- `{mode}` {row['status']}: {_short(row['error'])}")
        if row.get("warm_error"):
            notes.append(f"- `{mode}` warm start-up failed: {_short(row['warm_error'])}")
    return lines + ([""] + notes if notes else [])


MEMORY_HELD = ("parameters", "optimizer_state", "ddp_buckets")
"""What a job holds between steps, shown at its peak (buffers and kept gradients join `other held`)."""


def memory_table(result: dict[str, Any]) -> list[str]:
    """What is live at each mode's memory peak, by kind, and where the peak sits (benchmarks/memory_peak.py);
    nothing where no mode measured it."""
    rows = {m: r.get("memory_at_peak") for m, r in result["modes"].items()}
    if not any((r or {}).get("measured") for r in rows.values()):
        return []
    head = ["mode", "peak MB", "where", *MEMORY_HELD, "other held", "gradients", "activations", "temporaries", "kept"]
    lines = ["| " + " | ".join(head).replace("_", " ") + " |", "|" + "---|" * len(head)]
    for mode, peak in rows.items():
        if not (peak or {}).get("measured"):
            reason = (peak or {}).get("reason", "not measured")
            lines.append(f"| `{mode}` | - | {_short(reason, 80)} |" + " |" * (len(head) - 3))
            continue
        held, step = peak.get("held_mb") or {}, peak["step_mb"]
        where = peak["where"]
        if peak.get("backward_fraction") is not None:
            where += f" at {100 * peak['backward_fraction']:.0f}%"
        other = sum(v for k, v in held.items() if k not in MEMORY_HELD) if held else None
        cells = [f"`{mode}`", _mb(peak.get("peak_mb")), where]
        cells += [_mb(held.get(k)) for k in MEMORY_HELD] + [_mb(other)]
        cells += [_mb(step[k]) for k in ("gradients", "activations", "temporaries", "kept")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _mb(value: float | None) -> str:
    return _f(value, ".0f" if value is not None and value >= 100 else ".1f")


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def describe(result: dict[str, Any]) -> list[str]:
    """What ran, where and how: the lines above a run's table."""
    cfg = result["config"]
    m = result.get("machine") or {}
    stack = ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v)
    where = m.get("device_name") or result.get("device", "?")
    cold = cfg.get("parallel")
    return [
        f"### {cfg['precision']}: {where}, world size 1 ({m.get('pg_backend') or '?'})",
        "",
        f"{stack}; {m.get('cpu_count', '?')} CPU cores. {cfg['model']}; {cfg['optimizer']}; backend "
        f"{cfg['backend']}, torch.compile mode {cfg.get('compile_mode') or 'default'}"
        + (f"; forward and loss under torch.autocast({cfg['autocast']})" if cfg.get("autocast") else "; fp32")
        + f". Command: `{cfg['command']}`.",
        "",
        f"- Cold start-up (phase A): every mode's job starts at once with its own empty Inductor cache, {cold} "
        f"side by side on {m.get('cpu_count', '?')} cores, {cfg.get('compile_threads_text', '?')}: its time "
        "to the end of step 2 is measured **under that contention** (an upper bound of a lone cold start; "
        "modes that finish first free the cores for the others).",
        f"- Timed steps (phase B): one job at a time, the others idle at their gate: median of {cfg['steps']} "
        f"steps after {cfg['warmup']} warm-up steps, each after the previous one's device sync; back-to-back = "
        "the steps right after them run with no sync between (a training loop's pace: a step's host work "
        "before its first kernel overlaps the previous step's kernels), their time over their count; host ms = "
        "until the step's Python returned, before the device sync; CUDA steady peak = `max_memory_allocated` "
        "over the timed steps.",
        f"- Kernels (torch.profiler, {cfg['profile_steps']} steps after the timed ones, per-step medians; "
        "benchmarks/kernels.py): "
        + (
            "leaf compute ops on the host (aten ops that are not views or allocations, Inductor C++ kernels; a "
            "foreach op or torch's fused optimizer kernel once); "
            "kernel ms = host time inside them; step ms - kernel ms = the framework's share of the (unprofiled) step"
            if result.get("device") == "cpu"
            else "CUDA kernels (copies and fills apart); busy = union of their intervals; step ms - busy ms = "
            "the (unprofiled) step's time with the GPU idle"
        )
        + "; ms to the first kernel = from the step's start (after the previous step's sync) to its first "
        "kernel; graph calls = compiled Inductor graphs called; scalar reads = `.item()` calls (a wait for the device "
        "where the tensor is on the GPU); host ops = the host's aten ops in the step, "
        "nested ones too"
        + (
            ", but not the per-tensor loop inside a foreach op or a fused optimizer kernel, which a GPU runs on "
            "the device (issue 34, item 6)."
            if _loops_left_out(result)
            else "."
        ),
        "- Warm start-up (phase C, where listed): a fresh process on the mode's cache, alone.",
        "- params vs eager: distance of the final parameters' update from eager's (benchmarks/checksum.py).",
        "- Phases: "
        + "; ".join(f"{p['name']} {p['spent_s']:.0f} s of {p['budget_s']:.0f}" for p in result.get("phases", [])),
        "",
    ]


MEMORY_TEXT = (
    "What is live at each mode's memory peak, MB (one more step after the kernel profile, under the memory "
    "profiler; benchmarks/memory_peak.py, its Note): what the job holds between steps (parameters, optimizer state, "
    "DDP's bucket copy), then what the step allocated and still holds at the peak: gradients (dropped by "
    "zero_grad), activations (allocated before the backward began), temporaries (since then; a compiled "
    "backward's gradient buffers included), kept (outlive the step). Where: the step's phase at the peak, a "
    "backward peak placed from its start (0%) to its end (100%)."
)


def section(results: list[dict[str, Any]]) -> str:
    """The GPU block (markers included) for one or more runs (fp32, bf16)."""
    body = [GPU_BEGIN, ""]
    for result in results:
        body += describe(result) + table(result) + [""]
        memory = memory_table(result)
        if memory:
            body += [MEMORY_TEXT, ""] + memory + [""]
    body.append(GPU_END)
    return "\n".join(body) + "\n"


def merge_gpu_section(previous: str | None, block: str, *, where: str = "BENCHMARKS.md") -> str:
    """`previous` with its GPU block replaced by `block`; without one, the block goes right under the first
    `## GPU` heading (above the hand-written GPU notes), or into a new section at the end."""
    if not previous:
        return "# Benchmarks\n\n" + block
    begins, ends = list(_BEGIN_RE.finditer(previous)), list(_END_RE.finditer(previous))
    if begins or ends:
        if len(begins) != 1 or len(ends) != 1 or ends[0].start() < begins[0].end():
            raise ValueError(
                f"{where}: expected one '<!-- generated-gpu:begin ...' line followed by one '{GPU_END}' line, "
                f"found {len(begins)} and {len(ends)}; fix the markers by hand"
            )
        return previous[: begins[0].start()] + block.rstrip("\n") + previous[ends[0].end() :]
    heading = re.search(r"^## GPU\b.*$", previous, re.MULTILINE)
    if heading is None:
        return previous.rstrip("\n") + "\n\n## GPU (generated)\n\n" + block
    at = heading.end() + 1
    return previous[:at] + "\n" + block + previous[at:]


def console_details(runs: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
    """What the GPU benchmark prints besides its tables, per (precision, result): each mode's top kernels,
    longest idle stretches, scalar reads, and its cProfiled steady steps and warm start-up."""
    runs = list(runs)
    out: list[str] = []
    out.append("\nwhere the kernel time goes (last profiled step: the 3 kernels with the most time, calls, ms):")
    for p, result in runs:
        for mode, row in result["modes"].items():
            top = (row.get("kernels") or {}).get("top") or []
            cells = "; ".join(f"{t['name'][:70]} x{t['calls']} {t['ms']:.2f}" for t in top[:3])
            out.append(f"  {p}/{mode}: {cells or '-'}")
    out.append("\nwhere the device waits (last profiled step: the 3 longest stretches without a kernel, ms at ms):")
    for p, result in runs:
        for mode, row in result["modes"].items():
            gaps = (row.get("kernels") or {}).get("idle_top") or []
            cells = "; ".join(
                f"{g['ms']:.2f} at {g['at_ms']:.1f} before {g['after'][:40]} (host: {' > '.join(g['host'][-2:])})"
                for g in gaps[:3]
            )
            out.append(f"  {p}/{mode}: {cells or '-'}")
    out.append("\nwhere the scalar reads are made (last profiled step: outermost > innermost host range, reads):")
    for p, result in runs:
        for mode, row in result["modes"].items():
            reads = (row.get("kernels") or {}).get("scalar_read_where") or []
            out.append(f"  {p}/{mode}: {'; '.join(f'{where} x{count}' for where, count in reads) or '-'}")
    for p, result in runs:
        for mode, row in result["modes"].items():
            found = row.get("host_profile")
            if found:
                out.append(
                    f"\nsteady steps of {p}/{mode} under cProfile ({found.get('steps')} steps after the timed ones):"
                )
                out.extend(_profile_lines(found, n=10, per_step=found.get("steps") or 1))
    for p, result in runs:
        for mode, row in result["modes"].items():
            found = row.get("startup_profile_warm")
            if found:
                two = found.get("two_steps_s")
                two_text = f"{two:.2f} s" if isinstance(two, (int, float)) else "-"
                out.append(f"\nwarm start-up of {p}/{mode} under cProfile (to the end of step 2: {two_text}):")
                out.extend([found["error"]] if found.get("error") else _profile_lines(found))
    return out


def _profile_lines(found: dict[str, Any], n: int = 12, per_step: int | None = None) -> list[str]:
    """A cProfile's top functions by own time, then by cumulative time, one per line: seconds in all, or with
    `per_step` (the steps profiled) ms and calls per step."""
    out = []
    scale, unit = (1e3 / per_step, "ms/step") if per_step else (1.0, "s")
    for key in ("own", "cumulative"):
        out.append(f"  by {key} time (own {unit}, cumulative {unit}, calls{'/step' if per_step else ''}):")
        for r in found.get(key, [])[:n]:
            calls = r["calls"] / per_step if per_step else r["calls"]
            own, cumulative = r["own_s"] * scale, r["cumulative_s"] * scale
            out.append(f"    {own:8.2f} {cumulative:8.2f} {calls:>8g}  {r['where']}")
    return out
