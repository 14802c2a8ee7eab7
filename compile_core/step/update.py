"""The compiled optimizer update as one function (`CompiledUpdate`), for any optimizer.

`CompiledUpdate`: `clip_grad_norm_` + `optimizer.step()` as one Dynamo-compiled function, for any
optimizer. Dynamo does not fail on what it cannot trace: it breaks the graph or runs a whole frame
eagerly, silently. So "compiled" is checked, not assumed: the graphs of the first update record which
tensors they read, and `uncaptured()` says which parameters were updated outside any graph. Graph
breaks of the first update come from Dynamo's counters (torch's optimizers break on purpose around
the update, and a scheduler's wrapper around `optimizer.step` is a skipped frame, neither of which
hands a graph to the backend). Compiles, recompiles and their reasons go to a `CompileEvents`.

`ChunkedUpdate` (compile_core/step/chunked_update.py) stands in for it for SGD, Adam and AdamW when their
step loops over the parameters one by one (torch's default on the CPU). When it is multi-tensor
(`foreach`, torch's default on CUDA), the whole step is compiled, as `torch.compile(optimizer.step)`
compiles it: Dynamo traces a few `_foreach_*` calls over all parameters (cheap, where the per-parameter
loop is what chunking saves) and Inductor lowers each into horizontally fused kernels, a few launches per
update where chunks make one compiled call per block and a kernel per parameter (`multi_tensor_step`);
a multi-tensor SGD, Adam or AdamW runs as torch's fused step instead (compile_core/step/fused.py), so this is
other optimizers', `fused=False` ones' and the in-backward update's leftover step. With `fused=True` in every group,
torch's fused step runs as it is (`fused_step`, compile_core/step/train.py).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from aot.torch_dynamo import lookup_backend, watch_caches
from aot.torch_eager import foreach_by_default, optimizer_step_hooks
from compile_core.events import CompileEvents
from compile_core.reuse.compile_once import say
from compile_core.step.optim_math import support


class CompiledUpdate:
    """`update()` compiled with `backend`; call it as `compiled(update_index)`."""

    def __init__(self, update: Callable[[], Any], backend: str | Callable[..., Any], events: CompileEvents) -> None:
        self.events = events
        self._calls = 0
        self._touched: set[int] = set()  # data_ptr of every tensor a graph of the first update reads
        self.records: list[dict[str, Any]] = []
        """One per graph compiled: `name`, `cache` (the cache outcome), `seconds`, `reused_from` (None)."""
        inner = lookup_backend(backend)

        def touch_recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            start = time.perf_counter()
            with watch_caches() as cache:
                compiled = inner(gm, example_inputs)
            record = {
                "name": f"update.graph_{len(self.records)}",
                "cache": cache.describe(),
                "seconds": time.perf_counter() - start,
                "reused_from": None,
            }
            self.records.append(record)
            say("%s compiled (%s) %.2f s", record["name"], record["cache"], record["seconds"])
            if self._calls == 0:
                self._touched.update(_graph_tensor_ptrs(gm, example_inputs))
            return compiled

        # isolate_recompiles: several TrainSteps share the update's code object; without it they
        # would share (and evict) one cache and count each other's compiles as recompiles.
        self._fn = events.compile(update, touch_recording, isolate_recompiles=True)

    def __call__(self, update_index: int) -> Any:
        self.events.label = {"update": update_index}
        with self.events.call():
            if self._calls == 0:
                with self.events.count_breaks():
                    out = self._fn()
            else:
                out = self._fn()
        self._calls += 1
        return out

    def uncaptured(self, params: list[torch.Tensor]) -> list[int]:
        """Indices of `params` that no graph of the first update read (so they were updated eagerly)."""
        return [i for i, p in enumerate(params) if p.data_ptr() not in self._touched]


def _graph_tensor_ptrs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> set[int]:
    # Dynamo lifts optimizer parameters and state into the graph as attributes (get_attr), grads as inputs.
    ptrs = {t.data_ptr() for t in example_inputs if isinstance(t, torch.Tensor)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                ptrs.add(value.data_ptr())
    return ptrs


def clip_and_step(params: list, max_norm: float | None, optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """The whole update as one function: `clip_grad_norm_` (when asked) then `optimizer.step()`;
    returns the norm before clipping (None without clipping)."""

    def update() -> torch.Tensor | None:
        norm = None
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return norm

    return update


def chunking_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `ChunkedUpdate` cannot stand in for `optimizer.step()` (None when it can)."""
    reason = support(optimizer)
    if reason is not None:
        return reason
    hooks = optimizer_step_hooks(optimizer)
    if hooks:
        return f"the optimizer has {hooks} step hook(s), which only optimizer.step() calls"
    multi = multi_tensor_step(optimizer)
    if multi is not None:
        return (
            f"its step is multi-tensor ({multi}): compiled whole, as torch.compile(optimizer.step) does, "
            "into a few horizontally fused kernels"
        )
    return None


def fused_step(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the update should be torch's own fused step, uncompiled (a torch optimizer whose every param group
    has `fused=True`: Adam, AdamW, SGD, Adagrad), or None.

    A fused step is already one kernel launch (a few for many tensors) per device and dtype, the fewest any
    compile reaches; Dynamo does not trace it (torch marks it so), and `torch.compile(optimizer.step)` runs it
    as is too. Compiled in its place: per-block math, a kernel per parameter (SGD/Adam/AdamW), or a whole-step
    compile that captures nothing and falls back (the others)."""
    groups = optimizer.param_groups
    torch_own = type(optimizer).__module__.startswith("torch.optim.")
    if not torch_own or not groups or not all(g.get("fused") for g in groups):
        return None
    return (
        "fused=True: torch's fused kernel updates each device's and dtype's parameters in one launch, "
        "and Dynamo does not trace it"
    )


def multi_tensor_step(optimizer: torch.optim.Optimizer) -> str | None:
    """Which param group makes the optimizer's own step a foreach (multi-tensor) one (`foreach=True`, or
    neither `foreach` nor `fused` given on parameters where torch defaults to foreach), described; None when
    no group does.

    `fused=True` is not counted: Dynamo does not trace torch's fused kernels (the step would run eagerly
    inside a compiled frame). When every group is fused, `fused_step` keeps torch's step; fused groups
    beside others keep the per-block update."""
    for i, group in enumerate(optimizer.param_groups):
        multi = multi_tensor_group(group)
        if multi is not None:
            return f"param group {i} {multi}"
    return None


def multi_tensor_group(group: dict) -> str | None:
    """How one param group's own step is foreach (multi-tensor), described (`multi_tensor_step`); None when it
    loops over its parameters or is fused."""
    if group.get("fused"):
        return None
    if group.get("foreach"):
        return "has foreach=True"
    params = group["params"]
    if group.get("foreach") is None and params and foreach_by_default(params):
        return f"on {params[0].device.type}, where torch's default is foreach"
    return None
