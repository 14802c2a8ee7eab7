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
    3. Optimizer update. `clip_grad_norm_` (optional) and `optimizer.step()` form one function that
       Dynamo compiles with the same backend as the model. A scheduler that
       writes a new Python float into `param_groups` every step would make Dynamo recompile every
       step (it guards on the value), so before the first compile the learning rate (and Adam's
       beta1, which OneCycleLR/CyclicLR cycle) is replaced by a 0-dim tensor that we own; before
       every update we copy whatever the scheduler wrote into that tensor and put the tensor back.
       The compiled graph reads the tensor, so new values never invalidate it. (SGD's momentum,
       which OneCycleLR also cycles, stays a float: torch's SGD branches on `momentum != 0`, and
       Dynamo passes that float in as a graph input without recompiling. SGD does recompile once,
       at update 2, because it creates its momentum buffers in update 1.) A post-hook on
       `optimizer.state_dict()` turns those tensors back into floats (and restores flags we had
       to change), so checkpoints stay in the user's format and load into a plain eager optimizer.
       If the update cannot be compiled, it runs eagerly from then on and the report says why.

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

from aot.torch_dynamo import DynamoError, cause_chain
from compile_core import progress
from compile_core.events import CompileEvents
from compile_core.reuse.compile_once import job_rank
from compile_core.step.checks import NO_TARGET, check_inputs, check_loss, split_args
from compile_core.step.chunked_update import ChunkedUpdate
from compile_core.step.config import TrainStepConfig
from compile_core.step.hyperparams import HyperparamPins
from compile_core.step.in_backward_controller import InBackwardController
from compile_core.step.report import OptimizerReport, TrainStepReport
from compile_core.step.update import CompiledUpdate, chunking_blocker, clip_and_step
from ddp.in_graph.probe import eager_outside_producers
from inductor.torch_inductor import disk_caches_enabled

UPDATE_OFFER = "optimizer update (ahead of update 1)"
"""The name of the offer `_offer_update_compile` makes to the model's `IdleWork` (compile_core/reuse/idle_work.py)."""

logger = logging.getLogger(__name__)

