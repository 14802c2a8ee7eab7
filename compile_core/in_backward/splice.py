"""The updates spliced into the compiled backward: each bucket waited for, then its parameters updated.

`SplicedUpdates` is the `AfterReduce` (ddp/in_graph/hooks.py) of a graph compiled with updates: the graph
pass calls it once every bucket's all-reduce is issued, and it places each bucket's wait and, after it,
the update of its parameters, on the real parameter and state tensors: one call of torch's fused SGD/Adam/AdamW
kernel per param group, dtype and device of the bucket (`FusedKernel`), or, where that kernel does not apply,
one copy of the parameter's update graph per parameter (`UpdateTemplate`); both built by
compile_core/in_backward/optimizer.py. Without clipping the buckets are pipelined
(`UpdateSpec.lookahead`): bucket k waits and updates while bucket k+1 is on the wire, after every read of
its parameters by the rest of the backward. With clipping every bucket lands first: the global norm
needs all of them (as `clip_grad_norm_`), then every bucket updates.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from ddp.in_graph.hooks import IssuedBucket, NodeBuilder, ReducedBackward
from inductor.torch_inductor import order_after

_ops = torch.ops.aten
_prims = torch.ops.prims


def _code_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


_CODE_HASH = _code_hash()
"""This package's code: what it splices changes with it (a compiled graph from a cache must match)."""


@dataclasses.dataclass(frozen=True)
class UpdateTemplate:
    """One parameter's optimizer update as a functional aten graph (built by compile_core/in_backward/optimizer.py)."""

    graph: fx.GraphModule
    """Inputs in Dynamo's order; its only in-place ops are `copy_` into the parameter and state."""
    positions: tuple[int | None, ...]
    """Graph input position of each role: param, grad, *state tensors, then the row of scalars
    (`optim_math.scalars`)."""
    state_keys: tuple[str, ...]
    """Keys of `optimizer.state[p]` passed as state tensors, in role order."""

    def cache_key(self) -> tuple:
        return (self.graph.code, self.positions, self.state_keys)


@dataclasses.dataclass(frozen=True)
class FusedKernel:
    """torch's fused SGD, Adam or AdamW kernel (`aten._fused_sgd_`, `_fused_adam_`, `_fused_adamw_`, the
    overloads that read `lr` as a tensor), one call per bucket for the parameters of one param group, dtype and
    device: nothing of the update is compiled, and a bucket updates in a launch or a few. Built by
    compile_core/in_backward/optimizer.py."""

    op: Any
    """The kernel's `OpOverload`."""
    options: tuple[tuple[str, Any], ...]
    """Its keyword options other than `lr` (betas, weight decay, eps, momentum, dampening and the flags):
    constants of the compiled backward, so a change of one is a change of graph."""
    state_keys: tuple[str, ...]
    """Keys of `optimizer.state[p]` passed as state tensors, in the kernel's order (Adam: exp_avg, exp_avg_sq
    and, with amsgrad, max_exp_avg_sq; SGD: momentum_buffer, or none without momentum)."""
    lr_column: int
    """Column of the scalar table that holds the group's learning rate."""
    step_column: int | None
    """Adam's: column of the scalar table that holds the step count this update reaches (the kernel's step
    count: the host advances the optimizer's own counts after the backward). None: SGD, which counts none."""

    def cache_key(self) -> tuple:
        return (str(self.op), self.options, self.state_keys, self.lr_column, self.step_column)


@dataclasses.dataclass(frozen=True)
class UpdateSpec:
    """What one backward needs to update parameters in place."""

    templates: Mapping[int, UpdateTemplate | FusedKernel]
    """Parameter input index -> its update."""
    role_inputs: Mapping[int, tuple[int, ...]]
    """Parameter input index -> graph input indices of its state tensors, then of its scalar table."""
    scalar_rows: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Parameter input index -> its row in the scalar table (its last role input); the template reads that row."""
    clip_max_norm: float | None = None
    """Clip the global norm of all reduced gradients first (all buckets wait, then all update)."""
    norm_input: int | None = None
    """Graph input index of a 0-dim tensor that receives the total norm (with clipping)."""
    lookahead: int | None = 1
    """Buckets issued after bucket k before the backward waits for k and updates it: 1 pipelines
    (gradients die early; the compute thread may wait on the wire); None waits for every bucket
    only after the backward's last gradient (the wire never waits on an update)."""


