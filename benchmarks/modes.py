"""How each benchmark mode builds its training step (runs inside a rank process).

Every builder gets the same DDP model and optimizer and returns a `Step`: `step(x, y)` runs forward, loss,
backward, optimizer step and zero_grad, and returns the loss (detached). `info()` reports what the mode
could tell about itself (graph pieces, the compile report, planned buckets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from pathlib import Path
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
    elif mode in ("torch_python_reducer", "torch_reducer_overlap"):
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


def build_torch_savvy(ctx: ModeContext, first_step: Callable[..., None] | None = None) -> Step:
    """What a PyTorch user who read the tutorials does: torch.compile the DDP model (DDPOptimizer splits
    it at bucket boundaries) and torch.compile a function that calls optimizer.step() (the form of
    PyTorch's "Compiling the optimizer with torch.compile" recipe), same backend for both. The lr stays
    a constant Python float: the benchmark has no scheduler, so it never causes a recompile.

    On torch 2.14 this is also what a 2.14 user gets: its new default pass (Inductor's simple_overlap)
    moves collectives and waits inside compiled graphs, and DDPOptimizer's graphs hold none (DDP's reducer
    all-reduces from its hooks, outside them). `first_step(compiled, x, y)`, when given, runs once inside
    the first (timed) step before it (the start-up variants below)."""
    counter = _PieceCounter().install()
    compiled = torch.compile(ctx.ddp, **compile_options(ctx))
    optimizer = ctx.optimizer
    pending = [first_step] if first_step is not None else []

    @torch.compile(**compile_options(ctx))
    def optimizer_step() -> None:
        optimizer.step()

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        while pending:
            pending.pop()(compiled, x, y)
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


def build_torch_python_reducer(ctx: ModeContext, optimizer_step: Callable[[], None] | None = None) -> Step:
    # a --comm-hook runs here too: the python reducer calls it once per parameter with (grad, param), which
    # torch's compress hooks take (they all-reduce that gradient in 16 bits, traced by compiled autograd).
    # DDP's constructor turns on Inductor's concat fusion of these all-reduces (_fuse_ddp_communication, at
    # the DDP object's bucket_cap_mb); torch 2.14's default simple_overlap pass then moves them in the graph
    ddp = ctx.ddp
    step = optimizer_step or ctx.optimizer.step

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_region(ctx):
            loss = lm_loss(ddp(x), y)
        loss.backward()
        return loss.detach()

    compiled = torch.compile(forward_backward, **compile_options(ctx))

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = compiled(x, y)
        step()
        ctx.optimizer.zero_grad(set_to_none=True)
        return loss

    return Step(run=run, info=lambda: {"note": "python reducer: DDP comm hooks are bypassed", **_overlap_flags()})


# ---- what torch 2.14 offers over 2.13 (issue 36, item 4): each mode says where its torch lacks it ----------


def _overlap_flags() -> dict[str, Any]:
    """The Inductor switches that decide what happens to the all-reduces inside a compiled graph."""
    from torch._inductor import config as inductor_config

    opts = getattr(inductor_config, "aten_distributed_optimizations", None)
    names = ("enable_simple_overlap", "enable_overlap_scheduling", "collective_bucketing")
    return {
        "fuse_ddp_communication": getattr(inductor_config, "_fuse_ddp_communication", None),
        **{name: getattr(opts, name, None) for name in names},
    }


def build_torch_reducer_overlap(ctx: ModeContext) -> Step:
    """Compiled autograd + python_reducer with the all-reduces of the compiled backward bucketed and placed
    by Inductor's overlap scheduler (aten_distributed_optimizations: enable_overlap_scheduling,
    collective_bucketing; bucket sizes from its cost model, not from a cap) instead of DDP's concat fusion,
    and optimizer.step() torch.compile'd as in torch_savvy: the strongest compiled-autograd setup a 2.14
    user can switch on."""
    from torch._inductor import config as inductor_config

    opts = getattr(inductor_config, "aten_distributed_optimizations", None)
    if opts is None or not hasattr(opts, "collective_bucketing"):
        raise ModeUnavailable(
            f"torch {torch.__version__} has no Inductor overlap scheduler with collective bucketing "
            "(torch._inductor.config.aten_distributed_optimizations.collective_bucketing)"
        )
    if next(ctx.model.parameters()).device.type != "cuda":
        # seen on 2.14.1 (CUDA wheel, no GPU): its cost model reads the GPU's DRAM bandwidth through Triton's
        # driver (fusion_regions.estimate_fused_node_costs -> get_gpu_dram_gbps; the roofline estimator too)
        raise ModeUnavailable(
            f"torch {torch.__version__}: Inductor's overlap scheduler estimates every op with a GPU's bandwidth "
            "(get_gpu_dram_gbps through Triton's driver) and fails on a CPU-only machine ('0 active drivers'); "
            "on the CPU, torch_python_reducer is what compiled autograd offers (DDP's concat fusion, simple_overlap)"
        )
    # DDP's constructor (python reducer) switched its own concat fusion on; the scheduler buckets instead
    inductor_config._fuse_ddp_communication = False
    opts.enable_overlap_scheduling = True
    opts.collective_bucketing = True
    optimizer = ctx.optimizer

    @torch.compile(**compile_options(ctx))
    def optimizer_step() -> None:
        optimizer.step()

    step = build_torch_python_reducer(ctx, optimizer_step)
    return Step(run=step.run, info=lambda: {**step.info(), "optimizer_compiled": "torch.compile(optimizer.step)"})


def _one_rank_compiles(ctx: ModeContext, log: dict[str, Any]) -> Callable[..., None]:
    """torch_savvy_one_rank's first-step prologue: rank 0 runs one forward and backward of the compiled
    model under DDP's no_sync (no collective, so it runs alone: it compiles every piece, forward and
    backward, AOTAutograd compiling a backward at its first call), drops the gradients, and hands the
    mega-cache (`torch.compiler.save_cache_artifacts`) to the other ranks, which wait in the broadcast
    and load it (`load_cache_artifacts`) before their own first step: their compiles then hit the caches.
    Torch ships the parts, not this sequence (its _precompile.py: broadcasting an artifact is "a
    follow-up"); each rank still traces with Dynamo and compiles its own optimizer step."""
    import torch.distributed as dist

    def prologue(compiled: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        group = ctx.ddp.process_group
        payload: list[Any] = [None]
        if dist.get_rank(group) == 0:
            with ctx.ddp.no_sync():
                with autocast_region(ctx):
                    loss = lm_loss(compiled(x), y)
                loss.backward()
            ctx.optimizer.zero_grad(set_to_none=True)
            saved = torch.compiler.save_cache_artifacts()
            payload = [saved[0] if saved else None]
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        log["megacache_bytes"] = len(payload[0]) if payload[0] is not None else 0
        if dist.get_rank(group) != 0 and payload[0] is not None:
            log["loaded"] = _cache_info(torch.compiler.load_cache_artifacts(payload[0]))

    return prologue


def _cache_info(info: Any) -> dict[str, int] | None:
    """Artifact counts of a torch.compiler CacheInfo (its `artifacts`: kind -> keys), by kind (None: nothing)."""
    if info is None:
        return None
    return {kind: len(keys) for kind, keys in getattr(info, "artifacts", {}).items()}


def build_torch_savvy_one_rank(ctx: ModeContext) -> Step:
    """torch_savvy with torch 2.14's compile_on_one_rank (graphs compiled free of rank-specific values, so
    one rank's artifacts serve every rank) and the prologue of `_one_rank_compiles`: start-up only."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "compile_on_one_rank"):
        raise ModeUnavailable(
            f"torch {torch.__version__} has no torch.compiler.config.compile_on_one_rank (torch 2.14 has it)"
        )
    config.compile_on_one_rank = True
    log: dict[str, Any] = {}
    step = build_torch_savvy(ctx, first_step=_one_rank_compiles(ctx, log))
    return Step(run=step.run, info=lambda: {**step.info(), "compile_on_one_rank": True, **log})


def build_torch_savvy_megacache(ctx: ModeContext) -> Step:
    """torch_savvy started as on a new machine given the artifacts of an earlier job: every job of this mode
    compiles into an empty Inductor cache dir of its own (its ranks share it), and the first step loads the
    mega-cache file rank 0 of an earlier job of this mode saved (`save_cache_artifacts`, after the timed
    steps) in the cache dir the runner keeps for the mode's cold and warm jobs. Its cold job has no file;
    its warm job has the file and nothing else. Start-up only."""
    import torch.distributed as dist

    if not hasattr(torch.compiler, "load_cache_artifacts"):
        raise ModeUnavailable(f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts")
    kept = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not kept:
        raise ModeUnavailable("torch_savvy_megacache needs the runner's TORCHINDUCTOR_CACHE_DIR (one per mode)")
    # one fresh dir per job (MASTER_PORT is the job's), shared by its ranks as one machine's default dir is
    fresh = Path(kept) / f"fresh_{os.environ.get('MASTER_PORT', os.getpid())}"
    fresh.mkdir(exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(fresh)  # Inductor reads it at every lookup
    artifacts = Path(kept) / "megacache.bin"
    log: dict[str, Any] = {"megacache_file": artifacts.exists()}

    def load(compiled: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        if artifacts.exists():
            log["loaded"] = _cache_info(torch.compiler.load_cache_artifacts(artifacts.read_bytes()))

    step = build_torch_savvy(ctx, first_step=load)

    def info() -> dict[str, Any]:
        if dist.get_rank() == 0 and not artifacts.exists():
            saved = torch.compiler.save_cache_artifacts()
            if saved:
                partial = artifacts.with_suffix(".part")
                partial.write_bytes(saved[0])
                partial.replace(artifacts)  # a reader sees the whole file or none
                log["saved_bytes"] = len(saved[0])
        return {**step.info(), **log}

    return Step(run=step.run, info=info)


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


def build_ours_step_in_graph_auto(ctx: ModeContext) -> Step:
    # the cap chosen from an all-reduce timed on the process group at compile time (ddp/bucketing/auto_cap.py)
    return _ours_step(ctx, ddp="in_graph", bucket_cap_mb="auto")


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
    "torch_reducer_overlap": build_torch_reducer_overlap,
    "torch_savvy_one_rank": build_torch_savvy_one_rank,
    "torch_savvy_megacache": build_torch_savvy_megacache,
    "ours_compile": build_ours_compile,
    "ours_in_graph": build_ours_in_graph,
    "ours_step": build_ours_step,
    "ours_step_in_graph": build_ours_step_in_graph,
    "ours_step_in_graph_auto": build_ours_step_in_graph_auto,
    "ours_step_in_backward": build_ours_step_in_backward,
}
