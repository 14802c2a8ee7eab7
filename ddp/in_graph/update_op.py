"""`ddp_compile::bucket_update`: one opaque op per bucket that updates its parameters in place.

Note [An opaque update op instead of spliced update nodes]
----------------------------------------------------------
Background: `optimizer_in_backward=True` first spliced each parameter's update (a ~26-node aten graph
for Adam) into the compiled backward. Inductor then lowers, schedules and generates code for every one
of those nodes: on the 12-block compile workload (150 parameters) the update variant's backward had
~3,100 scheduler nodes and took 44 s to compile on one CPU core, against 12 s for the same backward
without updates. The update math is the same elementwise function for every parameter of a group.

Algorithm: the backward gets one node per bucket and kind of update, `bucket_update(params, grads,
states, rows, kind)`, declared as mutating `params` and `states` (Inductor keeps it as an extern call,
ordered like any mutation). At run time it calls the kernel registered under `kind` (a string naming
everything the math depends on, so the graph stays cacheable): compile_core.step.in_backward registers
one per kind of update, which runs the update compiled once for every parameter size (the length
symbolic; one call per parameter, each tensor passed as a flat view). With Inductor the kernel is
compiled without Dynamo (`inductor.torch_inductor.compile_in_place_elementwise`): a call costs ~8 us,
where a `torch.compile`d function's guard check and runtime wrappers took ~80 us; on the comm
workload's GPT (77 parameters, 1 rank) the kernel's time per step fell from 44-48 to 21 ms, about
the update's memory traffic, and the in-backward step from 267-281 to 227 ms (the in-graph step,
whose update runs after the backward: 226-236). Other backends compile it through Dynamo (each tensor
then an alias at storage offset 0: compile_core/step/chunk_math.py, `alias_at_offset_zero`). With one
static compile per size, the 12-block compile workload's 9 sizes cost 5.1 s more of a cold update-2
compile on one rank (33.6 vs 28.5 s) and 0.7 s more of a warm one (2.9 vs 2.2 s), with the same step
time. Used on the CPU (see the Note in compile_core/step/in_backward.py for the GPU).

Notes: the kernel registry lives in the process; a graph loaded from Inductor's cache finds its kernel
because the step registers it before the update variant runs (`OptimizerInBackward.prepare`). The op
returns a 0-dim marker tensor so that the pipeline's ordering pins can name it.

Debugging: `TORCH_LOGS=output_code` shows one `ddp_compile.bucket_update` call per bucket.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Kernel = Callable[
    [Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]], None
]
"""kernel(params, grads, states, rows): update every parameter in place (states: per parameter, in order)."""

_KERNELS: dict[str, Kernel] = {}


def register_kernel(kind: str, kernel: Kernel) -> None:
    """Make `kind` run `kernel` (the latest registration wins: a new optimizer may replace an old one)."""
    _KERNELS[kind] = kernel


@torch.library.custom_op("ddp_compile::bucket_update", mutates_args=("params", "states"))
def bucket_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[torch.Tensor],
    rows: list[torch.Tensor],
    kind: str,
) -> torch.Tensor:
    kernel = _KERNELS.get(kind)
    if kernel is None:
        raise RuntimeError(
            f"no update kernel registered as {kind!r} in this process: the compiled backward came from a cache "
            "without the train_step that registers it (compile_core.step.in_backward)"
        )
    kernel(params, grads, states, rows)
    return torch.empty(0, device=params[0].device if params else None)


@bucket_update.register_fake
def _bucket_update_fake(params, grads, states, rows, kind) -> torch.Tensor:
    return torch.empty(0, device=params[0].device if params else None)


BUCKET_UPDATE = torch.ops.ddp_compile.bucket_update.default