__all__ = ["TrainStep", "TrainStepConfig", "TrainStepReport", "OptimizerReport", "train_step"]


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
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self.compiled_model = _compile_model(model, config)
        """`model` itself, compiled in place (compile_core/in_place.py)."""
        self._compiled = self.compiled_model.compile_state
        if self._compiled.in_graph is not None:
            # nothing touches .grad between our forward and backward: accumulate inside the graph
            self._compiled.in_graph.accumulate_in_graph = True
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device_type = _device_type(model)
        self._opt_events = CompileEvents(breaks_from="counters", name="optimizer update")
        self._opt_fallback: str | None = None  # why the update runs eagerly, once it does
        if grad_scaler is not None:
            self._opt_fallback = (
                "a GradScaler skips updates whose gradients hold inf/nan, which needs a host "
                "check per update: grad_scaler.step(optimizer) runs eagerly"
            )
        self._pins = HyperparamPins(optimizer)
        self._update: CompiledUpdate | ChunkedUpdate | None = None
        self._update_blocker: str | None = None  # why the update is not compiled per block
        self._micro_batches = 0
        self._updates = 0
        self.applied = False
        """True when the last call applied an optimizer update."""
        self.last_grad_norm: torch.Tensor | None = None
        """Total gradient norm before clipping at the last update (a tensor; None without clipping)."""
        self._in_backward: InBackwardController | None = None
        self._outside: set[int] = set()
        """Parameters update 1's eager micro-batches found with gradients from outside the model's outputs."""
        if config.optimizer_in_backward:
            self._in_backward = InBackwardController(
                optimizer,
                self._compiled.in_graph,
                clip_max_norm=config.clip_grad_norm,
                blocker=config.in_backward_blocker(grad_scaler=grad_scaler is not None, device_type=self._device_type),
            )
            if self._in_backward.reason is not None:
                logger.warning("train_step: optimizer update stays after the backward: %s", self._in_backward.reason)

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, *args: Any, target: Any = NO_TARGET) -> torch.Tensor:
        """`step(*inputs, target)` or `step(*inputs, target=target)`: one micro-batch."""
        inputs, target = split_args(args, target)
        progress.report()  # for a launcher watching for hangs (compile_core/progress.py)
        sync = self.pending_micro_batches == self.config.accum_steps - 1
        if sync and self._in_backward is not None:
            self._in_backward.before_sync_step(self._updates + 1)  # this update's scalars (the scheduler's lr, betas)
        if self._micro_batches == 0:
            self._offer_update_compile()
        loss = self._forward_backward(inputs, target, sync=sync)
        self._micro_batches += 1
        self.applied = sync
        if sync:
            self._apply_update()
        return loss

    def _forward_backward(self, inputs: tuple[Any, ...], target: Any, *, sync: bool) -> torch.Tensor:
        # no_sync must cover the forward too: DDP arms the reducer for the next backward there.
        skip_sync = self._ddp.no_sync() if (self._ddp is not None and not sync) else contextlib.nullcontext()
        # Update 1 with the optimizer in the backward: eager DDP (see `_eager_first_update`).
        eager = self._eager_first_update()
        with skip_sync, self._compiled.eager() if eager else contextlib.nullcontext():
            with self._autocast():
                output = self.compiled_model(*inputs)
                loss = self.loss_fn(output, target)
            check_loss(loss)
            scaled = loss / self.config.accum_steps if self.config.accum_steps > 1 else loss
            if self.grad_scaler is not None:
                scaled = self.grad_scaler.scale(scaled)
            if eager:
                self._outside |= eager_outside_producers(output, scaled)
            scaled.backward()
        if eager and sync:
            self._compiled.in_graph.after_eager_step(self._outside)
        return loss.detach()

    def _eager_first_update(self) -> bool:
        """Whether this micro-batch belongs to update 1 of an optimizer-in-backward step that runs it eagerly.

        Update 1 creates the optimizer state the backward updates from update 2 on; compiled, it needs a
        variant of its own (a backward that reduces without updating) compiled for that one update. As
        eager DDP it costs one eager step, and the autograd graph, read before its backward, shows the
        parameters that get gradients from outside the model's outputs, which the compiled backward must
        leave to the step after it."""
        return self._updates == 0 and self._in_backward is not None and self._in_backward.eager_first_update(self._ddp)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, dtype=self.config.autocast)

    def _apply_update(self) -> None:
        index = self._updates + 1
        self._follow_param_groups()
        controller = self._in_backward
        if controller is not None and controller.applied():
            norm = controller.updates.norm
            # The backward updated the parameters it reduced alone; the others (reduced after it,
            # ignored by DDP, or first seen with a gradient) hold their gradient: torch's step
            # updates exactly those and skips the rest (gradient None).
            if any(p.grad is not None for p in self._params):
                self.optimizer.step()
        elif controller is not None and controller.reason is None:
            # Update 1 runs eagerly with the user's own hyperparameters: it creates the optimizer
            # state the backward will update. The pinned tensors come before the update graphs.
            ran_eagerly = self._eager_first_update()
            norm = self._eager_update()
            controller.after_update(index, ran_eagerly=ran_eagerly)
        else:
            norm = self._normal_update(index)
        self.last_grad_norm = None if norm is None else norm.detach().clone()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._updates = index
        logger.debug(  # every step: DEBUG, so that INFO stays for compile progress
            "train_step: update %d applied after %d micro-batch(es) (optimizer %s, %s)",
            index,
            self.config.accum_steps,
            type(self.optimizer).__name__,
            self._update_mode(),
        )

    def _follow_param_groups(self) -> None:
        """A param group added since the update was built (`optimizer.add_param_group`, as Lightning's
        fine-tuning callbacks unfreeze a backbone): an update built for the old groups would never step
        its parameters. The update is built again; their first update is torch's own step, which creates
        their state."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params)):
            return
        self._params = params
        if self._update is not None:
            logger.info(
                "train_step: the optimizer now has %d param group(s) and %d parameter(s); its update is built again",
                len(self.optimizer.param_groups),
                len(params),
            )
            self._update = None
            self._pins.uninstall()

    def _update_mode(self) -> str:
        if self._in_backward is not None and self._in_backward.active:
            return "inside the backward"
        return "compiled" if self._opt_fallback is None else "eager"

    def _normal_update(self, index: int) -> torch.Tensor | None:
        """clip + optimizer.step() after the backward, compiled (eager once that failed)."""
        self._compiled.idle_work.withdraw(UPDATE_OFFER)  # not taken by a wait: update 1 compiles it
        if self._update is None and self._opt_fallback is None:
            self._update = self._build_update()
        if self._update is not None:
            try:
                with self._pins.applied():
                    norm = self._update(index)
            except DynamoError as err:
                # Dynamo/backend could not capture or compile the update; nothing of the failing
                # graph ran. Other exceptions come from running the update and would recur eagerly.
                self._fall_back(_describe(err))
                norm = self._eager_update()
            else:
                failure = getattr(self._update, "failure", None)
                if failure is not None:  # update 1 was applied; only its compile failed
                    self._fall_back(_describe(failure))
                elif index == 1:
                    self._check_captured()
        else:
            norm = self._eager_update()
        return norm

    def _offer_update_compile(self) -> None:
        """One-graph jobs (`ddp="in_graph"`): one rank compiles the model and the others wait for it; a rank
        about to wait compiles the optimizer update meanwhile, on stand-ins (`compile_core/reuse/idle_work.py`,
        `ChunkedUpdate.compile_ahead`). Withdrawn at update 1 if no wait took it."""
        if self.config.ddp != "in_graph" or self._in_backward is not None or job_rank()[1] < 2:
            return
        if chunking_blocker(self.optimizer) is not None:
            return  # a whole `optimizer.step()` is compiled at update 1, as before (its pins installed then)
        if self._update is None and self._opt_fallback is None:
            self._update = self._build_update()
        update = self._update
        if isinstance(update, ChunkedUpdate) and update.shares_compiles:

            def compile_ahead() -> None:
                with self._pins.applied():
                    update.compile_ahead()

            self._compiled.idle_work.offer(UPDATE_OFFER, compile_ahead)

    def _update_fn(self) -> Callable[[], torch.Tensor | None]:
        return clip_and_step(self._params, self.config.clip_grad_norm, self.optimizer)

    def _eager_update(self) -> torch.Tensor | None:
        if self.grad_scaler is None:
            return self._update_fn()()
        norm = None
        if self.config.clip_grad_norm is not None:
            self.grad_scaler.unscale_(self.optimizer)  # clip the true gradients, as torch's AMP recipe does
            norm = torch.nn.utils.clip_grad_norm_(self._params, self.config.clip_grad_norm)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        return norm

    def _build_update(self) -> CompiledUpdate | ChunkedUpdate:
        blocker = chunking_blocker(self.optimizer)
        if self.config.compile_kwargs.get("reuse_pieces", True) is False:
            blocker = "reuse_pieces=False"
        if blocker is None:
            names = {id(p): n for n, p in self.model.named_parameters()}
            return ChunkedUpdate(
                self.optimizer,
                names,
                self.config.backend,
                self._opt_events,
                clip_max_norm=self.config.clip_grad_norm,
                claims=self.config.backend == "inductor" and disk_caches_enabled(),
            )
        self._update_blocker = blocker
        self._pins.install()  # optimizer.step() compiled whole reads lr/betas from the groups
        return CompiledUpdate(self._update_fn(), self.config.backend, self._opt_events)

    def _check_captured(self) -> None:
        """After the first update: if Dynamo ran the whole update eagerly, say so and stop trying."""
        assert self._update is not None
        missing = self._update.uncaptured(self._params)
        if len(missing) < len(self._params):
            return  # compiled (partly, at worst: the graph breaks are in the report)
        breaks = "; ".join(b["reason"] for b in self._opt_events.graph_breaks) or "no graph break reported"
        self._fall_back(f"Dynamo captured no graph that updates the parameters ({breaks})")

    def _fall_back(self, message: str) -> None:
        logger.warning("train_step: optimizer update could not be compiled, running eagerly: %s", message)
        self._opt_fallback = message
        self._update = None
        self._pins.uninstall()

    # -- introspection ----------------------------------------------------------------------------
    def report(self) -> TrainStepReport:
        model_report = self._compiled.report()
        backend = (
            self.config.backend
            if isinstance(self.config.backend, str)
            else getattr(self.config.backend, "__name__", repr(self.config.backend))
        )
        events = self._opt_events
        with events.lock:
            optimizer = OptimizerReport(
                optimizer=type(self.optimizer).__name__,
                compiled=self._opt_fallback is None,
                graphs=events.graphs,
                recompiles=[{k: v for k, v in r.items() if k != "where"} for r in events.recompiles],
                compile_seconds=events.compile_seconds,
                fallback_error=self._opt_fallback,
                graph_breaks=[dict(b) for b in events.graph_breaks],
                per_block=isinstance(self._update, ChunkedUpdate),
                whole_step_reason=self._update_blocker,
                graph_compiles=[dict(r) for r in getattr(self._update, "records", [])],
            )
        return TrainStepReport(
            model=model_report,
            optimizer=optimizer,
            optimizer_in_backward=(
                self._in_backward.to_dict(True)
                if self._in_backward is not None
                else {"requested": False, "active": False}
            ),
            backend=backend,
            accum_steps=self.config.accum_steps,
            micro_batches=self._micro_batches,
            updates=self._updates,
        )

    @property
    def updates(self) -> int:
        """Optimizer updates applied so far."""
        return self._updates

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last update (0 right after an update)."""
        return self._micro_batches % self.config.accum_steps


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
    """Build a compiled training step: `loss = step(*inputs, target)`.

    Each call runs one micro-batch (compiled forward, `loss_fn(output, target)`, backward of
    `loss / accum_steps`); every `accum_steps`-th call also clips (if `clip_grad_norm`), runs the
    compiled `optimizer.step()`, `optimizer.zero_grad(set_to_none=True)` and `lr_scheduler.step()`
    (if given). Returns the micro-batch loss, detached. `compile_kwargs` go to `compile_core.compile`.
    `grad_scaler` (a `torch.amp.GradScaler`, required with `autocast=torch.float16`): the loss is
    scaled before the backward and `grad_scaler.step(optimizer)` / `update()` run eagerly.
    `optimizer_in_backward=True` (with `ddp="in_graph"`): from update 2 each bucket's parameters are
    updated inside the compiled backward as soon as its all-reduce lands (compile_core/step/in_backward.py).
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


def _describe(err: BaseException) -> str:
    """`Type: first line`, plus the root cause (Dynamo wraps backend errors in BackendCompilerFailed)."""
    root = cause_chain(err)[-1]

    def one(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip()

    return one(err) if root is err else f"{one(err)} caused by {one(root)}"
