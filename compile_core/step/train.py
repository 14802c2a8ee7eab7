"""One call per micro-batch: compiled forward + loss, backward, and a compiled optimizer update.

    step = train_step(ddp_model, optimizer, loss_fn, backend="inductor", accum_steps=4,
                      clip_grad_norm=1.0, lr_scheduler=sched)
    for inputs, target in loader:
        loss = step(inputs, target)      # detached; nothing here forces a host sync

Note (design):
    The step has three parts, each captured where it can be and reported separately.

    1. Forward + loss. The model goes through `compile_core.compile` (bucket-aligned graph pieces,
       AOT-paired backward); `loss_fn` runs on its output under the optional autocast, and
       `loss / accum_steps` is back-propagated. DDP's reducer is left in charge of the all-reduce, so
       accumulation uses DDP's own `no_sync()`, which has to cover forward *and* backward: DDP decides
       in the forward whether the coming backward will reduce.
    2. Gradient accumulation. Each call consumes ONE micro-batch, as in a hand-written PyTorch loop;
       the optimizer steps on every `accum_steps`-th call (`step.applied` tells which). The first
       k-1 micro-batches run under `no_sync()`, the k-th synchronises, and every micro-batch loss is
       scaled by 1/k, so the update equals eager DDP doing the same accumulation. The returned loss
       is the micro-batch's own (unscaled) loss, what one logs.
    3. Optimizer update: one `UpdatePath` object (compile_core/step/update_path.py), chosen once by
       `make_update_path`. By default `clip_grad_norm_` and `optimizer.step()` run compiled after the
       backward, with the same backend as the model (compile_core/step/after_backward.py: per repeated
       block for SGD/Adam/AdamW, else as one function). A scheduler that writes a new Python float
       into `param_groups` every step would make Dynamo recompile every step (it guards on the
       value), so before the first compile the learning rate (and Adam's beta1, which
       OneCycleLR/CyclicLR cycle) is replaced by a 0-dim tensor that we own; before every update we
       copy whatever the scheduler wrote into that tensor and put the tensor back. The compiled
       graph reads the tensor, so new values never invalidate it. (SGD's momentum,
       which OneCycleLR also cycles, stays a float: torch's SGD branches on `momentum != 0`, and
       Dynamo passes that float in as a graph input without recompiling. SGD does recompile once,
       at update 2, because it creates its momentum buffers in update 1.) A post-hook on
       `optimizer.state_dict()` turns those tensors back into floats (and restores flags we had
       to change), so checkpoints stay in the user's format and load into a plain eager optimizer.
       If the update cannot be compiled, it runs eagerly from then on and the report says why. With
       a GradScaler it runs eagerly; with every param group `fused=True`, torch's fused step runs as
       it is (one launch per device and dtype already; Dynamo does not trace it), and so does a
       multi-tensor (foreach) SGD, Adam or AdamW, set to fused only while it steps (compile_core/step/fused.py:
       compiled whole, its step was the largest compile of a train step on a GPU); with
       `optimizer_in_backward=True` inside the compiled backward (compile_core/in_backward/).
       After the update: `zero_grad(set_to_none=True)`, the scheduler.

    What Dynamo makes of `optimizer.step()` (torch 2.13): torch's optimizers break the graph on
    purpose around the update (so AOTAutograd sees a no-grad graph), and a scheduler's wrapper
    around `optimizer.step` is a skipped frame; the update itself is then captured in the nested
    frame. Dynamo never fails loudly on what it cannot trace, it runs it eagerly, so "compiled" is
    checked, not assumed: after the first update, if no compiled graph read the parameters, the
    update counts as not compiled (reason: Dynamo's graph-break messages) and runs eagerly.

    Recompiles are counted, not assumed: both parts are compiled through one `CompileEvents`
    recorder each (compile_core/events.py): every graph handed to the backend is counted and
    Dynamo's guard-failure hook supplies the reason of each recompile.

    Where things live: compile_core/step/__init__.py lists the package's files.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from aot import torch_eager
from compile_core import progress
from compile_core.events import CompileEvents
from compile_core.in_backward import InBackwardPath
from compile_core.step.accumulation import GradsOutOfGraphPool, accumulates_under_cuda_graphs
from compile_core.step.after_backward import CompiledPath, FusedStepPath, ScalerPath
from compile_core.step.checks import NO_TARGET, check_inputs, check_loss, split_args
from compile_core.step.config import TrainStepConfig
from compile_core.step.fused import FusedWhileStepping, fused_instead
from compile_core.step.hyperparams import HyperparamPins
from compile_core.step.report import OptimizerReport, TrainStepReport
from compile_core.step.update import fused_step
from compile_core.step.update_path import EagerMicroBatch, UpdateContext, UpdatePath

logger = logging.getLogger(__name__)

__all__ = ["TrainStep", "TrainStepConfig", "TrainStepReport", "OptimizerReport", "make_update_path", "train_step"]


class TrainStep:
    """Callable training step; build it with `train_step(...)`. See the module Note for the design."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        config: TrainStepConfig,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
    ) -> None:
        check_inputs(model, optimizer, loss_fn, lr_scheduler, grad_scaler, config)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self.compiled_model = _compile_model(model, config)
        """`model` itself, compiled in place (compile_core/in_place.py); handed `torch.compile(ddp)`, the DDP model."""
        model = self.model = self.compiled_model
        self._compiled = self.compiled_model.compile_state
        if self._compiled.in_graph is not None:
            # nothing touches .grad between our forward and backward: accumulate inside the graph
            self._compiled.in_graph.accumulated.move_out = True
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._device_type = _device_type(model)
        self._out_of_pool = GradsOutOfGraphPool() if accumulates_under_cuda_graphs(config, self._device_type) else None
        """Under CUDA graphs with accumulation: the accumulated `.grad` copied out of the graphs' memory pool."""
        self._micro_batches = 0
        self._updates = 0
        self.applied = False
        """True when the last call applied an optimizer update."""
        self.last_grad_norm: torch.Tensor | None = None
        """Total gradient norm before clipping at the last update (a tensor; None without clipping)."""
        self._context = UpdateContext(
            model=model,
            optimizer=optimizer,
            config=config,
            compiled=self._compiled,
            ddp=self._ddp,
            grad_scaler=grad_scaler,
            device_type=self._device_type,
            events=CompileEvents(breaks_from="counters", name="optimizer update"),
            pins=HyperparamPins(optimizer),
            params=[p for g in optimizer.param_groups for p in g["params"]],
        )
        self.update: UpdatePath = make_update_path(self._context)
        """The optimizer update, one object whatever runs it (compile_core/step/update_path.py)."""

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, *args: Any, target: Any = NO_TARGET, **keyword_inputs: Any) -> torch.Tensor:
        """`step(*inputs, target)` or `step(*inputs, target=target)`: one micro-batch; keyword inputs go to the
        model as keywords (`step(**batch, target=None)`: `model(**batch)`)."""
        inputs, target = split_args(args, target, keyword_inputs)
        progress.report()  # for a launcher watching for hangs (compile_core/progress.py)
        sync = self.pending_micro_batches == self.config.accum_steps - 1
        eager = self.update.before_forward(self._updates + 1, sync=sync, first=self._micro_batches == 0)
        loss = self._forward_backward(inputs, keyword_inputs, target, sync=sync, eager=eager)
        self._micro_batches += 1
        self.applied = sync
        if sync:
            self._apply_update()
        return loss

    def _forward_backward(
        self,
        inputs: tuple[Any, ...],
        keyword_inputs: dict[str, Any],
        target: Any,
        *,
        sync: bool,
        eager: EagerMicroBatch | None,
    ) -> torch.Tensor:
        # no_sync must cover the forward too: DDP arms the reducer for the next backward there.
        skip_sync = self._ddp.no_sync() if (self._ddp is not None and not sync) else contextlib.nullcontext()
        # `eager`: the update path runs this micro-batch as eager DDP (update 1 with the optimizer in the backward)
        with skip_sync, eager.running() if eager is not None else contextlib.nullcontext():
            with self._autocast():
                output = self.compiled_model(*inputs, **keyword_inputs)
                loss = self.loss_fn(output, target)
            check_loss(loss)
            scaled = loss / self.config.accum_steps if self.config.accum_steps > 1 else loss
            if self.grad_scaler is not None:
                scaled = self.grad_scaler.scale(scaled)
            if eager is not None:
                eager.before_backward(output, scaled)
            # autograd keeps what the backward needs; a reference held here would keep the whole output (a
            # language model's logits: the step's largest tensor) alive through the backward, where the
            # memory peak sits, as the eager loop `loss_fn(model(x), y).backward()` does not
            del output
            scaled.backward()
        if eager is not None and sync:
            eager.after_sync_backward()
        if self._out_of_pool is not None and not sync:
            self._out_of_pool.after_accumulating_backward(self.model.parameters())
        return loss.detach()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, dtype=self.config.autocast)

    def _apply_update(self) -> None:
        index = self._updates + 1
        self._follow_param_groups()
        norm = self.update.apply(index)
        # a compiled update (or one inside the backward) never calls `optimizer.step()`: a scheduler, ours or the
        # user's, would warn that it is stepped before the optimizer
        torch_eager.mark_stepped(self.optimizer)
        self.last_grad_norm = None if norm is None else norm.detach().clone()
        self.optimizer.zero_grad(set_to_none=True)
        if self._out_of_pool is not None:
            self._out_of_pool.after_update()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._updates = index
        logger.debug(  # every step: DEBUG, so that INFO stays for compile progress
            "train_step: update %d applied after %d micro-batch(es) (optimizer %s, %s)",
            index,
            self.config.accum_steps,
            type(self.optimizer).__name__,
            self.update.mode(),
        )

    def _follow_param_groups(self) -> None:
        """A param group added since the update was built (`optimizer.add_param_group`, as Lightning's
        fine-tuning callbacks unfreeze a backbone): an update built for the old groups would never step
        its parameters. The update is built again; their first update is torch's own step, which creates
        their state."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        known = self._context.params
        if len(params) == len(known) and all(a is b for a, b in zip(params, known)):
            return
        self._context.params = params
        self.update.params_changed()

    # -- introspection ----------------------------------------------------------------------------
    def report(self) -> TrainStepReport:
        backend = (
            self.config.backend
            if isinstance(self.config.backend, str)
            else getattr(self.config.backend, "__name__", repr(self.config.backend))
        )
        return TrainStepReport(
            model=self._compiled.report(),
            backend=backend,
            accum_steps=self.config.accum_steps,
            micro_batches=self._micro_batches,
            updates=self._updates,
            **self.update.report_fields(),
        )

    @property
    def updates(self) -> int:
        """Optimizer updates applied so far."""
        return self._updates

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last update (0 right after an update)."""
        return self._micro_batches % self.config.accum_steps


