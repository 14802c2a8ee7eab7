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
  2. right after it: divide each of the bucket's gradients by the world size on its way into one
     flat buffer, and issue `all_reduce(sum)` on that buffer (gloo has no AVG; DDP's default hook also
     divides first, so the result is DDP's to the last bit on aot_eager). Dividing before the
     concatenation, not after, lets Inductor write the divided gradients straight into the buffer it
     all-reduces in place: one bucket-sized buffer and one pass over it, where a division of the
     flat buffer needs a second buffer while the bucket is formed;
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

import dataclasses
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from aot.torch_dynamo import grad_outputs, graph_fake_mode, input_placeholders, save_for_backward
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.torch_ddp import functional_all_reduce_ops
from inductor.torch_inductor import order_after

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


@dataclasses.dataclass(frozen=True)
class UpdateTemplate:
    """One parameter's optimizer update as a functional aten graph (built by compile_core.step.in_backward)."""

    graph: fx.GraphModule
    """Inputs in Dynamo's order; its only in-place ops are `copy_` into the parameter and state."""
    positions: tuple[int | None, ...]
    """Graph input position of each role: param, grad, *state tensors, *hyperparameter tensors."""
    state_keys: tuple[str, ...]
    """Keys of `optimizer.state[p]` passed as state tensors, in role order."""
    hyper_keys: tuple[str, ...]
    """Group hyperparameter tensors that follow ("lr", "beta1", "beta2")."""


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """What the backward needs to update parameters in place (optimizer_in_backward)."""

    templates: Mapping[int, UpdateTemplate]
    """Parameter input index -> its update."""
    role_inputs: Mapping[int, tuple[int, ...]]
    """Parameter input index -> graph input indices of its state and hyperparameter tensors."""
    clip_max_norm: float | None = None
    """Clip the global norm of all reduced gradients first (all buckets wait, then all update)."""
    norm_input: int | None = None
    """Graph input index of a 0-dim tensor that receives the total norm (with clipping)."""
    lookahead: int | None = 1
    """Buckets issued after bucket k before the backward waits for k and updates it: 1 pipelines
    (gradients die early; the compute thread may wait on the wire); None waits for every bucket
    only after the backward's last gradient (the wire never waits on an update)."""


@dataclasses.dataclass
class _Issued:
    members: list[tuple[int, fx.Node]]  # (output position, gradient node)
    reduced: fx.Node  # the all_reduce node
    index: int  # input indices follow `members`
    input_indices: list[int]
    dtype: torch.dtype  # the gradients' dtype (the wire may be narrower)
    wait: fx.Node | None = None  # its wait_tensor, once placed
    last_update: fx.Node | None = None  # the last node of its parameters' update


def insert_bucketed_all_reduce(
    backward: fx.GraphModule,
    plan: GradBucketPlan,
    *,
    group_name: str,
    world_size: int,
    forward: fx.GraphModule | None = None,
    updates: UpdateSpec | None = None,
    wire_dtype: torch.dtype | None = None,
) -> list[str]:
    """Add one flat all-reduce per bucket of `plan` to `backward`; return, per bucket, the op it follows.

    With `updates` (and the partitioned `forward`, whose saved values may have to grow), each
    bucket's parameters are updated once its all-reduce lands, and their gradients are not returned.
    With `wire_dtype`, each bucket is cast to it, divided by the world size and all-reduced in it,
    then cast back (the order of DDP's fp16/bf16 compress hooks).
    """
    graph = backward.graph
    builder = _Builder(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    grads = grad_outputs(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = list(output.args[0])
    issued: list[_Issued] = []
    after: list[str] = []
    for bucket in plan.buckets:
        present = [i for i in bucket.input_indices if i in grads]
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
        cursor = builder.after(cursor, _ops.cat.default, [flat])
        cursor = builder.after(cursor, _all_reduce, [cursor, "sum", group_name])
        issued.append(_Issued(members=members, reduced=cursor, index=len(issued), input_indices=present, dtype=dtype))
    if updates is None:
        # Waits as late as possible: just before the output that needs them.
        for bucket in issued:
            with graph.inserting_before(output):
                for position, value in _wait_and_split(builder, bucket):
                    outputs[position] = value
    else:
        if forward is None:
            raise AssertionError("updates need the forward graph (its saved values)")
        _insert_updates(forward, backward, builder, issued, updates, outputs)
        forward.recompile()
    output.args = (tuple(outputs),)
    graph.lint()
    backward.recompile()
    return after


def _wait_and_split(builder: _Builder, bucket: _Issued) -> list[tuple[int, fx.Node]]:
    """wait_tensor on the bucket, then one gradient view per member: [(output position, view)]."""
    graph = builder.graph
    done = builder.call(_wait_tensor, [bucket.reduced])
    bucket.wait = done
    if done.meta["val"].dtype != bucket.dtype:  # a narrower wire: back to the gradients' dtype
        done = builder.call(_prims.convert_element_type.default, [done, bucket.dtype])
    parts = builder.call(_ops.split_with_sizes.default, [done, [n.meta["val"].numel() for _, n in bucket.members]])
    views = []
    for k, (position, node) in enumerate(bucket.members):
        part = graph.call_function(operator.getitem, (parts, k))
        part.meta["val"] = parts.meta["val"][k]
        views.append((position, builder.call(_ops.view.default, [part, list(node.meta["val"].shape)])))
    return views


def _insert_updates(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    builder: _Builder,
    issued: list[_Issued],
    updates: UpdateSpec,
    outputs: list,
) -> None:
    """Each bucket: wait, then apply its parameters' updates, as soon as it is safe (see the Note)."""
    graph = backward.graph
    fw_inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    saved: dict[int, fx.Node] = {}

    def input_node(index: int) -> fx.Node:
        if index not in saved:
            # unchecked: the backward updates these tensors in place, live; a forward that writes a
            # parameter in place (nn.Embedding(max_norm=...)) would otherwise fail the version check
            saved[index] = save_for_backward(forward, backward, fw_inputs[index], version_checked=False)
        return saved[index]

    for bucket in issued:
        for index in bucket.input_indices:
            if index in updates.templates:
                input_node(index)
                for extra in updates.role_inputs[index]:
                    input_node(extra)
    order = {n: i for i, n in enumerate(graph.nodes)}
    ours = {n for n in graph.nodes}  # nodes that existed before the updates: the backward's own reads
    output = next(n for n in graph.nodes if n.op == "output")
    norm_node = input_node(updates.norm_input) if updates.norm_input is not None else None

    def last_reader(bucket: _Issued) -> fx.Node:
        readers = [
            u for i in bucket.input_indices if i in saved for u in saved[i].users if u in ours and u is not output
        ]
        return max(readers, key=order.__getitem__, default=bucket.reduced)

    def finish(bucket: _Issued, views: list[tuple[int, fx.Node]], scale: fx.Node | None = None) -> None:
        for (position, view), index in zip(views, bucket.input_indices):
            grad = view if scale is None else builder.call(_ops.mul.Tensor, [view, scale])
            if index not in updates.templates:
                outputs[position] = grad  # no update here: the optimizer step after the backward uses it
                continue
            bucket.last_update = _apply_update(builder, updates, index, input_node, grad) or bucket.last_update
            outputs[position] = None  # updated in place: no gradient is kept

    if updates.clip_max_norm is not None:
        # The global norm needs every reduced gradient: all buckets land first, as in
        # `clip_grad_norm_` (norm of the per-gradient norms, coefficient clamped at 1).
        with graph.inserting_before(output):
            # Core aten ops only: nodes added after partitioning skip Inductor's decompositions.
            views = [_wait_and_split(builder, b) for b in issued]
            # As `clip_grad_norm_`: each gradient's norm is computed in fp32 and rounded to the
            # gradient's dtype (what `_foreach_norm` returns), the total norm of those in fp32.
            norms = []
            for _, v in (pair for b in views for pair in b):
                wide = builder.call(_prims.convert_element_type.default, [v, torch.float32])
                norm = builder.call(
                    _ops.sqrt.default, [builder.call(_ops.sum.default, [builder.call(_ops.mul.Tensor, [wide, wide])])]
                )
                if v.meta["val"].dtype != torch.float32:
                    norm = builder.call(
                        _prims.convert_element_type.default,
                        [builder.call(_prims.convert_element_type.default, [norm, v.meta["val"].dtype]), torch.float32],
                    )
                norms.append(builder.call(_ops.view.default, [builder.call(_ops.mul.Tensor, [norm, norm]), [1]]))
            total = builder.call(
                _ops.sqrt.default, [builder.call(_ops.sum.default, [builder.call(_ops.cat.default, [norms])])]
            )
            if norm_node is not None:
                builder.call(_ops.copy_.default, [norm_node, total])
            # scalar_tensor, not full_like: Inductor lowers it as it is (full_like only through a decomposition)
            limit = builder.call(
                _ops.scalar_tensor.default,
                [float(updates.clip_max_norm)],
                {"dtype": total.meta["val"].dtype, "device": total.meta["val"].device},
            )
            coef = builder.call(
                _ops.clamp_max.default,
                [builder.call(_ops.div.Tensor, [limit, builder.call(_ops.add.Tensor, [total, 1e-6])]), 1.0],
            )
            for bucket, bucket_views in zip(issued, views):
                finish(bucket, bucket_views, coef)
        return
    end = output.prev  # the backward's own last node, before any update is added
    by_issue = sorted(issued, key=lambda b: order[b.reduced])
    previous: tuple[int, fx.Node] | None = None  # (anchor position, last node) of the block placed before
    for k, bucket in enumerate(by_issue):
        # Pipelined: bucket k's update overlaps the next bucket's all-reduce, and comes after every
        # read of bucket k's parameters by the rest of the backward, and after bucket k-1's block.
        ahead = k + updates.lookahead if updates.lookahead is not None else len(by_issue)
        anchor = by_issue[ahead].reduced if ahead < len(by_issue) else end
        anchor = max(anchor, last_reader(bucket), key=order.__getitem__)
        position = order[anchor]
        if previous is not None and position <= previous[0]:
            position, anchor = previous[0], previous[1]
        with graph.inserting_after(anchor):
            marker = graph.call_function(_ops.alias.default, (bucket.reduced,))  # insertion point, removed below
        with graph.inserting_before(marker):
            finish(bucket, _wait_and_split(builder, bucket))
        previous = (position, marker.prev)
        graph.erase_node(marker)
    # Inductor's scheduler may otherwise sink a wait below a later bucket's update: pin the pipeline
    # order issue(k+1) -> wait(k) -> update(k) -> wait(k+1).
    deps: dict[fx.Node, list[fx.Node]] = {}
    for k, bucket in enumerate(by_issue):
        ahead = k + updates.lookahead if updates.lookahead is not None else len(by_issue)
        after = [by_issue[ahead].reduced] if ahead < len(by_issue) else [end]
        if k > 0 and by_issue[k - 1].last_update is not None:
            after.append(by_issue[k - 1].last_update)
        if bucket.wait is not None and after:
            deps[bucket.wait] = after
    order_after(graph, deps)


def _apply_update(
    builder: _Builder, updates: UpdateSpec, index: int, input_node: Callable[[int], fx.Node], grad: fx.Node
) -> fx.Node | None:
    """Copy the parameter's update template into the backward, on the real parameter and state."""
    template = updates.templates[index]
    roles = [input_node(index), grad] + [input_node(i) for i in updates.role_inputs[index]]
    placeholders = [n for n in template.graph.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = {}
    for role, position in zip(roles, template.positions):
        if position is not None:
            env[placeholders[position]] = role
    last = None
    for node in template.graph.graph.nodes:
        if node.op == "call_function":
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = last = builder.call(node.target, args, kwargs)
    return last
