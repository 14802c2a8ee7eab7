"""Which reduction `ddp="in_graph"` runs for a DDP model: its comm hook decides (`Reduction`).

Note [Comm hooks in ddp="in_graph"]
-----------------------------------
Background: a comm hook registered on the DDP object (`register_comm_hook`) replaces DDP's
"divide by the world size, all-reduce" for every bucket. The compiled backward cannot call a Python
hook, but the hooks people use most are fixed recipes it can run itself:
  * `allreduce_hook` is DDP's default reduction;
  * `fp16_compress_hook` / `bf16_compress_hook` cast the bucket to 16 bits, divide by the world size
    in 16 bits, all-reduce in 16 bits and cast back; `fp16_compress_wrapper(allreduce_hook)` and
    `bf16_compress_wrapper(allreduce_hook)` are the same thing.
Those run inside the compiled backward (a wire dtype per bucket, in that order of operations, so
the result is DDP's to the bit on aot_eager). Any other hook (PowerSGD, a hook that logs or scales,
a builtin C++ hook) is the user's code: DDP's own reducer runs it, exactly as without compile, and
the compiled graphs carry no collective at all. That is not what `in_graph` promises (no reduction
overlaps the compiled backward), so it is said at WARNING and in `report()["in_graph"]`.

Notes: the default hooks reduce over their state's process group (the world when None); a hook
whose group is not the DDP object's stays with DDP's reducer too. `reduce_dtype=` asks for the same
16-bit wire without a hook; asking for one dtype while a hook asks for another is an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp import torch_ddp

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What `reduce_dtype=` accepts."""


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How the gradients of one DDP model are reduced in `ddp="in_graph"` mode."""

    in_graph: bool
    """True: the compiled backward all-reduces; False: DDP's reducer does (a hook we cannot compile)."""
    wire_dtype: torch.dtype | None = None
    """Cast each bucket to this dtype for the all-reduce (None: the gradients' own dtype)."""
    hook: str | None = None
    """The registered comm hook's name, if any."""
    reason: str | None = None
    """Why DDP's reducer reduces (for people; decisions read `in_graph`)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "reducer": "compiled backward" if self.in_graph else "ddp",
            "comm_hook": self.hook,
            "reduce_dtype": None if self.wire_dtype is None else str(self.wire_dtype),
            "reason": self.reason,
        }


_HOOK_DTYPES: dict[Callable[..., Any], torch.dtype | None] = {
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}


def check_reduce_dtype(reduce_dtype: Any) -> None:
    """`reduce_dtype=` must be None or one of `WIRE_DTYPES`."""
    if reduce_dtype is not None and reduce_dtype not in WIRE_DTYPES:
        raise ValueError(
            f"reduce_dtype={reduce_dtype!r}: use torch.bfloat16, torch.float16, torch.float32 or None "
            "(None: all-reduce in the gradients' own dtype)"
        )


def reduction_for(ddp: DistributedDataParallel, reduce_dtype: torch.dtype | None) -> Reduction:
    """The reduction for `ddp` as it is now (comm hooks included); see the Note."""
    builtin = torch_ddp.builtin_comm_hook(ddp)
    if builtin is not None:
        return Reduction(
            in_graph=False,
            hook=builtin,
            reason=(f"the builtin comm hook {builtin} cannot run inside the compiled backward; DDP's reducer runs it"),
        )
    hooks = torch_ddp.comm_hooks(ddp)
    if not hooks:
        return Reduction(in_graph=True, wire_dtype=reduce_dtype)
    hook, state = hooks[-1]
    name = getattr(hook, "__qualname__", repr(hook))
    known, hook_dtype = _recipe(hook)
    if not known:
        return Reduction(
            in_graph=False,
            hook=name,
            reason=(
                f"comm hook '{name}' is user code the compiled backward cannot run; DDP's reducer runs it after "
                "each bucket (no reduction overlaps the compiled backward). Only allreduce_hook, fp16_compress_hook, "
                "bf16_compress_hook and their compress wrappers around allreduce_hook are compiled in"
            ),
        )
    if not _same_group(state, ddp.process_group):
        return Reduction(
            in_graph=False,
            hook=name,
            reason=(
                f"comm hook '{name}' reduces over another process group than the DDP object's; DDP's reducer runs it"
            ),
        )
    if reduce_dtype is not None and hook_dtype is not None and reduce_dtype != hook_dtype:
        raise ValueError(
            f"reduce_dtype={reduce_dtype} conflicts with the comm hook '{name}', which all-reduces in {hook_dtype}: "
            "drop reduce_dtype= (the hook's dtype is used) or register no hook"
        )
    return Reduction(in_graph=True, wire_dtype=hook_dtype or reduce_dtype, hook=name)


def _recipe(hook: Callable[..., Any]) -> tuple[bool, torch.dtype | None]:
    """(whether the hook is a recipe we compile, its wire dtype)."""
    if hook in _HOOK_DTYPES:
        return True, _HOOK_DTYPES[hook]
    parts = torch_ddp.compress_wrapper_parts(hook)
    if parts is not None and parts[1] is default_hooks.allreduce_hook:
        return True, parts[0]
    return False, None


def _same_group(state: Any, group: Any) -> bool:
    """The default hooks reduce over their state (a process group, or the world when None)."""
    if state is not None and not isinstance(state, dist.ProcessGroup):
        return False
    hook_group = state if state is not None else dist.group.WORLD
    return hook_group is group or dist.get_process_group_ranks(hook_group) == dist.get_process_group_ranks(group)
