"""PyTorch's own setups as benchmark modes, from eager DDP to the strongest compiled ones, and what torch 2.14
offers over 2.13 (each 2.14 mode says where its torch lacks the mechanism). Each builder takes a `ModeContext`
and returns a `Step` (benchmarks/mode_context.py); benchmarks/modes.py lists them by name.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.mode_context import (
    ModeContext,
    ModeUnavailable,
    Step,
    autocast_region,
    compile_options,
    eager_optimizer_step,
)
from examples.gpt import lm_loss


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


def build_eager(ctx: ModeContext) -> Step:
    return Step(run=eager_optimizer_step(ctx, ctx.ddp))


def _build_torch_compile(ctx: ModeContext) -> Step:
    counter = _PieceCounter().install()
    compiled = torch.compile(ctx.ddp, **compile_options(ctx))
    return Step(
        run=eager_optimizer_step(ctx, compiled),
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


def build_torch_fused(ctx: ModeContext) -> Step:
    """torch.compile(ddp_model) (DDPOptimizer) + the optimizer's own fused step, eagerly (`fused=True` set on its
    groups before step 1): what a user who read the optimizer docs ("fused is typically fastest") does instead
    of compiling the step. It compiles no update at all; train_step runs a foreach Adam/AdamW this way too
    (compile_core/step/fused.py), so this separates our layer from the choice of update kernel."""
    optimizer = ctx.optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        raise ModeUnavailable(f"{type(optimizer).__name__} has no fused step in torch (Adam, AdamW and SGD do)")
    for group in optimizer.param_groups:
        group["foreach"], group["fused"] = False, True
    step = _build_torch_compile(ctx)
    return Step(run=step.run, info=lambda: {**step.info(), "optimizer_compiled": "no: torch's fused step"})


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
