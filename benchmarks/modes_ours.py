"""compile_core's benchmark modes: `compile_core.compile` with an eager optimizer and `compile_core.train_step`,
each with ddp='split' or ddp='in_graph', and what each tells of itself from its report. Each builder takes a
`ModeContext` and returns a `Step` (benchmarks/mode_context.py); benchmarks/modes.py lists them by name.
"""

from __future__ import annotations

from typing import Any

from benchmarks.mode_context import ModeContext, ModeUnavailable, Step, compile_options, eager_optimizer_step
from examples.gpt import lm_loss


def _report_info(obj: Any) -> dict[str, Any]:
    """Pieces and planned buckets from a compile_core report, tolerant of a partial report."""
    report = getattr(obj, "report", None)
    if report is None:
        return {"note": "no .report() on the compiled object"}
    data = report().to_dict()
    graphs = data.get("graphs", [])
    extra: dict[str, Any] = {}
    in_graph = [g for g in graphs if g.get("variant")]
    if in_graph:
        # the all-reduces of the variant that ran last, in issue (backward) order: they label the profiler's
        # timeline (benchmarks/profile_overlap.py)
        last = [g for g in in_graph if g["variant"] == in_graph[-1]["variant"]]
        extra["in_graph_buckets"] = [
            {"params": list(b["params"]), "bytes": b["bytes"]} for g in reversed(last) for b in g.get("buckets", [])
        ]
    if "optimizer_in_backward" in data:  # a train_step report
        extra["optimizer_in_backward"] = data["optimizer_in_backward"]
        extra["optimizer_compiled"] = (data.get("optimizer") or {}).get("compiled")
    # graphs run forward in list order, so their backward runs in reverse: the planned buckets of the
    # last graph come first in DDP's (backward) order.
    planned = [list(b["params"]) for g in reversed(graphs) for b in g.get("buckets", [])]
    return {
        "pieces": sum(int(g.get("pieces", 0)) for g in graphs) or None,
        "pieces_per_graph": [g.get("pieces") for g in graphs],
        "planned_buckets": planned,
        "graph_breaks": len(data.get("graph_breaks", [])),
        "recompiles": len(data.get("recompiles", [])),
        "fallbacks": data.get("fallbacks", []),
        "compile_seconds": data.get("compile_seconds"),
        "in_graph_variants": [g["variant"] for g in graphs if g.get("variant")],
        "report_text": str(report()),
        **extra,
    }


def _reduction(ctx: ModeContext, ddp_mode: str) -> dict[str, Any]:
    # --reduce-dtype reaches our in-graph modes only (compile_core refuses it for ddp='split')
    return {"reduce_dtype": ctx.reduce_dtype} if ddp_mode == "in_graph" and ctx.reduce_dtype is not None else {}


def _ours_compile(ctx: ModeContext, ddp_mode: str) -> Step:
    import compile_core

    compiled = compile_core.compile(ctx.ddp, **compile_options(ctx), ddp=ddp_mode, **_reduction(ctx, ddp_mode))
    return Step(run=eager_optimizer_step(ctx, compiled), info=lambda: _report_info(compiled))


def build_ours_compile(ctx: ModeContext) -> Step:
    return _ours_compile(ctx, "split")


def build_ours_in_graph(ctx: ModeContext) -> Step:
    # DDP's reducer idles: the compiled backward all-reduces (comm hooks, the recorder, see nothing)
    return _ours_compile(ctx, "in_graph")


def _ours_step(ctx: ModeContext, **options: Any) -> Step:
    import compile_core

    # autocast= puts the forward and the loss under torch.autocast inside the step, as the other modes do
    amp = {"autocast": ctx.autocast} if ctx.autocast is not None else {}
    step = compile_core.train_step(
        ctx.ddp, ctx.optimizer, lm_loss, **compile_options(ctx), **_reduction(ctx, options["ddp"]), **amp, **options
    )
    # the backward runs inside the step, so the recorder falls back to the first bucket's ready time
    return Step(run=lambda x, y: step(x, y).detach(), info=lambda: _report_info(step))


def build_ours_step(ctx: ModeContext) -> Step:
    return _ours_step(ctx, ddp="split")


def build_ours_step_in_graph(ctx: ModeContext) -> Step:
    return _ours_step(ctx, ddp="in_graph")


def build_ours_step_in_graph_auto(ctx: ModeContext) -> Step:
    # the cap chosen from an all-reduce timed on the process group at compile time (ddp/bucketing/auto_cap.py)
    return _ours_step(ctx, ddp="in_graph", bucket_cap_mb="auto")


def build_ours_step_in_backward(ctx: ModeContext) -> Step:
    # update 1 runs eagerly (it creates the optimizer state), updates 2.. run per bucket inside the
    # compiled backward; report()["optimizer_in_backward"] (in the job's info) says whether it did
    return _ours_step(ctx, ddp="in_graph", optimizer_in_backward=True)


def _unfused(ctx: ModeContext) -> None:
    """`fused=False` on every param group: the user's word that their step is not torch's fused kernel, so the
    train step's update is the backend's compile of the update math (issue 34: on one H100 Inductor's AdamW
    kernels kept the GPU 1.3 ms a step less than the fused kernel, GPT-2 small, fp32)."""
    for group in ctx.optimizer.param_groups:
        group["fused"] = False


def build_ours_step_in_graph_unfused(ctx: ModeContext) -> Step:
    _unfused(ctx)
    return _ours_step(ctx, ddp="in_graph")


def build_ours_step_in_backward_unfused(ctx: ModeContext) -> Step:
    _unfused(ctx)
    return _ours_step(ctx, ddp="in_graph", optimizer_in_backward=True)


def build_ours_step_in_backward_cpp(ctx: ModeContext) -> Step:
    """The in-backward step with Inductor's C++ wrapper (`options={"cpp_wrapper": True}`): each graph's call, its
    input checks and launches run in C++ instead of Python, where the in-backward step's graphs take about 450
    inputs (the optimizer state); on the 2-core CPU (tiny GPT, session 62) 3.64 ms a step against 4.13, at about
    40 s more compile."""
    if ctx.backend != "inductor":
        raise ModeUnavailable(f"cpp_wrapper is an Inductor option; this run's backend is {ctx.backend!r}")
    if ctx.compile_mode:
        raise ModeUnavailable(f"options= (cpp_wrapper) cannot go with mode={ctx.compile_mode!r} in one compile")
    return _ours_step(ctx, ddp="in_graph", optimizer_in_backward=True, options={"cpp_wrapper": True})
