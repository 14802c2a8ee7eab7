"""The FX passes of `ddp="in_graph"`: bucketed all-reduce inside an AOT backward graph.

Note [All-reduce inside the backward graph]
-------------------------------------------
Background: with DDP's reducer, a compiled graph's gradients are handed to autograd all at once
when the graph's backward finishes, so DDP can only start its all-reduces then (or, split into
pieces, at piece boundaries). Here the backward graph all-reduces its own gradients, bucket by
bucket, through functional collectives (`_c10d_functional.all_reduce` / `wait_tensor`), which
Inductor lowers and schedules like any other op.

Algorithm, on the backward graph AOTAutograd produced (after partitioning):
  1. find each parameter's gradient output (`aot.torch_graphs.grad_outputs`) and, per bucket of
     the plan (`ddp/bucketing/grad_buckets.py`), the gradient produced last in the graph;
  2. right after it: divide each of the bucket's gradients by the world size on its way into one
     flat buffer, and issue `all_reduce(sum)` on that buffer (gloo has no AVG; DDP's default hook also
     divides first, so the result is DDP's to the last bit on aot_eager). Dividing before the
     concatenation, not after, lets Inductor write the divided gradients straight into the buffer it
     all-reduces in place: one bucket-sized buffer and one pass over it, where a division of the
     flat buffer needs a second buffer while the bucket is formed;
  3. just before the graph's output: `wait_tensor`, then split the buffer back into gradient views,
     which replace the gradient outputs. With a hook after the all-reduces (ddp/in_graph/hooks.py:
     `AfterReduce`, e.g. the optimizer update of compile_core/in_backward/), the hook places each
     bucket's wait and what runs after it instead, and each flat buffer ends in a few zeros that give it
     a size no other tensor of the graph has (`_unmatched_padding`): such a buffer dies inside the
     graph, and Inductor's buffer reuse hands a dead buffer to the next allocation of exactly its size,
     so a bucket buffer would stay allocated, unused, until a later bucket of the same size (repeated
     blocks make many) took it over. With its own size it is freed where it dies, and reuse stays on
     for everything else (off, every temporary of the backward is an allocation of its own).
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
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from aot.torch_graphs import grad_outputs, graph_fake_mode, input_placeholders, save_for_backward
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.in_graph.hooks import AfterReduce, IssuedBucket, Landed, ReducedBackward
from ddp.torch_ddp import functional_all_reduce_ops

_ops = torch.ops.aten
_prims = torch.ops.prims
_all_reduce, _wait_tensor = functional_all_reduce_ops()


class _Builder:
    """Appends call_function nodes after a cursor, computing each node's fake value."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.fake_mode = graph_fake_mode(graph)

    def call(self, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> fx.Node:
        node = self.graph.call_function(target, tuple(args), dict(kwargs or {}))
        with self.fake_mode:
            value = lambda n: n.meta["val"]  # noqa: E731
            node.meta["val"] = target(
                *fx.node.map_arg(tuple(args), value), **fx.node.map_arg(dict(kwargs or {}), value)
            )
        return node

    def after(
        self, cursor: fx.Node, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
    ) -> fx.Node:
        with self.graph.inserting_after(cursor):
            return self.call(target, args, kwargs)


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
        # Right where the gradient is produced, so the bucket's all-reduce is not pushed to the end.
        outputs[position] = builder.after(grad, _ops.add.Tensor, [grad, placeholders[acc_index]])
    output.args = (tuple(outputs),)
    graph.lint()
    joint.recompile()


def insert_bucketed_all_reduce(
    backward: fx.GraphModule,
    plan: GradBucketPlan,
    *,
    group_name: str,
    world_size: int,
    forward: fx.GraphModule | None = None,
    after_reduce: AfterReduce | None = None,
    wire_dtype: torch.dtype | None = None,
) -> list[str]:
    """Add one flat all-reduce per bucket of `plan` to `backward`; return, per bucket, the op it follows.

    With `after_reduce` (ddp/in_graph/hooks.py; and the partitioned `forward`, whose saved values may have
    to grow), the hook places each bucket's wait and what runs after it. With `wire_dtype`, each bucket is
    cast to it, divided by the world size and all-reduced in it, then cast back (the order of DDP's
    fp16/bf16 compress hooks).
    """
    graph = backward.graph
    builder = _Builder(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    grads = grad_outputs(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    issued: list[IssuedBucket] = []
    after: list[str] = []
    present_of = [[i for i in bucket.input_indices if i in grads] for bucket in plan.buckets]
    sizes = [sum(grads[i][1].meta["val"].numel() for i in present) for present in present_of]
    padding = _unmatched_padding(graph, sizes) if after_reduce is not None else [0] * len(sizes)
    for present, pad in zip(present_of, padding):
        members = [grads[i] for i in present]
        if not members:
            after.append("(no gradient in this graph)")
            continue
        last = max((node for _, node in members), key=order.__getitem__)
        after.append(f"{last.name} ({last.target})")
        cursor, flat = last, []
        dtype = members[0][1].meta["val"].dtype
        for _, node in members:
            if not node.meta["val"].is_contiguous():
                cursor = builder.after(cursor, _ops.clone.default, [node], {"memory_format": torch.contiguous_format})
                node = cursor
            cursor = builder.after(cursor, _ops.view.default, [node, [-1]])
            if wire_dtype is not None and wire_dtype != dtype:
                cursor = builder.after(cursor, _prims.convert_element_type.default, [cursor, wire_dtype])
            # Each gradient is divided on its way into the flat buffer (the same division per element as
            # dividing the buffer), so the buffer is all-reduced as written.
            cursor = builder.after(cursor, _ops.div.Tensor, [cursor, float(world_size)])
            flat.append(cursor)
        if pad:
            wire = flat[-1].meta["val"]
            zeros = {"dtype": wire.dtype, "device": wire.device}
            cursor = builder.after(cursor, _ops.full.default, [[pad], 0.0], zeros)
            flat.append(cursor)
        cursor = builder.after(cursor, _ops.cat.default, [flat])
        cursor = builder.after(cursor, _all_reduce, [cursor, "sum", group_name])
        issued.append(IssuedBucket(members=tuple(members), input_indices=tuple(present), dtype=dtype, reduced=cursor))
    if after_reduce is None:
        # Waits as late as possible: just before the output that needs them.
        for bucket in issued:
            with graph.inserting_before(output):
                for position, value in _wait_and_split(builder, bucket).views:
                    outputs[position] = value
    else:
        if forward is None:
            raise AssertionError("a hook after the all-reduces needs the forward graph (its saved values)")
        after_reduce.place(
            ReducedBackward(
                forward=forward,
                backward=backward,
                buckets=tuple(issued),
                builder=builder,
                outputs=outputs,
                wait_and_split=lambda bucket: _wait_and_split(builder, bucket),
                saved_input=_saved_inputs(forward, backward),
            )
        )
        forward.recompile()
    output.args = (tuple(outputs),)
    graph.lint()
    backward.recompile()
    return after


def _wait_and_split(builder: _Builder, bucket: IssuedBucket) -> Landed:
    """wait_tensor on the bucket, then one gradient view per member."""
    graph = builder.graph
    wait = done = builder.call(_wait_tensor, [bucket.reduced])
    if done.meta["val"].dtype != bucket.dtype:  # a narrower wire: back to the gradients' dtype
        done = builder.call(_prims.convert_element_type.default, [done, bucket.dtype])
    sizes = [n.meta["val"].numel() for _, n in bucket.members]
    padding = done.meta["val"].numel() - sum(sizes)
    parts = builder.call(_ops.split_with_sizes.default, [done, sizes + [padding] if padding else sizes])
    views = []
    for k, (position, node) in enumerate(bucket.members):
        part = graph.call_function(operator.getitem, (parts, k))
        part.meta["val"] = parts.meta["val"][k]
        views.append((position, builder.call(_ops.view.default, [part, list(node.meta["val"].shape)])))
    return Landed(wait=wait, views=tuple(views))


def _unmatched_padding(graph: fx.Graph, sizes: Sequence[int]) -> list[int]:
    """Per bucket of `sizes` elements, how many zeros (at least one) to append to its flat buffer so that
    its size differs from every other bucket's and from every tensor's of `graph` with a static size (none
    for a bucket of symbolic size, which Dynamo gives a parameter only when told to)."""
    taken = set()
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and isinstance(numel := value.numel(), int):
            taken.add(numel)
    padding = []
    for size in sizes:
        if not isinstance(size, int):
            padding.append(0)
            continue
        pad = 1
        while size + pad in taken:
            pad += 1
        taken.add(size + pad)
        padding.append(pad)
    return padding


def _saved_inputs(forward: fx.GraphModule, backward: fx.GraphModule) -> Callable[[int], fx.Node]:
    """`ReducedBackward.saved_input`: each forward input saved for the backward once, on first request."""
    fw_inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    saved: dict[int, fx.Node] = {}

    def saved_input(index: int) -> fx.Node:
        if index not in saved:
            # unchecked: a hook may update these tensors in place, live; a forward that writes a parameter
            # in place (nn.Embedding(max_norm=...)) would otherwise fail the version check
            saved[index] = save_for_backward(forward, backward, fw_inputs[index], version_checked=False)
        return saved[index]

    return saved_input
