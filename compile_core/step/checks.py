"""What `train_step` checks before any compile work, and on each call (bad input names the value and the fix)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from aot.torch_eager import torch_compile_original
from compile_core.step.config import TrainStepConfig
from ddp.in_graph.policy import reduction_for


def check_inputs(
    model: Any, optimizer: Any, loss_fn: Any, lr_scheduler: Any, grad_scaler: Any, config: TrainStepConfig
) -> None:
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler={type(grad_scaler).__name__}: expected a torch.amp.GradScaler")
    if config.autocast is torch.float16 and grad_scaler is None:
        raise ValueError(
            "autocast=torch.float16 needs loss scaling (fp16 gradients underflow without it): pass "
            "grad_scaler=torch.amp.GradScaler(device_type), or use autocast=torch.bfloat16"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__}: expected an nn.Module (e.g. your DDP-wrapped model)")
    if (
        isinstance(optimizer, (list, tuple))
        and optimizer
        and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    ):
        names = ", ".join(type(o).__name__ for o in optimizer)
        raise TypeError(
            f"optimizer=[{names}]: train_step steps one optimizer; with several (Muon for the weight matrices and "
            "AdamW for the rest, a GAN's two), compile the model with compile_core.compile(ddp_model) and step "
            "them in your own loop, or use one optimizer whose param groups hold the different settings"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer, "
            "e.g. torch.optim.AdamW(model.parameters())"
        )
    if _step_needs_closure(optimizer):
        raise ValueError(
            f"optimizer={type(optimizer).__name__}: its step(closure) evaluates the model again through a closure "
            "(several forwards and backwards per update), which a train step's one forward and backward cannot "
            "give it: compile the model with compile_core.compile(ddp_model) and call optimizer.step(closure) in "
            "your own loop"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn={loss_fn!r} is not callable: pass a function (output, target) -> scalar loss, "
            "e.g. torch.nn.functional.cross_entropy"
        )
    model_params = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(
            f"optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(shapes {shapes}{', ...' if len(foreign) > 3 else ''}): build the optimizer from "
            "model.parameters() of the same model passed to train_step"
        )
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            f"lr_scheduler={type(lr_scheduler).__name__} does not drive this optimizer: "
            "create it from the optimizer passed to train_step"
        )
    ddp = torch_compile_original(model) or model
    if isinstance(ddp, DistributedDataParallel) and ddp.static_graph and config.accum_steps > 1:
        _check_static_graph_accumulation(ddp, config)
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "lr_scheduler=ReduceLROnPlateau steps on a metric (scheduler.step(val_loss)), which train_step does "
            "not have: leave lr_scheduler unset and call scheduler.step(metric) yourself after validation; "
            "train_step reads the learning rate it set at every update"
        )


def _check_static_graph_accumulation(ddp: DistributedDataParallel, config: TrainStepConfig) -> None:
    """Accumulation starts every update with a `no_sync()` micro-batch, and DDP's reducer with `static_graph=True`
    must synchronise in its first backward (an eager loop that starts so stops at torch's
    'expect_autograd_hooks_ INTERNAL ASSERT FAILED'): refused where DDP's reducer reduces, which `ddp="in_graph"`
    leaves idle unless a comm hook it cannot compile makes DDP's reducer run it."""
    if config.ddp == "in_graph":
        reduction = reduction_for(ddp, config.compile_kwargs.get("reduce_dtype"))
        if reduction.in_graph:
            return
        where = f"ddp='in_graph', where DDP's reducer runs the comm hook {reduction.hook}"
        fix = "build DDP without static_graph, or use a comm hook the graph compiles (allreduce_hook, fp16/bf16)"
    else:
        where = f"ddp={config.ddp!r}, where DDP's reducer reduces"
        fix = "use ddp='in_graph' (DDP's reducer stays idle there), or build DDP without static_graph"
    raise ValueError(
        f"accum_steps={config.accum_steps} with DDP static_graph=True and {where}: every update starts with a "
        "no_sync() micro-batch, and a static graph's DDP must synchronise in its first backward (torch stops an "
        f"eager loop that starts so with 'expect_autograd_hooks_ INTERNAL ASSERT FAILED'): {fix}"
    )


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` cannot run without a closure (torch.optim.LBFGS; any optimizer whose step takes a
    `closure` without a default)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step without a signature Python can read: not ours to judge
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


NO_TARGET: Any = object()
"""`step(...)` called without `target=`: the last positional argument is the target."""


def split_args(args: tuple[Any, ...], target: Any, keywords: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
    """(positional model inputs, target) of `step(*inputs, target, **keyword_inputs)` or
    `step(*inputs, target=..., **keyword_inputs)`; an explicit `target=None` is a target (a loss that reads the
    labels from the model's output ignores it)."""
    if target is not NO_TARGET:
        if not args and not keywords:
            raise TypeError("step(*inputs, target): no inputs given")
        return args, target
    if keywords and not args:
        raise TypeError(
            f"step(**inputs) with keyword inputs {sorted(keywords)} and no target: pass target=... too, "
            "e.g. step(**batch, target=None) when loss_fn reads the loss from the model's output (a Hugging "
            "Face model given labels=), or step(**batch, target=y)"
        )
    if not keywords and len(args) < 2:
        raise TypeError(
            f"step(*inputs, target): got {len(args)} positional argument(s); pass the model inputs "
            "followed by the target, e.g. step(x, y), step(x, target=y), or step(x, target=None) when "
            "loss_fn needs no target"
        )
    return args[:-1], args[-1]


def check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn returned {shape}: expected a scalar tensor; reduce it (e.g. .mean()) "
            "or use a loss with reduction='mean'"
        )
