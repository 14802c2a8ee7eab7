"""Markdown tables of an aggregated run: step time, memory and overlap; the first-step breakdown; ours vs PyTorch."""

from __future__ import annotations

from typing import Any

from benchmarks.bracket import bracket_line, comm_hidden_cell, over_floor_cell
from benchmarks.config import BRACKET_MODES, NO_COMPILE_MODES
from benchmarks.memory import MEMORY_REFERENCE


def _fmt(value: Any, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _per_rank(values: list[float | None] | None, spec: str = ".0f") -> str:
    """Per-rank values as 'r0/r1/...' (a dash where a rank reported nothing)."""
    if not values or all(v is None for v in values):
        return "-"
    return "/".join(_fmt(v, spec) for v in values)


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(cells: list[str]) -> list[str]:
    return [_row(cells), "|" + "---|" * len(cells)]


MAIN_COLUMNS = [
    "mode",
    "status",
    "pieces",
    "step ms (median)",
    "min-max",
    "over floor ms (%)",
    "comm hidden %",
    "steady peak RSS MB/rank (+ steps' growth)",
    "step tensor peak MB/rank: held at start + step's own = absolute",
    "process peak RSS MB/rank",
    "cold 1st step s",
    "warm 1st step s",
    "final loss",
    "scaling eff",
    "overlap % hook / prof",
    "exposed comm ms hook / prof",
]


def main_table(data: dict[str, Any]) -> list[str]:
    """Step time, memory per rank, first step, loss, scaling and overlap: one row per mode."""
    agreement = data["loss_agreement"]
    bad = {d["mode"] for d in agreement["disagree"]} | {d["mode"] for d in agreement["unstable"]}
    rows = _header(MAIN_COLUMNS)
    for mode, a in data["modes"].items():
        if a["status"] != "ok":
            rows.append(_row([mode, f"{a['status']}: {_short(a['error'])}"] + [""] * (len(MAIN_COLUMNS) - 2)))
            continue
        ov, prof = a.get("overlap") or {}, a.get("profile") or {}
        loss = _loss_cell(mode, a["final_loss"], bad)
        warm = a["first_step_s_warm"] if a["first_step_s_warm"] is not None else a["first_step_s_smoke"]
        cold = a["first_step_s_cold"] if mode not in NO_COMPILE_MODES else None
        rows.append(
            _row(
                [
                    mode,
                    _status_cell(mode, data.get("labels") or {}),
                    _fmt(a["pieces"], "d"),
                    _fmt(a["step_ms"]),
                    f"{_fmt(a['step_ms_min'])}-{_fmt(a['step_ms_max'])}",
                    over_floor_cell(data.get("bracket"), mode),
                    comm_hidden_cell(data.get("bracket"), mode),
                    _steady_cell(a),
                    _tensor_peak_cell(prof),
                    _per_rank(a.get("peak_rss_mb_per_rank")),
                    _fmt(cold, ".1f", "no compile" if mode in NO_COMPILE_MODES else "-"),
                    _fmt(warm, ".1f"),
                    loss,
                    _fmt(a.get("scaling_efficiency"), ".2f"),
                    f"{_hook_cell(ov)} / {_prof_cell(prof)}",
                    f"{_fmt(ov.get('median_exposed_ms')) if ov.get('recorded') else '-'} / "
                    f"{_fmt(prof.get('median_exposed_ms')) if prof.get('measured') else '-'}",
                ]
            )
        )
    return rows


def _steady_cell(a: dict[str, Any]) -> str:
    """The steady-state peak RSS per rank, and (when measured) how much the timed steps added to it."""
    peak = _per_rank(a.get("steady_peak_rss_mb_per_rank"))
    growth = a.get("steady_growth_rss_mb_per_rank")
    if not growth or all(v is None for v in growth):
        return peak
    return f"{peak} (+{_per_rank(growth)})"


def _tensor_peak_cell(prof: dict[str, Any]) -> str:
    """`held + step = absolute` per rank where the job counted what it held (benchmarks/memory.py), else the
    step's own peak (results.json of earlier runs)."""
    step = _per_rank(prof.get("tensor_peak_mb_per_rank"), ".1f")
    held = prof.get("held_mb_per_rank")
    if not held or any(v is None for v in held):
        return step
    return f"{_per_rank(held, '.1f')} + {step} = {_per_rank(prof.get('absolute_peak_mb_per_rank'), '.1f')}"


def gradient_savings_line(data: dict[str, Any]) -> str:
    """How much lower each mode's absolute step tensor peak is than ours_step's, in gradient bytes."""
    rows = data.get("gradient_savings") or []
    if not rows:
        return ""
    parts = [f"{r['mode']} {r['saved_mb']:+.1f} MB ({100 * r['share']:+.0f}%)" for r in rows]
    return (
        f"Absolute step tensor peak below {MEMORY_REFERENCE}'s (worst rank; share of the "
        f"{rows[0]['gradient_mb']:.1f} MB of gradients): " + ", ".join(parts) + "."
    )


def _status_cell(mode: str, labels: dict[str, str]) -> str:
    if mode in BRACKET_MODES:
        return "ok (bracket, not gated)"
    return f"ok ({labels[mode]})" if mode in labels else "ok"


def _loss_cell(mode: str, loss: float, bad: set[str]) -> str:
    if mode == "comm_only":
        return "n/a (no training)"
    if mode == "floor":
        return f"{loss:.5f} (own data per rank)"
    return f"{loss:.5f}" + (" **DISAGREES**" if mode in bad else "")


def _hook_cell(ov: dict[str, Any]) -> str:
    if not ov:
        return "-"
    if not ov.get("recorded"):
        reason = str(ov.get("reason", ""))
        return (
            "n/a (python reducer)"
            if "python reducer" in reason
            else "n/a (in-graph)"
            if "in_graph" in reason
            else "n/a (comm hook)"
            if "comm hook" in reason
            else "n/a"
        )
    return _fmt(ov.get("overlap_percent"), ".0f")


def _prof_cell(prof: dict[str, Any]) -> str:
    if not prof:
        return "-"
    return _fmt(prof.get("overlap_percent"), ".0f") if prof.get("measured") else "n/a"


BREAKDOWN_COLUMNS = [
    "mode",
    "job",
    "1st step s",
    "compile s",
    "Dynamo s",
    "AOT + backend passes s",
    "Inductor s",
    "C++ compile s",
    "other s",
    "later warm-up compile s",
    "graphs",
    "FX cache hit/miss",
    "AOT cache hit/miss",
]


def breakdown_table(data: dict[str, Any]) -> list[str]:
    """Where the first step's time went, per mode and job kind (cold cache, warm cache): the slowest rank."""
    rows = _header(BREAKDOWN_COLUMNS)
    for mode, a in data["modes"].items():
        for kind, b in (a.get("first_step") or {}).items():
            cache = b.get("cache", {})
            rows.append(
                _row(
                    [
                        mode,
                        kind,
                        _fmt(b["wall_s"], ".2f"),
                        _fmt(b["compile_s"], ".2f"),
                        _fmt(b["dynamo_s"], ".2f"),
                        _fmt(b["aot_s"], ".2f"),
                        _fmt(b["inductor_s"], ".2f"),
                        _fmt(b["cpp_compile_s"], ".2f"),
                        _fmt(b["other_s"], ".2f"),
                        _fmt(b.get("later_warmup_compile_s"), ".2f"),
                        str(b.get("graphs", "-")),
                        f"{cache.get('fxgraph_hit', 0)}/{cache.get('fxgraph_miss', 0)}",
                        f"{cache.get('aot_hit', 0)}/{cache.get('aot_miss', 0)}",
                    ]
                )
            )
    return rows if len(rows) > 2 else []


COMPARISON_COLUMNS = [
    "ours",
    "peer",
    "cold 1st step / peer",
    "warm 1st step / peer",
    "cold warm-up compile / peer",
    "to end of step 2, cold / warm / peer",
    "best PyTorch mode",
    "step ms / best PyTorch",
]


def comparison_table(data: dict[str, Any]) -> list[str]:
    """Ratios (< 1: ours faster) for each of our modes against its PyTorch peer and the best PyTorch mode."""
    rows = _header(COMPARISON_COLUMNS)
    for c in data.get("comparisons", []):
        warm = c.get("first_step_warm_vs_peer", c.get("first_step_smoke_vs_peer"))
        rows.append(
            _row(
                [
                    c["mode"],
                    c["peer"],
                    _fmt(c.get("first_step_cold_vs_peer"), ".2f"),
                    _fmt(warm, ".2f"),
                    _fmt(c.get("warmup_compile_cold_vs_peer"), ".2f"),
                    f"{_fmt(c.get('two_steps_cold_vs_peer'), '.2f')} / {_fmt(c.get('two_steps_warm_vs_peer'), '.2f')}",
                    c.get("best_torch") or "-",
                    _fmt(c.get("step_ms_vs_best_torch"), ".2f"),
                ]
            )
        )
    return rows if len(rows) > 2 else []


def _exempt(agreement: dict[str, Any]) -> str:
    exempt = agreement.get("exempt") or []
    return f" Not gated: {', '.join(exempt)} (bracket modes: they do not train like eager DDP)." if exempt else ""


def agreement_line(agreement: dict[str, Any]) -> str:
    return _agreement_line(agreement) + _exempt(agreement)


def _agreement_line(agreement: dict[str, Any]) -> str:
    if agreement["ok"] is None:
        return "Loss agreement: no mode finished."
    if agreement["ok"]:
        return (
            f"Loss agreement: OK (all finished modes within {agreement['tolerance']:.2g} of "
            f"{agreement['reference']}'s {agreement['reference_loss']:.5f})."
        )
    parts = [f"{d['mode']} {d['loss']:.5f} ({d['diff']:+.2g})" for d in agreement["disagree"]]
    parts += [f"{d['mode']} varies across jobs {d['losses']}" for d in agreement["unstable"]]
    return (
        f"**WARNING: loss disagreement** beyond {agreement['tolerance']:.2g} vs "
        f"{agreement['reference']} ({agreement['reference_loss']:.5f}): " + "; ".join(parts)
    )


def param_agreement_line(agreement: dict[str, Any]) -> str:
    by_tol: dict[float, list[str]] = {}
    for mode, tol in (agreement.get("rtol_by_mode") or {}).items():
        by_tol.setdefault(tol, []).append(mode)
    distance = agreement.get("distance") or {}
    loosened = "".join(
        f" {', '.join(modes)} gated at {tol:.0e} ({agreement.get('loosened_because', '')}; up to "
        f"{max(distance.get(m, 0.0) for m in modes):.1e} here)."
        for tol, modes in by_tol.items()
    )
    return _param_agreement_line(agreement) + loosened + _exempt(agreement)


def _param_agreement_line(agreement: dict[str, Any]) -> str:
    if agreement["ok"] is None:
        if agreement["missing"]:
            return "Parameter agreement: not checked (these results hold no parameter fingerprints)."
        return "Parameter agreement: no mode finished."
    if agreement["ok"]:
        loose = agreement.get("rtol_by_mode") or {}
        worst = max((d for m, d in agreement["distance"].items() if m not in loose), default=0.0)
        return (
            f"Parameter agreement: OK (every mode's final parameters within {worst:.1e} of "
            f"{agreement['reference']}'s update; tolerance {agreement['rtol']:.0e})."
        )
    parts = [f"{d['mode']} {d['distance']:.2g} from {agreement['reference']}" for d in agreement["disagree"]]
    parts += [f"{d['mode']}: ranks {d['distance']:.2g} apart" for d in agreement["ranks_disagree"]]
    parts += [f"{d['mode']} varies across jobs ({d['distance']:.2g})" for d in agreement["unstable"]]
    parts += [f"{m}: no parameter fingerprint" for m in agreement["missing"]]
    return f"**WARNING: parameter disagreement** beyond {agreement['rtol']:.0e}: " + "; ".join(parts)


def markdown_table(result: dict[str, Any], workload: str, *, timing_claims: bool = True) -> str:
    """One workload's section: main table, agreement lines, first-step breakdown, comparison with PyTorch."""
    data = result["workloads"][workload]
    lines = [f"### {workload}: {data['description']}", ""]
    if data.get("purpose"):
        lines += [f"_{data['purpose']}_", ""]
    if not timing_claims:
        lines.append("_smoke run: numbers below are not timing claims_\n")
    lines += [bracket_line(data.get("bracket")), ""]
    lines += main_table(data) + ["", agreement_line(data["loss_agreement"])]
    if "param_agreement" in data:  # results.json of runs before the parameter fingerprint have none
        lines += ["", param_agreement_line(data["param_agreement"])]
    if data.get("gradient_savings"):
        lines += ["", gradient_savings_line(data)]
    breakdown = breakdown_table(data)
    if breakdown:
        lines += ["", f"First step of {workload}, where the time goes (slowest rank; seconds):", ""] + breakdown
    compared = comparison_table(data)
    if compared:
        lines += ["", f"Ours vs PyTorch on {workload} (ratios; below 1 = ours faster):", ""] + compared
    return "\n".join(lines)


def all_tables(result: dict[str, Any], *, timing_claims: bool = True) -> str:
    return "\n\n".join(markdown_table(result, w, timing_claims=timing_claims) for w in result["workloads"])
