"""The optimizer update (`clip_grad_norm_` + `optimizer.step()`) as one Dynamo-compiled function.

Dynamo does not fail on what it cannot trace: it breaks the graph or runs a whole frame eagerly,
silently. So "compiled" is checked, not assumed: the graphs of the first update record which
tensors they read, and `uncaptured()` says which parameters were updated outside any graph. Graph
breaks of the first update come from Dynamo's counters (torch's optimizers break on purpose around
the update, and a scheduler's wrapper around `optimizer.step` is a skipped frame, neither of which
hands a graph to the backend). Compiles, recompiles and their reasons go to a `CompileEvents`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from aot.torch_dynamo import lookup_backend
from compile_core.events import CompileEvents


class CompiledUpdate:
    """`update()` compiled with `backend`; call it as `compiled(update_index)`."""

    def __init__(self, update: Callable[[], Any], backend: str | Callable[..., Any], events: CompileEvents) -> None:
        self.events = events
        self._calls = 0
        self._touched: set[int] = set()  # data_ptr of every tensor a graph of the first update reads
        inner = lookup_backend(backend) if isinstance(backend, str) else backend

        def touch_recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            compiled = inner(gm, example_inputs)
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
