"""The graphs Dynamo and AOTAutograd hand a backend, and the autograd node AOTAutograd runs them in, in one
place (a home of private torch internals, like `aot/torch_dynamo.py`): nested compile regions in Dynamo's
graph, which input each gradient output belongs to, the values the forward saves for the backward, extra
inputs on Dynamo's graph, and the compiled function's backward node.

What the backends (`ddp="in_graph"`, the eager fallback, the pairing of forward and backward in
aot/pairing.py) read and rewrite in those graphs. Each function says which torch 2.13 file it mirrors;
`tests/single/test_torch_internals_aot_graphs.py` has its canary. How a function is compiled, and Dynamo's other
internals, are in `aot/torch_dynamo.py`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from aot.torch_eager import tree_leaves


def nested_region_calls(gm: fx.GraphModule) -> int:
    """How many `invoke_subgraph` calls (a `torch.compiler.nested_compile_region` traced once and called
    again) Dynamo's graph holds (`torch/_higher_order_ops/invoke_subgraph.py`)."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke_subgraph)


def inline_nested_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` run without compiling: each `invoke_subgraph` call replaced by a call of the region's body.

    Run eagerly, the op's autograd rule asserts a fake mode in its backward ("fake_mode should be enabled
    for HOPs", torch 2.13; `torch.compile(backend="eager")` fails the same way), so an eager fallback of a
    graph with nested compile regions calls the bodies as plain modules instead. `gm` itself is unchanged.
    """
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    if not nested_region_calls(gm):
        return gm
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is invoke_subgraph:
            body, _identifier, *operands = node.args
            with graph.inserting_before(node):
                call = graph.call_module(body.target, tuple(operands))
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            if not body.users:
                graph.erase_node(body)
    return fx.GraphModule(gm, graph)


def grad_outputs(graph: fx.Graph) -> dict[int, tuple[int, fx.Node]]:
    """Graph-input index -> (output position, node) for each gradient an AOT graph returns.

    Works on the joint graph and on the backward graph after partitioning: AOTAutograd tags the
    output node with `meta["desc"]`, one descriptor per output; a `GradAOTOutput` says which input
    (`PlainAOTInput(idx)`, the Dynamo graph's input position) the gradient belongs to
    (`_functorch/_aot_autograd/descriptors.py`, `graph_capture.py`).
    """
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput

    output = next(n for n in graph.nodes if n.op == "output")
    found: dict[int, tuple[int, fx.Node]] = {}
    for position, (node, desc) in enumerate(zip(output.args[0], output.meta.get("desc", ()))):
        if isinstance(node, fx.Node) and isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, PlainAOTInput):
            found[desc.grad_of.idx] = (position, node)
    return found


def input_placeholders(graph: fx.Graph) -> dict[int, fx.Node]:
    """Graph-input index -> placeholder, for the inputs of an AOT joint graph (`meta["desc"]`)."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput

    return {
        n.meta["desc"].idx: n
        for n in graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("desc"), PlainAOTInput)
    }


def has_input_descriptors(graph: fx.Graph) -> bool:
    """Whether AOTAutograd described `graph`'s inputs (`meta["desc"]` on its placeholders): true of the joint
    graph it traces for a Dynamo graph, false of the body of a nested compile region, which it partitions
    on its own (`_functorch/_aot_autograd/graph_compile.py`, invoke_subgraph)."""
    return any(n.meta.get("desc") is not None for n in graph.nodes if n.op == "placeholder")


def graph_fake_mode(graph: fx.Graph) -> Any:
    """The FakeTensorMode of the values AOTAutograd recorded on `graph`'s nodes (`node.meta["val"]`)."""
    from torch._guards import detect_fake_mode

    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals)


def with_extra_inputs(gm: fx.GraphModule, names: list[str], *, fixed_address: Sequence[int] = ()) -> fx.GraphModule:
    """A copy of Dynamo's graph module `gm` with extra placeholders `names` after its own inputs; those at
    positions `fixed_address` (in `names`) are static inputs for CUDA graphs, as Dynamo's parameters are.

    Dynamo keeps using its graph after the backend returns (it reads `meta["grapharg"]` of every
    placeholder, `_dynamo/output_graph.py`), so the original is left untouched. AOTAutograd
    recognises a Dynamo graph by `meta["dynamo_compile_id"]` and `_param_name_to_source`, and wants
    `_dynamo_source` on every placeholder (`_functorch/_aot_autograd/frontend_utils.py`); ours have
    none (None), as the inputs DDPOptimizer creates. The same function lists as static (its
    `static_input_indices`, which Inductor's CUDA graphs read) the placeholders whose
    `meta["tensor_dict"]` carries a `_dynamo_static_input_type`, as Dynamo records it for a parameter or
    a tensor given to `torch._dynamo.mark_static_address`.
    """
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, copies)
    for old, new in copies.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    fixed = set(fixed_address)
    for k, name in enumerate(names):
        with graph.inserting_after(last):
            last = graph.placeholder(name)
        last._dynamo_source = None
        if k in fixed:
            # "unguarded": no guard on the address; CUDA graphs record again if it moves (a loaded checkpoint)
            last.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
    graph.output(output)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy


def saved_count(backward: fx.Graph) -> int:
    """How many values the forward saved for `backward`: its placeholders before the incoming gradients.

    Mirrors AOTAutograd's partitioned backward (`_functorch/partitioners.py`): its inputs are the
    saved values, then the incoming gradients, named `tangents_<i>`.
    """
    return sum(1 for n in backward.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))


def save_for_backward(
    forward: fx.GraphModule, backward: fx.GraphModule, fw_node: fx.Node, *, version_checked: bool = True
) -> fx.Node:
    """Make the partitioned `forward` save `fw_node` for `backward`; return its placeholder there.

    `version_checked=False` hands the backward the tensor itself, however often it was written to in
    place since the forward (AOTAutograd stashes it on the autograd ctx instead of `save_for_backward`,
    `meta["saved_tensor_with_no_vc_check"]`, Note [Activations with no version counter checks in eager]
    in `_functorch/_aot_autograd/descriptors.py`): for a tensor the backward writes into, not one it
    reads as the forward saw it. Such tensors go after the checked ones, as AOTAutograd orders them.

    AOTAutograd's partitioned graphs talk through the forward's extra outputs, in two different
    orders (`_functorch/partitioners.py`, `_extract_fwd_bwd_modules`): the forward returns its user
    outputs, then the saved tensors, then the saved symbolic sizes; the backward's placeholders are
    the saved symbolic sizes first, then the saved tensors, then the tangents (the runtime passes
    `*ctx.symints, *ctx.saved_tensors, ...`, `_aot_autograd/runtime_wrappers.py`). So the saved
    tensors pair up in order, and a new one goes after the last saved tensor on both sides (after
    the sizes in the backward). `_aot_autograd/graph_compile.py` counts saved values from these
    graphs. A value already saved is reused. Call before the graphs are compiled.
    """
    fw_out = next(n for n in forward.graph.nodes if n.op == "output")
    outputs = list(fw_out.args[0])
    n_saved = saved_count(backward.graph)
    saved = outputs[len(outputs) - n_saved :]
    bw_saved = [n for n in backward.graph.nodes if n.op == "placeholder"][:n_saved]
    is_tensor = lambda n: isinstance(n.meta.get("val"), torch.Tensor)  # noqa: E731
    fw_tensors = [n for n in saved if is_tensor(n)]
    bw_tensors = [n for n in bw_saved if is_tensor(n)]
    if len(fw_tensors) != len(bw_tensors):
        raise AssertionError(
            f"AOTAutograd's forward saves {len(fw_tensors)} tensors but its backward takes {len(bw_tensors)}"
        )
    for value, placeholder in zip(fw_tensors, bw_tensors):
        if value is fw_node:
            return placeholder
    if not version_checked:
        fw_node.meta["saved_tensor_with_no_vc_check"] = True
    elif any(n.meta.get("saved_tensor_with_no_vc_check") for n in fw_tensors):
        raise AssertionError(f"{fw_node.name}: a version-checked tensor cannot follow unchecked ones")
    position = len(outputs) - n_saved + len(fw_tensors)  # saved tensors come before saved sizes
    outputs.insert(position, fw_node)
    fw_out.args = (tuple(outputs),)
    sizes = [n for n in bw_saved if not is_tensor(n)]
    anchor = bw_tensors[-1] if bw_tensors else (sizes[-1] if sizes else None)
    if anchor is None:
        first = next((n for n in backward.graph.nodes if n.op == "placeholder"), None)
        with backward.graph.inserting_before(first):
            placeholder = backward.graph.placeholder(f"saved_{fw_node.name}")
    else:
        with backward.graph.inserting_after(anchor):
            placeholder = backward.graph.placeholder(f"saved_{fw_node.name}")
    placeholder.meta.update(fw_node.meta)
    return placeholder


def compiled_backward_node(outputs: Any) -> Any:
    """The autograd node of an AOTAutograd-compiled function, found from what the function returned.

    Mirrors `CompiledFunction` (`_functorch/_aot_autograd/runtime_wrappers.py`), an
    `autograd.Function` whose backward node is named `CompiledFunctionBackward`. An output may be a
    view of a compiled output (its node then sits one or two edges further). None when no output
    requires grad.
    """
    seen: set[int] = set()
    frontier = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    for _ in range(3):
        following = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if type(node).__name__ == "CompiledFunctionBackward":
                return node
            following += [fn for fn, _ in node.next_functions]
        frontier = following
    return None


def param_edges(node: Any) -> list[tuple[int, torch.Tensor]]:
    """(edge index, leaf tensor) for each edge of autograd `node` that ends in a leaf's AccumulateGrad.

    Mirrors `torch::autograd::AccumulateGrad` (exposed with its `.variable`): a gradient the node
    hands to edge i goes straight into that leaf's `.grad`, unless other nodes also feed it.
    """
    out = []
    for i, (fn, _) in enumerate(node.next_functions):
        variable = getattr(fn, "variable", None) if fn is not None else None
        if isinstance(variable, torch.Tensor):
            out.append((i, variable))
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
