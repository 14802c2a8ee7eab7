"""Find the parameters whose gradient does not come from exactly one compiled graph.

Note [Gradients from outside the compiled graph]
------------------------------------------------
Background: the compiled backward all-reduces the gradients it computes. Autograd adds every other
contribution to a parameter's gradient later, at the parameter's AccumulateGrad node: an auxiliary
loss term on `head.bias`, code Dynamo ran eagerly at a graph break, a second graph using the same
parameter. DDP reduces the *total* (its hooks sit after that sum), so for such a parameter the
graph's reduced share plus a rank-local remainder is wrong.

Algorithm, for one backward (armed after the forward, removed at its end):
  * a post-hook on each compiled graph's autograd node records the gradient it hands to each
    parameter's AccumulateGrad (holding a reference, so autograd cannot add another contribution
    into that very tensor in place);
  * a pre-hook on each parameter the graphs reduce sees what AccumulateGrad is about to receive.
    If it is the graph's own tensor, the graph was the only producer; anything else (a sum, or a
    tensor without a recorded one) means another producer. The reference is dropped right there,
    so AccumulateGrad still steals the tensor instead of copying it.
No value is compared: the test is object identity, exact and O(1) per parameter.

Notes: probing costs a Python hook per parameter, so it runs only on the steps where the set of
graphs a rank runs changes (the first step, a recompile with new buckets), never in steady state.
What it finds is reduced after the backward from then on (`ddp/in_graph/leftovers.py`), which is
right whatever share the graph already reduced: the graph's share is the same on every rank, so
averaging `share + rest` over the ranks gives `share + mean(rest)`, DDP's total.

Debugging: `report()["in_graph"]["outside_graph"]` lists what was found.

Note [Counting a parameter's uses]
----------------------------------
An update inside a graph's backward must see the parameter's whole gradient, which it has only when that
graph is the parameter's only gradient producer. The probe learns this after a backward, too late for an
update already compiled, and a graph compiles on its first run, before the graphs after it in the forward
exist (a submodule's frame compiled on its own, followed by its caller's graph). So the producers are counted
beforehand: `gradient_uses` counts, in an eager step's autograd graph, the ops that take each parameter, and
`graph_uses` counts the same in one captured graph. A graph holding fewer uses than the eager step shares the
parameter with other graphs or eager code. Both counts look through casts: autocast casts a parameter once
per region and every op under it reuses that cast, where each compiled graph casts again, so the uses of
the cast say how many ops take the parameter. Where the counts differ otherwise (a parameter the eager step
did not reach, an op counted differently), the graph's count is the smaller in every case we know of, which
leaves that parameter to the normal step: slower, not wrong. A graph whose count were too large (it also
returns a use the loss drops) would update a gradient another graph adds to: the end-of-backward check
(ddp/in_graph/runtime.py) raises then, naming the parameter.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.fx as fx

from aot.torch_eager import tree_leaves
from aot.torch_graphs import compiled_backward_node, param_edges


class OutsideGradientProbe:
    """Armed for one backward over the graphs' outputs and the parameters they reduce (see the Note)."""

    def __init__(self, graph_outputs: Iterable[Any], params: Iterable[torch.nn.Parameter]) -> None:
        self._given: dict[int, list[torch.Tensor | None]] = {}
        self.found: set[int] = set()
        """Ids of parameters with another producer (complete once the backward ended)."""
        self._handles = []
        nodes = {id(n): n for n in (compiled_backward_node(out) for out in graph_outputs) if n is not None}
        for node in nodes.values():
            edges = param_edges(node)
            self._handles.append(node.register_hook(self._graph_done(edges)))
        for p in params:
            self._handles.append(p.register_hook(self._arriving(p)))

    def _graph_done(self, edges: list[tuple[int, torch.Tensor]]):
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            for i, param in edges:
                self._given.setdefault(id(param), []).append(grad_inputs[i])

        return hook

    def _arriving(self, param: torch.nn.Parameter):
        def hook(total: torch.Tensor) -> None:
            given = self._given.pop(id(param), [])
            if len(given) != 1 or given[0] is not total:
                self.found.add(id(param))

        return hook

    def close(self) -> set[int]:
        """Remove every hook; the ids found."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._given.clear()
        return self.found


def eager_outside_producers(outputs: Any, loss: torch.Tensor) -> set[int]:
    """Ids of the parameters whose gradient `loss.backward()` would reach other than through `outputs` (a
    forward's results, run eagerly): an auxiliary loss on a parameter, a tensor the forward stashed on the
    model, anything the loss builds beside the outputs. Read from the autograd graph before the backward
    (`Node.next_functions`; an AccumulateGrad node's `variable` is its parameter), so a step that updates
    inside the backward can leave those parameters out before any update runs. Conservative: a stashed
    activation's parameters count as outside even where a compiled graph would return it."""
    boundary = {t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in boundary:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def gradient_uses(loss: torch.Tensor) -> dict[int, int]:
    """Per parameter id: how many ops of the autograd graph behind `loss` take it (Note [Counting a
    parameter's uses]). Read from `Node.next_functions`, before the backward."""
    takers: dict[Any, list[Any]] = defaultdict(list)  # node -> the nodes with an edge to it, one per edge
    variables: dict[Any, torch.Tensor] = {}
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            variables[node] = variable
            continue
        for next_node, _ in node.next_functions:
            if next_node is not None:
                takers[next_node].append(node)
                stack.append(next_node)

    def uses(node: Any) -> int:
        return sum(uses(t) if t.name() in _EAGER_CASTS and takers.get(t) else 1 for t in takers.get(node, []))

    return {id(variable): uses(node) for node, variable in variables.items()}


_EAGER_CASTS = frozenset({"ToCopyBackward0"})
"""The autograd node of `Tensor.to(dtype)` and of autocast's cast."""

_GRAPH_CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})
"""Tensor methods that cast, as Dynamo records them."""


def graph_uses(gm: fx.GraphModule, index: int) -> int:
    """How many ops of the captured graph `gm` take its input `index` (Note [Counting a parameter's uses])."""
    placeholder = gm.graph.find_nodes(op="placeholder")[index]  # fx keeps them indexed: no walk per parameter

    def uses(node: fx.Node) -> int:
        total = 0
        for user in node.users:
            cast = user.op == "call_method" and user.target in _GRAPH_CASTS and user.args[0] is node
            total += uses(user) if cast and user.users else _occurrences(user, node)
        return total

    return uses(placeholder)


def _occurrences(user: fx.Node, node: fx.Node) -> int:
    found = []
    fx.node.map_arg((user.args, user.kwargs), lambda a: found.append(a is node) or a)
    return sum(found)
