"""What a benchmark mode's builder gets (`ModeContext`) and returns (`Step`, or `ModeUnavailable` where this torch
or machine cannot run the mode), and what every builder shares: the autocast region, the compile options and the
step around an eager optimizer. The builders are in benchmarks/modes_torch.py (PyTorch's setups) and
benchmarks/modes_ours.py (compile_core's), listed by name in benchmarks/modes.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


def eager_optimizer_step(ctx: ModeContext, forward: Callable[[torch.Tensor], torch.Tensor]):
    """`step(x, y)` with an eager optimizer: `forward` (the DDP model, compiled or not) and the loss under
    `autocast_region`, backward, `optimizer.step()`, zero_grad; returns the detached loss."""

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_region(ctx):
            loss = lm_loss(forward(x), y)
        ctx.mark_backward()
        loss.backward()
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return run
