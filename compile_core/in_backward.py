"""The optimizer side of `optimizer_in_backward=True`: which optimizers, their math as graphs, their state.

Note [Optimizer update inside the backward]
-------------------------------------------
Background: with `ddp="in_graph"` each gradient bucket is all-reduced inside the compiled
backward. The update of a bucket's parameters needs nothing else, so it can run right there,
while the rest of the backward still computes, and the bucket's gradients need never be stored.

Algorithm:
  * Update 1 runs the normal path (an eager `optimizer.step()`), which creates the optimizer's state
    exactly as torch does, and shows how the model compiles.
  * Then, per param group and parameter dtype/device, torch's own functional update
    (`torch.optim.sgd.sgd`, `adam.adam`, `adamw.adamw`, called with the group's options the way
    `step()` calls it) is captured once, on one small throwaway parameter, as an aten graph whose
    only in-place ops are the final copies into the parameter and the state
    (`aot.torch_dynamo.capture_functional`). The math is elementwise, so one graph serves every
    parameter shape of that group.
  * From update 2 the compiled backward applies that graph per parameter right after its bucket's
    all-reduce lands (ddp/in_graph/graph_pass.py). The learning rate and Adam's betas are inputs
    (the tensors `hyperparams.py` pins), so schedulers cause no recompile; the state tensors are the
    optimizer's own, updated in place, so `optimizer.state_dict()` is what an eager run gives.

Notes: only SGD, Adam and AdamW (exactly these classes, any of their options, foreach and fused
included) are done in the backward; any other optimizer, or a model that does not compile into a
single graph, keeps the normal path and the report says why. A parameter the backward does not
update (reduced after the backward because something outside the graph adds to its gradient,
ignored by DDP, or without optimizer state yet because it had no gradient so far) keeps its
gradient and is updated by the normal `optimizer.step()` right after the backward, in the same
step: torch skips the parameters whose gradient is None, i.e. those already updated. With
clipping, every gradient must be inside the graph (the global norm is taken there), else the whole
update stays on the normal path. Float
hyperparameters other than lr and betas (momentum, weight decay, eps) are constants of the
captured graph: a schedule that changes one switches back to the normal path, with the reason.

Debugging: `TrainStep.report()` has an `optimizer_in_backward` entry (active, reason, from which
update); `TORCH_LOGS=output_code` shows the update kernels between the backward's kernels.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from aot.torch_dynamo import capture_functional
from compile_core.hyperparams import HyperparamPins
from ddp.in_graph.graph_pass import UpdateTemplate
from inductor.torch_inductor import decompositions

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
_PINNED = ("lr", "betas", "initial_lr", "params")
"""Group keys that are graph inputs (lr, betas) or not hyperparameters; every other key is baked."""


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
    return None


class OptimizerInBackward:
    """Templates and per-call inputs for the updates the compiled backward applies.

    Implements `ddp.in_graph.runtime.UpdateProvider`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pins: HyperparamPins, *,
                 clip_max_norm: float | None = None) -> None:
        self.optimizer = optimizer
        self.pins = pins
        self.clip_max_norm = clip_max_norm
        """With clipping, every bucket is updated after the last all-reduce (global norm first)."""
        self.norm = torch.zeros((), dtype=torch.float32) if clip_max_norm is not None else None
        """Receives the total gradient norm (before clipping) from the backward."""
        self._templates: dict[tuple[int, torch.dtype, torch.device], UpdateTemplate] = {}
        self._group_of: dict[int, int] = {}
        self._baked: list[tuple] = []

    def prepare(self) -> None:
        """Capture one template per (group, dtype, device) that has a parameter with optimizer state
        (update 1 ran and created it; plain SGD keeps none)."""
        self._baked = [self._baked_values(g) for g in self.optimizer.param_groups]
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = index
                key = (index, p.dtype, p.device)
                if key not in self._templates and self._ready(p, group):
                    self._templates[key] = self._capture(index, group, p)

    def _ready(self, param: torch.nn.Parameter, group: dict) -> bool:
        """Whether `param` has the optimizer state its update reads (a parameter that never had a
        gradient has none: the normal step creates it, as torch does)."""
        if isinstance(self.optimizer, torch.optim.SGD) and group["momentum"] == 0:
            return True
        return param in self.optimizer.state and bool(self.optimizer.state[param])

    def changed_hyperparameters(self) -> str | None:
        """A baked hyperparameter a scheduler changed since `prepare` (then the templates are stale)."""
        for index, (group, baked) in enumerate(zip(self.optimizer.param_groups, self._baked)):
            now = self._baked_values(group)
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
        """((group, key), tensor) for each hyperparameter input: shared by the group's parameters."""
        index = self._group_of[id(param)]
        return [((index, k), self.pins.tensor(index, k)) for k in template.hyper_keys]

    # -- capture -----------------------------------------------------------------------------------

    def _capture(self, index: int, group: dict, param: torch.nn.Parameter) -> UpdateTemplate:
        state = self.optimizer.state.get(param, {})
        state_keys = tuple(k for k in _state_keys(self.optimizer, group) if k in state)
        hyper_keys = tuple(k for k in ("lr", "beta1", "beta2") if self.pins.has(index, k))
        # A small stand-in with the same dtype/device: the update is elementwise.
        tiny = lambda t: t.detach().reshape(-1)[:4].clone() if t.dim() else t.detach().clone()  # noqa: E731
        args = [tiny(param), tiny(param)] + [tiny(state[k]) for k in state_keys]
        args += [self.pins.tensor(index, k).detach().clone() for k in hyper_keys]
        fn = _functional_update(type(self.optimizer), group, state_keys, hyper_keys)
        # In Inductor's terms (what a graph spliced after partitioning must be), fine for aot_eager too.
        graph, positions = capture_functional(fn, args, decompositions=decompositions())
        return UpdateTemplate(graph=graph, positions=tuple(positions), state_keys=state_keys, hyper_keys=hyper_keys)

    @staticmethod
    def _baked_values(group: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in group.items() if k not in _PINNED and not isinstance(v, torch.Tensor)))


