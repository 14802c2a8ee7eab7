"""The order in which the in-graph buckets are filled (`ddp/bucketing/grad_buckets.py`): pure logic on
hand-built FX graphs, no process group."""

from __future__ import annotations

import operator

import torch.fx as fx

from ddp.bucketing import ParamInfo
from ddp.bucketing.grad_buckets import GradSlot, plan_grad_buckets, ready_order


def _graph() -> tuple[fx.Graph, dict[str, GradSlot]]:
    """x -> f(x, w0) -> g(h, w1, w2): w1 and w2 are first used by the same node."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    params = [graph.placeholder(f"w{i}") for i in range(3)]
    h = graph.call_function(operator.mul, (x, params[0]))
    out = graph.call_function(operator.add, (h, graph.call_function(operator.mul, (params[1], params[2]))))
    graph.output(out)
    slots = {p.name: GradSlot(input_index=i + 1, info=ParamInfo(name=p.name, nbytes=400)) for i, p in enumerate(params)}
    return graph, slots


def test_gradients_are_ready_in_reverse_order_of_first_use():
    graph, slots = _graph()
    order = ready_order(graph, slots)
    assert [s.info.name for s in order] == ["w1", "w2", "w0"]  # a tie keeps the input order
    plan = plan_grad_buckets(order, bucket_cap_bytes=800, first_bucket_cap_bytes=400)
    assert [list(b.params) for b in plan.buckets] == [["w1"], ["w2", "w0"]]
