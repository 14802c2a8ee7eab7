"""Stand-ins for a chunk of parameters before update 1: copies with zero gradients, and the optimizer
state torch's own step creates for them (`ChunkedUpdate.compile_ahead`)."""

from __future__ import annotations

import torch


def stand_ins(
    optimizer: torch.optim.Optimizer, group_index: int, params: list[torch.nn.Parameter]
) -> tuple[list[torch.nn.Parameter], list[dict]]:
    """(copies, their states): copies of `params` (same shapes, strides, dtypes) with zero gradients of the
    parameters' layout, and the state a throwaway optimizer of the same class and group options creates in
    one step over them. Torch makes that state, so its tensors have exactly the layout the real update 1
    will give (a guess that missed would only cost a second compile: the keys would differ)."""
    group = optimizer.param_groups[group_index]
    copies = [torch.nn.Parameter(p.detach().clone(), requires_grad=True) for p in params]
    for copy in copies:
        copy.grad = torch.zeros_like(copy)
    options = {k: v for k, v in group.items() if k != "params"}
    throwaway = type(optimizer)([{"params": copies, **options}])
    throwaway.step()
    return copies, [throwaway.state[copy] for copy in copies]