def _hyper(group: dict, key: str) -> Any:
    if key == "lr":
        return group["lr"]
    return group["betas"][0 if key == "beta1" else 1]


def _state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",)
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq", "step")


def _functional_update(
    cls: type, group: dict, state_keys: tuple[str, ...], hyper_keys: tuple[str, ...]
) -> Callable[..., None]:
    """`update(param, grad, *states, *hypers)`: torch's functional call, as the class's `step()` makes it.

    A fused group is captured through the single-tensor implementation: torch's fused kernels are
    opaque to Dynamo (`torch.compiler.disable`), the math is the same elementwise update, and the
    compiled backward fuses it anyway. (Results agree to rounding, not to the bit.)
    """
    options = {k: v for k, v in group.items() if k != "params"}
    if options.get("fused"):
        options.update(fused=False, foreach=False)
    if options.get("foreach") and hyper_keys:
        options["capturable"] = True  # torch refuses a tensor lr with foreach otherwise (see hyperparams.py)

    def hyper(values: dict, key: str) -> Any:
        return values[key] if key in values else _hyper(options, key)

    if cls is torch.optim.SGD:
        from torch.optim.sgd import sgd

        def update_sgd(param: torch.Tensor, grad: torch.Tensor, *rest: torch.Tensor) -> None:
            states, hypers = rest[: len(state_keys)], dict(zip(hyper_keys, rest[len(state_keys):]))
            buffers = list(states) if options["momentum"] != 0 else [None]
            sgd([param], [grad], buffers, weight_decay=options["weight_decay"], momentum=options["momentum"],
                lr=hyper(hypers, "lr"), dampening=options["dampening"], nesterov=options["nesterov"],
                maximize=options["maximize"], foreach=options["foreach"], fused=options["fused"])

        return update_sgd

    from torch.optim.adam import adam

    def update_adam(param: torch.Tensor, grad: torch.Tensor, *rest: torch.Tensor) -> None:
        states = dict(zip(state_keys, rest[: len(state_keys)]))
        hypers = dict(zip(hyper_keys, rest[len(state_keys):]))
        adam([param], [grad], [states["exp_avg"]], [states["exp_avg_sq"]],
             [states["max_exp_avg_sq"]] if options["amsgrad"] else [], [states["step"]],
             foreach=options["foreach"], capturable=options["capturable"], differentiable=False,
             fused=options["fused"], has_complex=torch.is_complex(param),
             decoupled_weight_decay=cls is torch.optim.AdamW or options.get("decoupled_weight_decay", False),
             amsgrad=options["amsgrad"], beta1=hyper(hypers, "beta1"), beta2=hyper(hypers, "beta2"),
             lr=hyper(hypers, "lr"), weight_decay=options["weight_decay"], eps=options["eps"],
             maximize=options["maximize"])

    return update_adam