class SplicedUpdates:
    """The `AfterReduce` of a graph whose backward updates its parameters (see the module docstring)."""

    def __init__(self, spec: UpdateSpec) -> None:
        self.spec = spec

    def cache_key(self) -> str:
        u = self.spec
        return repr(
            (
                _CODE_HASH,
                sorted((i, t.cache_key()) for i, t in u.templates.items()),
                sorted(u.role_inputs.items()),
                sorted(u.scalar_rows.items()),
                u.clip_max_norm,
                u.norm_input,
                u.lookahead,
            )
        )

    def place(self, backward: ReducedBackward) -> None:
        """Each bucket: wait, then apply its parameters' updates, as soon as it is safe."""
        updates, builder, outputs = self.spec, backward.builder, backward.outputs
        graph = backward.backward.graph
        input_node = backward.saved_input
        for bucket in backward.buckets:
            for index in bucket.input_indices:
                if index in updates.templates:
                    input_node(index)
                    for extra in updates.role_inputs[index]:
                        input_node(extra)
        order = {n: i for i, n in enumerate(graph.nodes)}
        ours = set(graph.nodes)  # nodes that existed before the updates: the backward's own reads
        output = next(n for n in graph.nodes if n.op == "output")
        norm_node = input_node(updates.norm_input) if updates.norm_input is not None else None
        last_update: dict[int, fx.Node] = {}  # bucket position -> the last node of its parameters' update

        def last_reader(bucket: IssuedBucket) -> fx.Node:
            # Through views: `addmm(g, t(weight))` reads the weight where the addmm runs, not at the `t`.
            pending = [u for i in bucket.input_indices if i in updates.templates for u in input_node(i).users]
            readers = []
            while pending:
                node = pending.pop()
                if node in ours and node is not output:
                    readers.append(node)
                    if getattr(node.target, "is_view", False):
                        pending.extend(node.users)
            return max(readers, key=order.__getitem__, default=bucket.reduced)

        def finish(k: int, bucket: IssuedBucket, views: tuple[tuple[int, fx.Node], ...], scale: Any = None) -> None:
            fused: dict[tuple[FusedKernel, int, torch.dtype], list[tuple[int, fx.Node]]] = {}
            for (position, view), index in zip(views, bucket.input_indices):
                grad = view if scale is None else builder.call(_ops.mul.Tensor, [view, scale])
                update = updates.templates.get(index)
                if update is None:
                    outputs[position] = grad  # no update here: the optimizer step after the backward uses it
                    continue
                outputs[position] = None  # updated in place: no gradient is kept
                if isinstance(update, FusedKernel):
                    # one kernel call per table (param group and device) and dtype
                    table, dtype = updates.role_inputs[index][-1], input_node(index).meta["val"].dtype
                    fused.setdefault((update, table, dtype), []).append((index, grad))
                    continue
                last = _apply_update(builder, updates, index, input_node, grad)
                if last is not None:
                    last_update[k] = last
            for (kernel, _, _), members in fused.items():
                last_update[k] = _apply_fused(builder, updates, kernel, members, input_node)

        if updates.clip_max_norm is not None:
            # The global norm needs every reduced gradient: all buckets land first, as in
            # `clip_grad_norm_` (norm of the per-gradient norms, coefficient clamped at 1).
            with graph.inserting_before(output):
                landed = [backward.wait_and_split(b) for b in backward.buckets]
                views = [one.views for one in landed]
                coef = _clip_coefficient(builder, [v for b in views for _, v in b], updates.clip_max_norm, norm_node)
                for k, (bucket, bucket_views) in enumerate(zip(backward.buckets, views)):
                    finish(k, bucket, bucket_views, coef)
            # Every update comes after every wait, and each wait after the last read of its bucket's
            # parameters (see below).
            order_after(graph, {one.wait: [last_reader(b)] for one, b in zip(landed, backward.buckets)})
            return
        end = output.prev  # the backward's own last node, before any update is added
        by_issue = sorted(range(len(backward.buckets)), key=lambda k: order[backward.buckets[k].reduced])
        waits: dict[int, fx.Node] = {}
        previous: tuple[int, fx.Node] | None = None  # (anchor position, last node) of the block placed before
        for n, k in enumerate(by_issue):
            bucket = backward.buckets[k]
            # Pipelined: bucket k's update overlaps the next bucket's all-reduce, and comes after every
            # read of bucket k's parameters by the rest of the backward, and after bucket k-1's block.
            ahead = n + updates.lookahead if updates.lookahead is not None else len(by_issue)
            anchor = backward.buckets[by_issue[ahead]].reduced if ahead < len(by_issue) else end
            anchor = max(anchor, last_reader(bucket), key=order.__getitem__)
            position = order[anchor]
            if previous is not None and position <= previous[0]:
                position, anchor = previous[0], previous[1]
            with graph.inserting_after(anchor):
                marker = graph.call_function(_ops.alias.default, (bucket.reduced,))  # insertion point, removed below
            with graph.inserting_before(marker):
                landed = backward.wait_and_split(bucket)
                waits[k] = landed.wait
                finish(k, bucket, landed.views)
            previous = (position, marker.prev)
            graph.erase_node(marker)
        # Inductor's scheduler may otherwise sink a wait below a later bucket's update: pin the pipeline
        # order issue(k+1) -> wait(k) -> update(k) -> wait(k+1). It may also sink a read of a parameter
        # below that parameter's update, when nothing after needs the read soon (the gradient of a graph
        # input, returned at the end: the layer before a graph break got it computed with the updated
        # weight); the update follows its bucket's wait, so the wait is pinned after the last read too.
        deps: dict[fx.Node, list[fx.Node]] = {}
        for n, k in enumerate(by_issue):
            ahead = n + updates.lookahead if updates.lookahead is not None else len(by_issue)
            after = [backward.buckets[by_issue[ahead]].reduced] if ahead < len(by_issue) else [end]
            after.append(last_reader(backward.buckets[k]))
            if n > 0 and by_issue[n - 1] in last_update:
                after.append(last_update[by_issue[n - 1]])
            deps[waits[k]] = after
        order_after(graph, deps)