def make_update_path(context: UpdateContext) -> UpdatePath:
    """The one place a step's update path is chosen (compile_core/step/update_path.py lists them)."""
    if context.grad_scaler is not None:
        after: UpdatePath = ScalerPath(context)
    elif (fused := fused_step(context.optimizer)) is not None:
        after = FusedStepPath(context, fused)
    elif not context.config.optimizer_in_backward and (fused := fused_instead(context.optimizer)) is not None:
        # a foreach SGD/Adam/AdamW: torch's fused kernel, where compiling the whole step cost the most start-up
        # (not with the update inside the backward: it reads step counts on the host, fused keeps them on the device)
        after = FusedStepPath(context, fused, FusedWhileStepping(context.optimizer))
    else:
        after = CompiledPath(context)
    if context.config.optimizer_in_backward:
        return InBackwardPath(context, after)  # compile_core/in_backward/
    return after


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    backend: str | Callable[..., Any] = "inductor",
    ddp: str | None = "split",
    accum_steps: int = 1,
    clip_grad_norm: float | None = None,
    autocast: torch.dtype | None = None,
    lr_scheduler: Any = None,
    grad_scaler: Any = None,
    optimizer_in_backward: bool = False,
    **compile_kwargs: Any,
) -> TrainStep:
    """Build a compiled training step: `loss = step(*inputs, target)` (or `step(*inputs, target=..., **keyword_inputs)`,
    the keywords passed to the model as keywords).

    Each call runs one micro-batch (compiled forward, `loss_fn(output, target)`, backward of
    `loss / accum_steps`); every `accum_steps`-th call also clips (if `clip_grad_norm`), runs the
    compiled `optimizer.step()`, `optimizer.zero_grad(set_to_none=True)` and `lr_scheduler.step()`
    (if given). Returns the micro-batch loss, detached. `compile_kwargs` go to `compile_core.compile`.
    `grad_scaler` (a `torch.amp.GradScaler`, required with `autocast=torch.float16`): the loss is
    scaled before the backward and `grad_scaler.step(optimizer)` / `update()` run eagerly.
    `optimizer_in_backward=True` (with `ddp="in_graph"`): from update 2 each bucket's parameters are
    updated inside the compiled backward as soon as its all-reduce lands (compile_core/in_backward/).
    Raises TypeError/ValueError for bad arguments before any compile work.
    """
    config = TrainStepConfig(
        backend=backend,
        ddp=ddp,
        accum_steps=accum_steps,
        clip_grad_norm=clip_grad_norm,
        autocast=autocast,
        optimizer_in_backward=optimizer_in_backward,
        compile_kwargs=dict(compile_kwargs),
    )
    return TrainStep(model, optimizer, loss_fn, config, lr_scheduler=lr_scheduler, grad_scaler=grad_scaler)


# -- helpers ---------------------------------------------------------------------------------------
def _compile_model(model: nn.Module, config: TrainStepConfig) -> Any:
    # Imported here, not at module import: compile_core/__init__ imports this module.
    from compile_core.api import compile as compile_model

    return compile_model(model, backend=config.backend, ddp=config.ddp, **dict(config.compile_kwargs))


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"
