"""After the backward: all-reduce the gradients no compiled graph reduced alone, as DDP would.

Note [Leftover gradients in ddp="in_graph"]
-------------------------------------------
Background: the compiled backward reduces the gradients it alone produces. What is left when the
backward ends: parameters no compiled graph used this step (code Dynamo ran eagerly, a graph that
fell back to eager) and parameters with another producer besides their graph
(ddp/in_graph/probe.py). Their `.grad` holds the rank's total; DDP would average it.

Algorithm: the leftover list is the same on every rank, because it is derived only from what all
ranks agreed on (the graphs each step runs, the parameters found with other producers), never
from rank-local state. Then, as DDP's reducer does:
  * with `find_unused_parameters=True` (or `static_graph=True`, whose DDP finds them itself), one
    small all-reduce of a "has a gradient here" flag per leftover (DDP all-reduces the same kind of
    bitmap every step); a parameter with a gradient on any rank is averaged over all ranks (zeros
    where a rank had none, and that rank's `.grad` is set too), one with a gradient nowhere keeps
    `.grad = None`;
  * without it, a leftover without a gradient is the error DDP raises for an unused parameter;
  * the gradients are averaged in one flat buffer per dtype/device: divide by the world size,
    all-reduce (sum; gloo has no average) -- or, with a 16-bit wire, cast first, as DDP's compress
    hooks do. No exchange through the store: a step with leftovers costs their all-reduce only.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


class LeftoverReducer:
    """Averages, over the ranks of `group`, gradients that are complete only after the backward."""

    def __init__(self, *, group: Any, world_size: int, find_unused: bool, names: dict[int, str]) -> None:
        self.group = group
        self.world_size = world_size
        self.find_unused = find_unused
        self.names = names

    def reduce(self, params: Sequence[torch.nn.Parameter], wire_dtype: torch.dtype | None) -> list[str]:
        """Average the gradients of `params` (the same list on every rank); the names averaged."""
        if not params:
            return []
        if self.find_unused:
            here = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
            dist.all_reduce(here, group=self.group)
            used = [p for p, n in zip(params, here.tolist()) if n > 0]
            for p in used:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        else:
            missing = [self.names.get(id(p), "?") for p in params if p.grad is None]
            if missing:
                raise RuntimeError(
                    f"parameters {missing[:8]} received no gradient in this backward. DDP with "
                    "find_unused_parameters=False refuses that too (its reducer waits for every parameter); "
                    "pass find_unused_parameters=True (or static_graph=True, if the same ones are unused every step) "
                    "to DDP if some parameters are legitimately unused"
                )
            used = list(params)
        for key in dict.fromkeys((p.grad.dtype, p.grad.device) for p in used):
            self._average([p for p in used if (p.grad.dtype, p.grad.device) == key], wire_dtype)
        return [self.names.get(id(p), "?") for p in used]

    def _average(self, params: list[torch.nn.Parameter], wire_dtype: torch.dtype | None) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if wire_dtype is not None and wire_dtype != flat.dtype:
            wire = flat.to(wire_dtype).div_(self.world_size)  # cast, then divide: DDP's compress hooks
            dist.all_reduce(wire, group=self.group)
            flat.copy_(wire)
        else:
            flat.div_(self.world_size)
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