def _clip_coefficient(
    builder: NodeBuilder, grads: list[fx.Node], max_norm: float, norm_node: fx.Node | None
) -> fx.Node:
    """`clip_grad_norm_`'s coefficient over `grads` (the total norm copied into `norm_node` when given)."""
    # Core aten ops only: nodes added after partitioning skip Inductor's decompositions.
    # As `clip_grad_norm_`: each gradient's norm is computed in fp32 and rounded to the
    # gradient's dtype (what `_foreach_norm` returns), the total norm of those in fp32.
    norms = []
    for v in grads:
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
    total = builder.call(_ops.sqrt.default, [builder.call(_ops.sum.default, [builder.call(_ops.cat.default, [norms])])])
    if norm_node is not None:
        builder.call(_ops.copy_.default, [norm_node, total])
    # scalar_tensor, not full_like: Inductor lowers it as it is (full_like only through a decomposition)
    limit = builder.call(
        _ops.scalar_tensor.default,
        [float(max_norm)],
        {"dtype": total.meta["val"].dtype, "device": total.meta["val"].device},
    )
    return builder.call(
        _ops.clamp_max.default,
        [builder.call(_ops.div.Tensor, [limit, builder.call(_ops.add.Tensor, [total, 1e-6])]), 1.0],
    )


def _apply_update(
    builder: NodeBuilder, updates: UpdateSpec, index: int, input_node: Callable[[int], fx.Node], grad: fx.Node
) -> fx.Node | None:
    """Copy the parameter's update template into the backward, on the real parameter and state."""
    template = updates.templates[index]
    roles = [input_node(index), grad] + [input_node(i) for i in updates.role_inputs[index]]
    # the template takes one row of the table its group's parameters share
    roles[-1] = builder.call(_ops.select.int, [roles[-1], 0, updates.scalar_rows[index]])
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


def _apply_fused(
    builder: NodeBuilder,
    updates: UpdateSpec,
    kernel: FusedKernel,
    members: list[tuple[int, fx.Node]],
    input_node: Callable[[int], fx.Node],
) -> fx.Node:
    """One call of torch's fused kernel on these parameters (one param group, dtype and device) and their
    reduced gradients; the step counts and the learning rate are views of the group's scalar table."""
    params = [input_node(index) for index, _ in members]
    grads = []
    for param, (_, grad) in zip(params, members):
        # The kernel walks each tensor as flat memory, and on CUDA refuses a gradient whose strides are not
        # its parameter's. Both are contiguous here (the optimizer side hands this kernel only contiguous
        # parameters; a bucket's views are), so only the strides of size-1 dims can differ: restated.
        if not grad.meta["val"].is_contiguous():
            grad = builder.call(_ops.clone.default, [grad], {"memory_format": torch.contiguous_format})
        value = param.meta["val"]
        if grad.meta["val"].stride() != value.stride():
            grad = builder.call(_ops.as_strided.default, [grad, list(value.shape), list(value.stride())])
        grads.append(grad)
    roles = [updates.role_inputs[index] for index, _ in members]
    states = [[input_node(r[k]) for r in roles] for k in range(len(kernel.state_keys))]
    table = input_node(roles[0][-1])
    lr = builder.call(_ops.select.int, [builder.call(_ops.select.int, [table, 1, kernel.lr_column]), 0, 0])
    if kernel.step_column is None:  # SGD: the momentum buffers, or none
        args = [params, grads, states[0] if states else []]
    else:
        steps = builder.call(_ops.select.int, [table, 1, kernel.step_column])
        counts = [builder.call(_ops.select.int, [steps, 0, updates.scalar_rows[index]]) for index, _ in members]
        args = [params, grads, states[0], states[1], states[2] if len(states) > 2 else [], counts]
    return builder.call(kernel.op, args, {"lr": lr, **dict(kernel.options)})
