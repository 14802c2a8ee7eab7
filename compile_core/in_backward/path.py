"""`InBackwardPath`: the train step's update path with `optimizer_in_backward=True` (an `UpdatePath`,
compile_core/step/update_path.py).

Update 1 runs as eager DDP where it can (`EagerFirstUpdate`: it creates the optimizer state and shows
which parameters get gradients from outside the model's outputs), or on the compiled model; from update 2
the compiled backward updates each bucket's parameters (the controller says when), and torch's step after
it updates only the parameters the backward left with a gradient. Whenever the update is not inside the
backward for good (an optimizer or model that does not fit, a GradScaler, CUDA graphs with accumulation),
the path it wraps (compiled or eager after the backward) runs it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from compile_core.in_backward.controller import InBackwardController
from compile_core.step.accumulation import accumulates_under_cuda_graphs
from compile_core.step.config import TrainStepConfig
from compile_core.step.update import clip_and_step
from compile_core.step.update_path import EagerMicroBatch, UpdateContext, UpdatePath
from ddp.in_graph.probe import eager_outside_producers, gradient_uses

logger = logging.getLogger(__name__)


def in_backward_blocker(config: TrainStepConfig, *, grad_scaler: bool, device_type: str) -> str | None:
    """Why `optimizer_in_backward=True` keeps the update after the backward from the first step on, or None
    (`device_type`: where the model's parameters are; CUDA graphs exist on CUDA only)."""
    if grad_scaler:
        return "a GradScaler must see every gradient before any update"
    if accumulates_under_cuda_graphs(config, device_type):
        # Seen on the GPU: H100, torch 2.11, mode="reduce-overhead", world size 1, a small GPT
        # (`python -m tests.multi_gpu.cudagraph_probe`, session 61). Without accumulation the update inside the
        # captured backward trained as eager DDP does (8.7e-4 of eager's update; 1.1e-3 with clip_grad_norm,
        # the CPU's figures without CUDA graphs) and no graph was left out of CUDA graphs; with accum_steps=2
        # a read of a CUDA graph's output that a later replay had overwritten stopped it ("accessing tensor
        # output of CUDAGraphs that has been overwritten by a subsequent run"). torch 2.13 words that error for
        # accumulated gradients, and the step now copies them out of the graphs' pool
        # (compile_core/step/accumulation.py, session 62); the refusal stays until the probe, which lifts it,
        # trains in_backward_accum as eager DDP on a GPU.
        return (
            f"CUDA graphs (mode='reduce-overhead' or 'max-autotune', or triton.cudagraphs) with accum_steps="
            f"{config.accum_steps}: a read of a CUDA graph's output that a later replay had overwritten stopped our "
            "GPU run of it; use accum_steps=1, or mode='max-autotune-no-cudagraphs' or the default mode to update "
            "inside the backward while accumulating"
        )
    return None


class EagerFirstUpdate:
    """The micro-batches of update 1 as eager DDP (an `EagerMicroBatch`).

    Update 1 creates the optimizer state the backward updates from update 2 on; compiled, it needs a
    variant of its own (a backward that reduces without updating) compiled for that one update. As
    eager DDP it costs one eager step, and the autograd graph, read before its backward, shows the
    parameters that get gradients from outside the model's outputs, which the compiled backward must
    leave to the step after it, and how many ops take each parameter (a graph holding fewer shares it)."""

    def __init__(self, ctx: UpdateContext) -> None:
        self.ctx = ctx
        self.outside: set[int] = set()
        """Parameters update 1's micro-batches found with gradients from outside the model's outputs."""
        self.uses: dict[int, int] = {}
        """Per parameter id: the most ops that took it in one of update 1's micro-batches."""

    def running(self) -> Any:
        return self.ctx.compiled.eager()

    def before_backward(self, output: Any, loss: torch.Tensor) -> None:
        self.outside |= eager_outside_producers(output, loss)
        for pid, count in gradient_uses(loss).items():
            self.uses[pid] = max(count, self.uses.get(pid, 0))

    def after_sync_backward(self) -> None:
        self.ctx.compiled.in_graph.after_eager_step(self.outside, self.uses)


class InBackwardPath:
    """The update inside the compiled backward, around the path `after` (see the module docstring)."""

    def __init__(self, ctx: UpdateContext, after: UpdatePath) -> None:
        self.ctx = ctx
        self.after = after
        self.controller = InBackwardController(
            ctx.optimizer,
            ctx.compiled.in_graph,
            clip_max_norm=ctx.config.clip_grad_norm,
            # Inductor compiles the update graph of a 16-bit parameter into one kernel that rounds once, as
            # torch's fused kernel does; the other backends run it op by op, rounding as eager's step
            half_on_kernel=ctx.config.backend == "inductor",
            blocker=in_backward_blocker(
                ctx.config, grad_scaler=ctx.grad_scaler is not None, device_type=ctx.device_type
            ),
        )
        if self.controller.reason is not None:
            logger.warning("train_step: optimizer update stays after the backward: %s", self.controller.reason)
        self._eager = EagerFirstUpdate(ctx)

    def before_forward(self, index: int, *, sync: bool, first: bool) -> EagerMicroBatch | None:
        if sync:
            self.controller.before_sync_step(index)  # this update's scalars (the scheduler's lr, betas)
        return self._eager if self._eager_first(index) else None

    def _eager_first(self, index: int) -> bool:
        return index == 1 and self.controller.eager_first_update(self.ctx.ddp)

    def apply(self, index: int) -> torch.Tensor | None:
        ctx, controller = self.ctx, self.controller
        if controller.applied():
            # The backward updated the parameters it reduced alone; the others (reduced after it,
            # ignored by DDP, or first seen with a gradient) hold their gradient: torch's step
            # updates exactly those and skips the rest (gradient None).
            if any(p.grad is not None for p in ctx.params):
                ctx.optimizer.step()
            return controller.updates.norm
        if controller.reason is None:
            # Update 1 (or one that recreates lost state) runs eagerly with the user's own hyperparameters:
            # it creates the optimizer state the backward will update.
            ran_eagerly = self._eager_first(index)
            norm = clip_and_step(ctx.params, ctx.config.clip_grad_norm, ctx.optimizer)()
            controller.after_update(index, ran_eagerly=ran_eagerly)
            return norm
        return self.after.apply(index)

    def mode(self) -> str:
        return "inside the backward" if self.controller.active else self.after.mode()

    def params_changed(self) -> None:
        self.after.params_changed()

    def report_fields(self) -> dict[str, Any]:
        return {**self.after.report_fields(), "optimizer_in_backward": self.controller.to_dict(True)}
