"""The optimizer side of `optimizer_in_backward=True`: which optimizers, their math as graphs, their state.

Note [Optimizer update inside the backward]
-------------------------------------------
Background: with `ddp="in_graph"` each gradient bucket is all-reduced inside the compiled
backward. The update of a bucket's parameters needs nothing else, so it can run right there,
while the rest of the backward still computes, and the bucket's gradients need never be stored.

Algorithm:
  * Update 1 runs as eager DDP (forward, backward with DDP's reducer, `optimizer.step()`; without
    clipping or static_graph), which creates the optimizer's state exactly as torch does and compiles
    nothing: a compiled update 1 needed a backward variant of its own (reduce without update) for that
    single step. Before its backward the autograd graph is read for parameters that get gradients from
    outside the model's outputs (`ddp/in_graph/probe.py: eager_outside_producers`); the compiled
    backward leaves those to the normal step. With clipping or static_graph, update 1 is compiled
    (reduce only) and shows how the model compiles.
  * Then, per param group and parameter dtype/device, the update math of compile_core/step/optim_math.py
    (torch's single-tensor SGD/Adam/AdamW step, with its step-dependent scalars computed on the host
    per parameter and passed in as one small vector) is captured once, on one small throwaway
    parameter, as an aten graph whose only in-place ops are the final copies into the parameter and
    the state (`aot.torch_dynamo.capture_functional`). The math is elementwise, so one graph serves
    every parameter shape of that group.
  * From update 2 the compiled backward applies that update right after its bucket's all-reduce lands
    (ddp/in_graph/graph_pass.py): the graph is spliced in per parameter, so Inductor fuses the updates of
    a bucket with each other and with the gradient's last kernels, with that update's scalar vector
    (computed before the forward: lr, betas, momentum, weight decay and the step count are values, so
    schedules never recompile); the state tensors are the optimizer's own, updated in place, so
    `optimizer.state_dict()` is what an eager run gives. (On the CPU an opaque op per bucket used to call
    the math compiled once instead, to keep the C++ compile of the update variant near the reduce
    variant's: a mechanism only the CPU bed used, removed; the update variant compiles longer there.)

Notes: only SGD, Adam and AdamW (exactly these classes, any of their options, foreach and fused
included) are done in the backward; any other optimizer, or a model that does not compile into a
single graph, keeps the normal path and the report says why. A parameter the backward does not
update (reduced after the backward because something outside the graph adds to its gradient,
ignored by DDP, or without optimizer state yet because it had no gradient so far) keeps its
gradient and is updated by the normal `optimizer.step()` right after the backward, in the same
step: torch skips the parameters whose gradient is None, i.e. those already updated. With
clipping, every gradient must be inside the graph (the global norm is taken there), else the whole
update stays on the normal path. Only structural options are baked into the captured graph
(momentum on/off, nesterov, maximize, amsgrad, and whether beta1 is above 0.5, which picks `lerp`'s
formula for the first moment): changing one switches back to the normal path, with the reason.
Weight decay is always in the graph (0 decays by exactly nothing), so it may change freely.

Debugging: `TrainStep.report()` has an `optimizer_in_backward` entry (active, reason, from which
update); `TORCH_LOGS=output_code` shows the update kernels between the backward's kernels.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from aot.torch_dynamo import capture_functional
from compile_core.step import optim_math
from ddp.in_graph.graph_pass import UpdateTemplate
from inductor.torch_inductor import decompositions

logger = logging.getLogger(__name__)

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def support(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the optimizer's update cannot run per bucket inside the backward (None when it can)."""
    if type(optimizer) not in _SUPPORTED:
        names = ", ".join(c.__name__ for c in _SUPPORTED)
        return f"{type(optimizer).__name__} is not one of {names} (its update is not known per parameter)"
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param group {i} has differentiable=True"
        if any(p.is_sparse for p in group["params"]) or group.get("sparse"):
            return f"param group {i} has sparse parameters"
        if not optim_math.covers(group["params"]):
            return f"param group {i} has complex (or non-floating-point) parameters"
    return None


