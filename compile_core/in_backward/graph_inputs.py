"""The hook the in-graph reducer is handed while updates run inside the backward (`UpdatesHook`).

For each graph the reducer compiles in an update variant, `for_graph` (ddp/in_graph/hooks.py:
`BackwardHook`) adds the graph's extra inputs, each with an example for the compile and a producer
called at every run: the optimizer state tensors of the updated parameters (one producer for them all; static
inputs for CUDA graphs, as the norm below, since the backward writes them in place), per param group and device one
table of scalars, a row per parameter (compile_core/in_backward/optimizer.py), and with clipping the 0-dim
tensor that receives the total norm. It returns the `SplicedUpdates` (compile_core/in_backward/splice.py)
the graph pass places.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from aot.torch_dynamo import graph_break_of
from compile_core.in_backward.optimizer import OptimizerInBackward
from compile_core.in_backward.splice import SplicedUpdates, UpdateSpec
from ddp.in_graph.hooks import GraphToCompile, HookedGraph

log = logging.getLogger(__name__)


class UpdatesHook:
    """Implements `ddp.in_graph.hooks.BackwardHook` for the optimizer update inside the backward."""

    def __init__(self, updates: OptimizerInBackward) -> None:
        self.updates = updates

    @property
    def generation(self) -> int:
        return self.updates.generation

    def for_graph(self, graph: GraphToCompile) -> HookedGraph:
        hooked = self._hooked(graph)
        if hooked.after_reduce is None:
            log.warning("ddp in_graph: %s: optimizer update stays after the backward: %s", graph.name, hooked.reason)
        return hooked

    def _hooked(self, graph: GraphToCompile) -> HookedGraph:
        """Extra inputs (added to `graph.inputs`) and templates for updating the planned parameters that have
        an update."""
        provider, inputs = self.updates, graph.inputs
        if graph_break_of(graph.gm) is not None:
            return HookedGraph(None, reason="the model does not compile into one graph (graph break)")
        indices = sorted(graph.plan.input_indices())
        if not indices:
            return HookedGraph(
                None, skipped=(), reason="this graph reduces no parameter inside its backward (see in_graph's report)"
            )
        params = inputs.examples
        templates = {
            i: t for i in indices if i not in graph.elsewhere and (t := provider.update_for(params[i])) is not None
        }
        # No template: not in the optimizer, no state yet (a branch that joined late), or an earlier graph of
        # the forward adds to its gradient. Its reduced gradient is returned and the normal optimizer step
        # updates it after the backward.
        skipped = tuple(graph.names.get(id(params[i]), "?") for i in indices if i not in templates)
        if not templates:
            return HookedGraph(None, skipped=skipped, reason="no parameter of this graph has an update yet")
        # Every state tensor in one producer (one call per run), then one input per scalar table (group,
        # device), shared by its parameters.
        wanted = [(params[i], key) for i, template in templates.items() for key in template.state_keys]
        examples = [torch.zeros_like(t) for t in provider.state_tensors(wanted)]
        state_inputs = iter(inputs.add_many(examples, provider.state_producer(wanted), fixed_address=True))
        tables: dict[Any, int] = {}
        role_inputs: dict[int, tuple[int, ...]] = {}
        rows: dict[int, int] = {}
        for i, template in templates.items():
            param = params[i]
            roles = [next(state_inputs) for _ in template.state_keys]
            key, table, rows[i] = provider.scalar_table(param)
            if key not in tables:
                tables[key] = inputs.add(table.detach().clone(), lambda p=param: provider.scalar_table(p)[1])
            roles.append(tables[key])
            role_inputs[i] = tuple(roles)
        norm_input = None
        if provider.clip_max_norm is not None and provider.norm is not None:
            norm_input = inputs.add(torch.zeros_like(provider.norm), lambda: provider.norm, fixed_address=True)
        spec = UpdateSpec(
            templates=templates,
            role_inputs=role_inputs,
            scalar_rows=rows,
            clip_max_norm=provider.clip_max_norm,
            norm_input=norm_input,
        )
        return HookedGraph(SplicedUpdates(spec), consumed=frozenset(templates), skipped=skipped)
