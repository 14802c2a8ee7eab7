"""The FX passes of `ddp="in_graph"`: bucketed all-reduce inside an AOT backward graph.

Note [All-reduce inside the backward graph]
-------------------------------------------
Background: with DDP's reducer, a compiled graph's gradients are handed to autograd all at once
when the graph's backward finishes, so DDP can only start its all-reduces then (or, split into
pieces, at piece boundaries). Here the backward graph all-reduces its own gradients, bucket by
bucket, through functional collectives (`_c10d_functional.all_reduce` / `wait_tensor`), which
Inductor lowers and schedules like any other op.

Algorithm, on the backward graph AOTAutograd produced (after partitioning):
  1. find each parameter's gradient output (`aot.torch_dynamo.grad_outputs`) and, per bucket of
     the plan (`ddp/bucketing/grad_buckets.py`), the gradient produced last in the graph;
  2. right after it: flatten the bucket's gradients into one buffer, divide by the world size and
     issue `all_reduce(sum)` (gloo has no AVG; DDP's default hook also divides first, so the result
     is DDP's to the last bit on aot_eager);
  3. just before the graph's output: `wait_tensor`, then split the buffer back into gradient views,
     which replace the gradient outputs.
Inductor keeps this order on CPU and GPU without extra passes (checked in its output code: each
`all_reduce_` follows the kernel that writes its bucket, all `wait_tensor`s come last), and it
writes the flat buffer directly from the gradient kernels (no extra copy).

With gradient accumulation, the last micro-batch must reduce `accumulated + this micro-batch`,
not only its own gradient: `add_accumulated` rewrites the joint graph (before partitioning) so
each parameter's gradient output adds an extra input holding the accumulated gradient.

Notes: every new node gets a fake `meta["val"]`, which Inductor needs to lower it. Nodes are only
added, never removed: the partitioner's decisions stay valid.

Debugging: `TORCH_LOGS=output_code` shows the emitted backward; `report()` lists, per bucket,
the backward op after which its all-reduce is issued.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from aot.torch_dynamo import grad_outputs, graph_fake_mode, input_placeholders
from ddp.bucketing.grad_buckets import GradBucketPlan

_ops = torch.ops.aten
_c10d = torch.ops._c10d_functional


class _Builder:
    """Appends call_function nodes after a cursor, computing each node's fake value."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.fake_mode = graph_fake_mode(graph)

    def call(self, target: Any, args: Sequence[Any]) -> fx.Node:
        node = self.graph.call_function(target, tuple(args))
        with self.fake_mode:
            node.meta["val"] = target(*fx.node.map_arg(tuple(args), lambda n: n.meta["val"]))
        return node

    def after(self, cursor: fx.Node, target: Any, args: Sequence[Any]) -> fx.Node:
        with self.graph.inserting_after(cursor):
            return self.call(target, args)


def add_accumulated(joint: fx.GraphModule, accumulated_input_of: Mapping[int, int]) -> None:
    """Make the gradient of input i be `grad_i + input_j` for each `i -> j` (accumulated gradients)."""
    graph = joint.graph
    builder = _Builder(graph)
    placeholders = input_placeholders(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    for param_index, (position, grad) in grad_outputs(graph).items():
        acc_index = accumulated_input_of.get(param_index)
        if acc_index is None:
            continue
        with graph.inserting_before(output):
            outputs[position] = builder.call(_ops.add.Tensor, [grad, placeholders[acc_index]])
    output.args = (tuple(outputs),)
    graph.lint()
    joint.recompile()


def insert_bucketed_all_reduce(
    backward: fx.GraphModule, plan: GradBucketPlan, *, group_name: str, world_size: int
) -> list[str]:
    """Add one flat all-reduce per bucket of `plan` to `backward`; return, per bucket, the op it follows."""
    graph = backward.graph
    builder = _Builder(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    grads = grad_outputs(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    issued: list[tuple[list[tuple[int, fx.Node]], fx.Node]] = []
    after: list[str] = []
    for bucket in plan.buckets:
        members = [grads[i] for i in bucket.input_indices if i in grads]
        if not members:
            after.append("(no gradient in this graph)")
            continue
        last = max((node for _, node in members), key=order.__getitem__)
        after.append(f"{last.name} ({last.target})")
        cursor, flat = last, []
        for _, node in members:
            view = _ops.view.default if node.meta["val"].is_contiguous() else _ops.reshape.default
            cursor = builder.after(cursor, view, [node, [-1]])
            flat.append(cursor)
        cursor = builder.after(cursor, _ops.cat.default, [flat])
        cursor = builder.after(cursor, _ops.div.Tensor, [cursor, float(world_size)])
        cursor = builder.after(cursor, _c10d.all_reduce.default, [cursor, "sum", group_name])
        issued.append((members, cursor))
    # Waits as late as possible: just before the output that needs them.
    for members, reduced in issued:
        with graph.inserting_before(output):
            done = builder.call(_c10d.wait_tensor.default, [reduced])
            parts = builder.call(_ops.split_with_sizes.default, [done, [n.meta["val"].numel() for _, n in members]])
            for k, (position, node) in enumerate(members):
                part = graph.call_function(operator.getitem, (parts, k))
                part.meta["val"] = parts.meta["val"][k]
                outputs[position] = builder.call(_ops.view.default, [part, list(node.meta["val"].shape)])
    output.args = (tuple(outputs),)
    graph.lint()
    backward.recompile()
    return after