class OptimizerInBackward:
    """Templates and per-call inputs for the updates the compiled backward applies.

    Implements `ddp.in_graph.update_inputs.UpdateProvider`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip_max_norm: float | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.clip_max_norm = clip_max_norm
        """With clipping, every bucket is updated after the last all-reduce (global norm first)."""
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        self.norm = torch.zeros((), dtype=torch.float32, device=device) if clip_max_norm is not None else None
        """Receives the total gradient norm (before clipping) from the backward."""
        self._templates: dict[tuple[int, torch.dtype, torch.device], UpdateTemplate] = {}
        self._group_of: dict[int, int] = {}
        self._baked: list[tuple] = []
        self._rows: dict[int, torch.Tensor] = {}  # per parameter: this update's scalars (optim_math)
        self._with_state: list[torch.nn.Parameter] = []  # the parameters that had optimizer state at `prepare`
        self._state_watch = optim_math.StateWatch(optimizer)  # marked at `prepare` and while nothing is lost

    def prepare(self) -> None:
        """Capture one template per (group, dtype, device) that has a parameter with optimizer state
        (update 1 ran and created it; plain SGD keeps none)."""
        self._baked = [_flags(self.optimizer, g) for g in self.optimizer.param_groups]
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = index
                key = (index, p.dtype, p.device)
                if key not in self._templates and self._ready(p, group):
                    self._templates[key] = self._capture(group, p)
        self._with_state = [p for g in self.optimizer.param_groups for p in g["params"] if self._ready(p, g)]
        self._state_watch.mark()
        self.refresh()

    def lost_state(self) -> list[torch.nn.Parameter]:
        """The parameters that had optimizer state at `prepare` and have none now: the user cleared it
        (`optimizer.state.clear()`, `del optimizer.state[p]`) or loaded a checkpoint without it
        (`load_state_dict`, which replaces the mapping). Their update must create it, as torch's step does
        (step 0, zero moments); the compiled backward reads it. A dict lookup per update while the mapping
        is the same and did not shrink."""
        if not self._state_watch.changed():
            return []
        groups = self.optimizer.param_groups
        lost = [p for p in self._with_state if not self._ready(p, groups[self._group_of[id(p)]])]
        if not lost:
            self._state_watch.mark()
        return lost

    def refresh(self) -> None:
        """This update's scalars for every parameter that has an update (before its forward)."""
        for index, group in enumerate(self.optimizer.param_groups):
            ready = [
                p for p in group["params"] if (index, p.dtype, p.device) in self._templates and self._ready(p, group)
            ]
            if not ready:
                continue
            steps = [
                float(self.optimizer.state[p]["step"]) + 1 if optim_math.is_adam(self.optimizer) else 0.0 for p in ready
            ]
            rows = optim_math.scalars(self.optimizer, group, steps, ready[0].device)
            for p, row in zip(ready, rows):
                self._rows[id(p)] = row

    def _ready(self, param: torch.nn.Parameter, group: dict) -> bool:
        """Whether `param` has the optimizer state its update reads (a parameter that never had a
        gradient has none: the normal step creates it, as torch does)."""
        if isinstance(self.optimizer, torch.optim.SGD) and group["momentum"] == 0:
            return True
        return param in self.optimizer.state and bool(self.optimizer.state[param])

    def changed_hyperparameters(self) -> str | None:
        """A structural option changed since `prepare` (momentum turned on or off, nesterov, maximize,
        amsgrad): the templates no longer fit. Values never matter: they are inputs."""
        for index, (group, baked) in enumerate(zip(self.optimizer.param_groups, self._baked)):
            now = _flags(self.optimizer, group)
            if now != baked:
                changed = [k for (k, a), (_, b) in zip(baked, now) if a != b]
                return f"param group {index} changed {changed} after the update graphs were captured"
        return None

    def template_for(self, param: torch.nn.Parameter) -> UpdateTemplate | None:
        index = self._group_of.get(id(param))
        if index is None or not self._ready(param, self.optimizer.param_groups[index]):
            return None
        return self._templates.get((index, param.dtype, param.device))

    def states(self, param: torch.nn.Parameter, template: UpdateTemplate) -> list[torch.Tensor]:
        """The live state tensors of one parameter (looked up at every call: `load_state_dict`
        replaces them)."""
        if not template.state_keys:
            return []  # (and no empty entry in the optimizer's state, which indexing would create)
        state = self.optimizer.state[param]
        return [state[k] for k in template.state_keys]

    def hypers(self, param: torch.nn.Parameter, template: UpdateTemplate) -> list[tuple[Any, torch.Tensor]]:
        """(key, tensor) for the parameter's scalar row of this update (compile_core/step/optim_math.py)."""
        return [((id(param), "scalars"), self._rows[id(param)])]

    # -- capture -----------------------------------------------------------------------------------

    def _capture(self, group: dict, param: torch.nn.Parameter) -> UpdateTemplate:
        state = self.optimizer.state.get(param, {})
        state_keys = tuple(k for k in _state_keys(self.optimizer, group) if k in state)
        # A small stand-in with the same dtype/device: the update is elementwise.
        tiny = lambda t: t.detach().reshape(-1)[:4].clone() if t.dim() else t.detach().clone()  # noqa: E731
        row = optim_math.scalars(self.optimizer, group, [1.0], param.device)[0]
        args = [tiny(param), tiny(param)] + [tiny(state[k]) for k in state_keys] + [row]
        fn = _update_function(self.optimizer, group, state_keys)
        # In Inductor's terms (what a graph spliced after partitioning must be), fine for aot_eager too.
        graph, positions = capture_functional(fn, args, decompositions=decompositions())
        return UpdateTemplate(graph=graph, positions=tuple(positions), state_keys=state_keys, hyper_keys=("scalars",))


