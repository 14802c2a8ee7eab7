"""The extra inputs a compiled in-graph backward takes: accumulated gradients, and for the optimizer update
inside the backward, each parameter's optimizer state and hyperparameters (`ddp/in_graph/runtime.py`
compiles with them; `ddp/in_graph/graph_pass.py` uses them).

Each extra input has an example (for compiling) and a producer called at every run of the graph, in
the order the graph takes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx

from aot.torch_dynamo import graph_break_of
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.in_graph.graph_pass import UpdateSpec, UpdateTemplate


class UpdateProvider(Protocol):
    """What the backward needs from the optimizer to update parameters in place (compile_core.step.in_backward)."""

    clip_max_norm: float | None
    norm: torch.Tensor | None

    def template_for(self, param: torch.nn.Parameter) -> UpdateTemplate | None: ...

    def states(self, param: torch.nn.Parameter, template: UpdateTemplate) -> list[torch.Tensor]: ...

    def hypers(self, param: torch.nn.Parameter, template: UpdateTemplate) -> list[tuple[Any, torch.Tensor]]: ...


def add_input(inputs: list, extras: list, example: torch.Tensor, make: Callable[[], torch.Tensor]) -> int:
    """Append one extra graph input (example for compiling, `make` for every call); return its index."""
    inputs.append(example)
    extras.append(make)
    return len(inputs) - 1


@dataclasses.dataclass(frozen=True)
class UpdateInputs:
    """The optimizer update one graph's backward can do (`update_inputs`)."""

    spec: UpdateSpec | None
    """None: this graph's backward updates nothing."""
    blocker: str | None
    """Why it updates nothing, for people (None when it updates)."""
    not_updated: list[str] | None
    """Planned parameters without an update (left to the normal optimizer step); None: not looked at."""


def update_inputs(
    gm: fx.GraphModule,
    inputs: list,
    plan: GradBucketPlan,
    extras: list[Callable[[], torch.Tensor]],
    provider: UpdateProvider,
    names: dict[int, str],
) -> UpdateInputs:
    """Extra inputs (appended to `inputs`/`extras`) and templates for updating the planned parameters that
    have an update."""
    if graph_break_of(gm) is not None:
        return UpdateInputs(None, "the model does not compile into one graph (graph break)", None)
    indices = sorted(plan.input_indices())
    if not indices:
        return UpdateInputs(None, "this graph reduces no parameter inside its backward (see in_graph's report)", [])
    templates = {i: t for i in indices if (t := provider.template_for(inputs[i])) is not None}
    # No template: not in the optimizer, or no state yet (a branch that joined late). Its
    # reduced gradient is returned and the normal optimizer step updates it after the backward.
    not_updated = [names.get(id(inputs[i]), "?") for i in indices if i not in templates]
    if not templates:
        return UpdateInputs(None, "no parameter of this graph has an update yet", not_updated)
    hyper_inputs: dict[Any, int] = {}
    role_inputs: dict[int, tuple[int, ...]] = {}
    for i, template in templates.items():
        param = inputs[i]
        roles = [
            add_input(inputs, extras, torch.zeros_like(t), lambda p=param, t=template, k=k: provider.states(p, t)[k])
            for k, t in enumerate(provider.states(param, template))
        ]
        for k, (key, tensor) in enumerate(provider.hypers(param, template)):
            if key not in hyper_inputs:
                hyper_inputs[key] = add_input(
                    inputs,
                    extras,
                    tensor.detach().clone(),
                    lambda p=param, t=template, k=k: provider.hypers(p, t)[k][1],
                )
            roles.append(hyper_inputs[key])
        role_inputs[i] = tuple(roles)
    norm_input = None
    if provider.clip_max_norm is not None and provider.norm is not None:
        norm_input = add_input(inputs, extras, torch.zeros_like(provider.norm), lambda: provider.norm)
    spec = UpdateSpec(
        templates=templates, role_inputs=role_inputs, clip_max_norm=provider.clip_max_norm, norm_input=norm_input
    )
    return UpdateInputs(spec, None, not_updated)
