"""`ddp="in_graph"`: the compiled backward all-reduces its own gradient buckets.

* `hooks.py` -- the one contract with work placed after each bucket's all-reduce (`begin_step` /
  `step_outcome`, `BackwardHook`, `AfterReduce`; the optimizer update of compile_core/in_backward/);
* `graph_pass.py` -- the FX passes (bucketed all-reduce in the backward, accumulated gradients);
* `partitioner.py` -- AOTAutograd's partition step with those passes (aot_eager and Inductor);
* `runtime.py` -- `InGraphReducer`: DDP's semantics around it (no_sync, buffers, the end of the backward);
* `compile_graph.py` -- one captured graph compiled in the step's variant (its buckets, inputs, hook, partitioner);
* `accumulated.py` -- gradients accumulated under no_sync, handed to the synchronising graph (moved or lent);
* `variants.py` -- which compiled variant a step runs (and the guard on it), the ranks' agreement on its graphs;
* `dispatch.py` -- what Dynamo runs for a graph: per variant, the graph compiled for it (where Dynamo does not guard);
* `hooked_runs.py` -- when a graph compiled with the hook runs uncompiled (one that cannot be compiled again);
* `policy.py` -- which reduction a comm hook asks for (compiled in, or left to DDP's reducer);
* `probe.py` -- finds parameters with gradient producers outside a single compiled graph;
* `after_backward.py` -- which parameters are left to the reduction after the backward (outside, hooked);
* `leftovers.py` -- the reduction after the backward of what the graphs did not reduce alone;
* `join.py` -- inside `ddp.join()` (uneven inputs) DDP's reducer reduces, with buckets again.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from ddp import torch_ddp, torch_ddp_reducer
from ddp.in_graph.dispatch import GraphLog
from ddp.in_graph.hooks import BackwardHook, HookedGraph, StepOutcome
from ddp.in_graph.runtime import InGraphReducer
from ddp.in_graph.variants import VARIANTS, guard_variant_in


def in_graph_blocker(ddp: DistributedDataParallel) -> torch_ddp_reducer.DDPOptionBlocker | None:
    """Why `ddp="in_graph"` cannot keep this DDP model's behaviour (None when it can)."""
    blocker = torch_ddp_reducer.reducer_swap_blocker(ddp)
    if blocker is not None:
        return blocker
    params, sparse = torch_ddp.reducer_params(ddp)
    if any(sparse):
        names = {id(p): n for n, p in ddp.module.named_parameters()}
        which = [names.get(id(p), "?") for p, s in zip(params, sparse) if s]
        return torch_ddp_reducer.DDPOptionBlocker(
            option="sparse_gradients",
            text=f"{which} get sparse gradients (an embedding with sparse=True), which DDP all-reduces as sparse "
            "tensors and a compiled backward's dense buckets cannot",
        )
    return None


__all__ = [
    "VARIANTS",
    "BackwardHook",
    "GraphLog",
    "HookedGraph",
    "InGraphReducer",
    "StepOutcome",
    "guard_variant_in",
    "in_graph_blocker",
]
