"""The one interface of a train step's optimizer update (`UpdatePath`), and what every path works with.

A `TrainStep` holds one update path, chosen once by `make_update_path` (compile_core/step/train.py):

* `CompiledPath` (after_backward.py, the default): clip + step after the backward, compiled per repeated
  block (`ChunkedUpdate`, SGD/Adam/AdamW) or as one `optimizer.step()` (`CompiledUpdate`); a compile that
  fails hands over to an `EagerPath` for good, and the report says why;
* `EagerPath` (after_backward.py): clip + `optimizer.step()` eagerly, after a failed compile;
* `FusedStepPath` (after_backward.py, every param group `fused=True`, or a multi-tensor SGD/Adam/AdamW set to
  fused while it steps, fused.py): clip + torch's fused step, uncompiled;
* `ScalerPath` (after_backward.py, `grad_scaler=`): unscale, clip, `grad_scaler.step` / `update`, eagerly;
* `InBackwardPath` (compile_core/in_backward/, `optimizer_in_backward=True`): the update inside the
  compiled backward, around one of the above.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from compile_core.events import CompileEvents
from compile_core.step.config import TrainStepConfig
from compile_core.step.hyperparams import HyperparamPins
from compile_core.step.report import OptimizerReport


@dataclasses.dataclass
class UpdateContext:
    """What every update path works with (one per `TrainStep`)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainStepConfig
    compiled: Any
    """The model's `CompileState` (compile_core/api.py): `eager()`, `in_graph`, `idle_work`."""
    ddp: DistributedDataParallel | None
    grad_scaler: Any
    device_type: str
    """Where the model's parameters are ("cpu", "cuda", ...)."""
    events: CompileEvents
    """The update's compiles, recompiles and graph breaks."""
    pins: HyperparamPins
    """lr/betas as tensors while a whole `optimizer.step()` runs compiled."""
    params: list[torch.nn.Parameter]
    """The optimizer's parameters, as the step last followed its param groups."""


class EagerMicroBatch(Protocol):
    """A micro-batch a path runs as eager DDP instead of through the compiled model."""

    def running(self) -> contextlib.AbstractContextManager:
        """The context of its forward and backward."""
        ...

    def before_backward(self, output: Any, loss: torch.Tensor) -> None:
        """Sees the model's output and the loss about to be back-propagated."""
        ...

    def after_sync_backward(self) -> None:
        """After the backward of the micro-batch that updates."""
        ...


class UpdatePath(Protocol):
    """How the gradients of a train step become a parameter update."""

    def before_forward(self, index: int, *, sync: bool, first: bool) -> EagerMicroBatch | None:
        """Before a micro-batch's forward, toward update `index` (`sync`: the micro-batch that updates;
        `first`: the step's first micro-batch ever). Returns how to run it eagerly, or None: compiled."""
        ...

    def apply(self, index: int) -> torch.Tensor | None:
        """Update `index`, after its last backward; the total gradient norm before clipping (None without)."""
        ...

    def mode(self) -> str:
        """How the last update ran, for the log ("compiled", "eager", "inside the backward")."""
        ...

    def params_changed(self) -> None:
        """The optimizer's param groups changed (`UpdateContext.params` already follows them)."""
        ...

    def report_fields(self) -> dict[str, Any]:
        """`TrainStepReport`'s `optimizer` and `optimizer_in_backward` fields."""
        ...


NOT_IN_BACKWARD: dict[str, Any] = {"requested": False, "active": False}
"""The report's `optimizer_in_backward` entry of a path that was not asked to update inside the backward."""


def optimizer_report(
    ctx: UpdateContext,
    *,
    fallback: str | None,
    per_block: bool = False,
    whole_step_reason: str | None = None,
    graph_compiles: list[dict[str, Any]] | None = None,
    as_is: str | None = None,
) -> OptimizerReport:
    """The report of the update after the backward (`fallback`: why it runs eagerly, None: compiled; `as_is`:
    why it is torch's own step by choice)."""
    events = ctx.events
    with events.lock:
        return OptimizerReport(
            optimizer=type(ctx.optimizer).__name__,
            compiled=fallback is None and as_is is None,
            graphs=events.graphs,
            recompiles=[{k: v for k, v in r.items() if k != "where"} for r in events.recompiles],
            compile_seconds=events.compile_seconds,
            fallback_error=fallback,
            graph_breaks=[dict(b) for b in events.graph_breaks],
            per_block=per_block,
            whole_step_reason=whole_step_reason,
            graph_compiles=[dict(r) for r in graph_compiles or []],
            as_is=as_is,
        )