def _flags(optimizer: torch.optim.Optimizer, group: dict) -> tuple:
    """The options that decide the update's graph (every number is an input instead)."""
    # Weight decay is always in the graph: a decay of 0 multiplies by exactly 1 (AdamW) or adds exactly 0
    # (Adam, SGD), so a decay schedule that starts at 0 never changes the graph.
    keys = {"weight_decay": True, "maximize": bool(group.get("maximize"))}
    if isinstance(optimizer, torch.optim.SGD):
        keys.update(momentum=group["momentum"] != 0, nesterov=bool(group["nesterov"]))
    else:
        keys.update(amsgrad=bool(group.get("amsgrad")), decoupled=optim_math.decoupled(optimizer, group))
        keys.update(low_lerp=abs(1 - float(group["betas"][0])) < 0.5)  # lerp's formula for the first moment
    return tuple(sorted(keys.items()))


def _state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",)
    return (
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
        if group.get("amsgrad")
        else ("exp_avg", "exp_avg_sq", "step")
    )


def _update_function(optimizer: torch.optim.Optimizer, group: dict, state_keys: tuple[str, ...]) -> Callable[..., None]:
    """`update(param, grad, *states, scalars)`: one parameter's update (compile_core/step/optim_math.py)."""
    flags = dict(_flags(optimizer, group))
    if isinstance(optimizer, torch.optim.SGD):

        def update_sgd(param: torch.Tensor, grad: torch.Tensor, *rest: torch.Tensor) -> None:
            buf = rest[0] if flags["momentum"] else None
            optim_math.sgd_math(
                param,
                grad,
                buf,
                rest[-1],
                weight_decay=flags["weight_decay"],
                nesterov=flags["nesterov"],
                maximize=flags["maximize"],
            )

        return update_sgd

    def update_adam(param: torch.Tensor, grad: torch.Tensor, *rest: torch.Tensor) -> None:
        states = dict(zip(state_keys, rest[:-1]))
        optim_math.adam_math(
            param,
            grad,
            states["exp_avg"],
            states["exp_avg_sq"],
            states.get("max_exp_avg_sq"),
            states["step"],
            rest[-1],
            decoupled=flags["decoupled"],
            weight_decay=flags["weight_decay"],
            maximize=flags["maximize"],
            low_lerp=flags["low_lerp"],
        )

    return update_adam