class InBackwardController:
    """When `train_step` updates inside the backward, and why not when it does not (see the Note)."""

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: Any, pins: HyperparamPins, *,
                 clip_max_norm: float | None, blocker: str | None = None) -> None:
        self.reducer = reducer
        self.updates = OptimizerInBackward(optimizer, pins, clip_max_norm=clip_max_norm)
        self.reason: str | None = blocker or support(optimizer)
        """Why updates are not (or no longer) inside the backward; None while they are or may be."""
        self.from_update: int | None = None
        """First update applied inside the backward."""
        self.updates_in_backward = 0
        """Updates applied inside the backward so far."""

    @property
    def active(self) -> bool:
        return self.reducer.updates is not None

    def before_sync_step(self) -> None:
        """Before the forward of a micro-batch that will update: stale templates switch us off."""
        if self.active:
            changed = self.updates.changed_hyperparameters()
            if changed is not None:
                self._stop(changed)

    def after_update(self, index: int, *, before_prepare: Callable[[], None] = lambda: None) -> None:
        """After update `index` ran the normal path: switch to in-backward updates when it can."""
        if self.reason is not None or self.active:
            return
        self.reason = self._blocker()
        if self.reason is not None:
            return
        before_prepare()
        self.updates.prepare()
        self.reducer.updates = self.updates
        self.from_update = index + 1

    def _blocker(self) -> str | None:
        """Why the model, as the first update showed it, cannot update inside its backward."""
        reducer = self.reducer
        if not reducer.reduction.in_graph:
            return f"the compiled backward does not reduce: {reducer.reduction.reason}"
        if reducer.graphs_last_step != 1:
            return (f"the model ran as {reducer.graphs_last_step} compiled graph(s); updates inside the backward "
                    "need the model in one graph")
        after = sorted(set(reducer.last_leftovers))
        if self.updates.clip_max_norm is not None and (after or reducer.ignored):
            kept = after or sorted(reducer.ignored)
            return (f"clipping needs the global norm of every gradient inside the backward, but {kept[:5]} "
                    "are reduced after it (or not reduced: ignored by DDP)")
        return None

    def applied(self) -> bool:
        """Whether the backward just run updated the parameters (then the optimizer step is skipped)."""
        if not self.active:
            return False
        if self.reducer.updated_in_backward:
            self.updates_in_backward += 1
            return True
        self._stop(self.reducer.update_blocker or "the compiled graph did not update the parameters")
        return False

    def _stop(self, reason: str) -> None:
        self.reason = reason
        self.reducer.updates = None

    def to_dict(self, requested: bool) -> dict[str, Any]:
        return {
            "requested": requested,
            "active": self.active,
            "from_update": self.from_update,
            "updates_in_backward": self.updates_in_backward,
            "grads_kept_last_backward": self.reducer.grads_kept,
            "not_updated_in_backward": list(self.reducer.not_updated),
            "clip": None if self.updates.clip_max_norm is None else
            "global norm of all reduced gradients, after the last all-reduce, inside the backward",
            "reason": self.reason,
        }
