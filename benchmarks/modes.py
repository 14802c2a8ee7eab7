"""How each benchmark mode builds its training step (runs inside a rank process).

Every builder gets the same DDP model and optimizer and returns a `Step`: `step(x, y)` runs forward, loss,
backward, optimizer step and zero_grad, and returns the loss (detached). `info()` reports what the mode
could tell about itself (graph pieces, the compile report, planned buckets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import lm_loss


class ModeUnavailable(RuntimeError):
    """Raised by a mode builder when the mode cannot run on this torch build or machine; the table says why."""


@dataclasses.dataclass(kw_only=True)
class Step:
    """A built training step."""

    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """step(x, y) -> detached loss; does forward, backward, optimizer step, zero_grad."""
    info: Callable[[], dict[str, Any]] = dict
    """Mode-specific facts, JSON-ready (pieces, compile report, planned buckets)."""


@dataclasses.dataclass(kw_only=True)
class ModeContext:
    """What a builder needs."""

    ddp: DDP | None
    """The DDP-wrapped model (already constructed with the mode's DDP settings and comm hook); None for floor."""
    model: torch.nn.Module
    """The model itself (`ddp.module` where there is a DDP object)."""
    optimizer: torch.optim.Optimizer
    """The run's optimizer (SGD or AdamW, see `make_optimizer`) over the model's parameters."""
    backend: str
    """Compiler backend name."""
    compile_mode: str | None = None
    """The torch.compile mode (--compile-mode, e.g. reduce-overhead) of every compiled mode; None: the default."""
    mark_backward: Callable[[], None]
    """Called right before loss.backward() (the overlap recorder's backward-start mark; a no-op otherwise)."""
    comm_hook: str | None = None
    """The comm hook the worker registered on `ddp` (--comm-hook: None or 'fp16')."""
    reduce_dtype: torch.dtype | None = None
    """reduce_dtype= for our ddp='in_graph' modes (--reduce-dtype); None: the gradients' dtype."""
    autocast: torch.dtype | None = None
    """--autocast: forward and loss of every mode under `torch.autocast(device, dtype)` (train_step modes get
    `autocast=`, which does the same inside the step); None: fp32 throughout."""


def autocast_region(ctx: ModeContext) -> contextlib.AbstractContextManager:
    """What the forward and the loss run under: the run's autocast on the model's device, or nothing."""
    if ctx.autocast is None:
        return contextlib.nullcontext()
    device = next(ctx.model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=ctx.autocast)


def compile_options(ctx: ModeContext) -> dict[str, Any]:
    """backend= and, when the run names one, mode=: what every compile call of every mode takes."""
    return {"backend": ctx.backend, **({"mode": ctx.compile_mode} if ctx.compile_mode else {})}


def make_optimizer(name: str, params, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer every mode of a run uses (names and arguments: benchmarks.config.OPTIMIZERS)."""
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
    if name not in classes:
        raise ValueError(f"optimizer {name!r}: choose from {sorted(classes)}")
    return classes[name](params, **kwargs)


def configure_dynamo(mode: str) -> None:
    """Global Dynamo settings a mode needs; must run BEFORE DDP is constructed (DDP reads them in __init__)."""
    import torch._dynamo

    if mode == "torch_nosplit":
        torch._dynamo.config.optimize_ddp = False
    elif mode == "torch_python_reducer":
        torch._dynamo.config.optimize_ddp = "python_reducer"
        # torch 2.13 recommends the config flag over compiled_autograd._enable(): backward calls made
        # inside a torch.compile'd function are then traced by compiled autograd.
        torch._dynamo.config.compiled_autograd = True
    else:
        torch._dynamo.config.optimize_ddp = True


class _PieceCounter(logging.Handler):
    """Reads DDPOptimizer's "created N buckets" INFO line: one per graph it split."""

    PATTERN = re.compile(r"DDPOptimizer used bucket cap (\d+) and created (\d+) buckets")

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.pieces: list[int] = []
        self.cap_bytes: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        match = self.PATTERN.search(record.getMessage())
        if match:
            self.cap_bytes = int(match.group(1))
            self.pieces.append(int(match.group(2)))

    def install(self) -> "_PieceCounter":
        logger = logging.getLogger("torch._dynamo.backends.distributed")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self


def _eager_optimizer_step(ctx: ModeContext, forward: Callable[[torch.Tensor], torch.Tensor]):
    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_region(ctx):
            loss = lm_loss(forward(x), y)
        ctx.mark_backward()
        loss.backward()
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def build_eager(ctx: ModeContext) -> Step:
    return Step(run=_eager_optimizer_step(ctx, ctx.ddp))


def _build_torch_compile(ctx: ModeContext) -> Step:
    counter = _PieceCounter().install()
    compiled = torch.compile(ctx.ddp, **compile_options(ctx))
    return Step(
        run=_eager_optimizer_step(ctx, compiled),
        info=lambda: {
            "pieces_per_graph": counter.pieces,
            "pieces": sum(counter.pieces) or None,
            "ddpopt_cap_bytes": counter.cap_bytes,
        },
    )


def build_torch_ddpopt(ctx: ModeContext) -> Step:
    return _build_torch_compile(ctx)


def build_torch_nosplit(ctx: ModeContext) -> Step:
    step = _build_torch_compile(ctx)
    return Step(run=step.run, info=lambda: {"pieces": 1})


def build_torch_savvy(ctx: ModeContext) -> Step:
    """What a PyTorch user who read the tutorials does: torch.compile the DDP model (DDPOptimizer splits
    it at bucket boundaries) and torch.compile a function that calls optimizer.step() (the form of
    PyTorch's "Compiling the optimizer with torch.compile" recipe), same backend for both. The lr stays
    a constant Python float: the benchmark has no scheduler, so it never causes a recompile."""
    counter = _PieceCounter().install()
    compiled = torch.compile(ctx.ddp, **compile_options(ctx))
    optimizer = ctx.optimizer

    @torch.compile(**compile_options(ctx))
    def optimizer_step() -> None:
        optimizer.step()

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_region(ctx):
            loss = lm_loss(compiled(x), y)
        ctx.mark_backward()
        loss.backward()
        optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Step(
        run=run,
        info=lambda: {
            "pieces_per_graph": counter.pieces,
            "pieces": sum(counter.pieces) or None,
            "ddpopt_cap_bytes": counter.cap_bytes,
            "optimizer_compiled": "torch.compile(optimizer.step)",
        },
    )


def build_torch_python_reducer(ctx: ModeContext) -> Step:
    # a --comm-hook runs here too: the python reducer calls it once per parameter with (grad, param), which
    # torch's compress hooks take (they all-reduce that gradient in 16 bits, traced by compiled autograd)
    ddp = ctx.ddp

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_region(ctx):
            loss = lm_loss(ddp(x), y)
        loss.backward()
        return loss.detach()

    compiled = torch.compile(forward_backward, **compile_options(ctx))

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = compiled(x, y)
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
        return loss

    return Step(run=run, info=lambda: {"note": "python reducer: DDP comm hooks are bypassed"})


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
    return Step(run=_eager_optimizer_step(ctx, compiled), info=lambda: _report_info(compiled))


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


def build_ours_step_in_backward(ctx: ModeContext) -> Step:
    # update 1 runs eagerly (it creates the optimizer state), updates 2.. run per bucket inside the
    # compiled backward; report()["optimizer_in_backward"] (in the job's info) says whether it did
    return _ours_step(ctx, ddp="in_graph", optimizer_in_backward=True)


BUILDERS: dict[str, Callable[[ModeContext], Step]] = {
    "eager": build_eager,
    "torch_ddpopt": build_torch_ddpopt,
    "torch_nosplit": build_torch_nosplit,
    "torch_python_reducer": build_torch_python_reducer,
    "torch_savvy": build_torch_savvy,
    "ours_compile": build_ours_compile,
    "ours_in_graph": build_ours_in_graph,
    "ours_step": build_ours_step,
    "ours_step_in_graph": build_ours_step_in_graph,
    "ours_step_in_backward": build_ours_step_in_backward,
}
