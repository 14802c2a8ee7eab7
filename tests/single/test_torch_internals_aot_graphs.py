"""Canaries of aot/torch_graphs.py: the AOTAutograd graph internals of ddp="in_graph", the compiled autograd
node, nested compile regions (what a canary is: tests/single/torch_internals_helpers.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from aot import torch_aot, torch_dynamo, torch_graphs
from tests.single.torch_internals_helpers import canary

pytestmark = pytest.mark.usefixtures("pg")


# -- the AOT graph internals of ddp="in_graph" ----------------------------------------------------------


def _partitioned(fn, *inputs, dynamic=None):
    """The joint graph, and the forward/backward graphs AOTAutograd partitions it into, for `fn`."""
    from functorch.compile import min_cut_rematerialization_partition

    seen = {}

    def partition(joint, joint_inputs, **kwargs):
        seen["joint"] = copy.deepcopy(joint.graph)
        seen["fw"], seen["bw"] = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        return seen["fw"], seen["bw"]

    backend = torch_aot.aot_autograd_backend(
        fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward, partition_fn=partition
    )
    torch.compile(fn, backend=backend, dynamic=dynamic)(*inputs).sum().backward()
    return seen


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_gradient_outputs_name_their_inputs():
    with canary("aot/torch_graphs.py:grad_outputs/input_placeholders/graph_fake_mode"):
        w, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
        seen = _partitioned(lambda x: torch.nn.functional.linear(x, w, b), torch.randn(2, 4))
        grads = torch_graphs.grad_outputs(seen["bw"].graph)
        shapes = {i: tuple(node.meta["val"].shape) for i, (_, node) in grads.items()}
        assert sorted(shapes.values()) == [(3,), (3, 4)], shapes
        assert set(torch_graphs.input_placeholders(seen["joint"])) >= set(grads)
        assert torch_graphs.graph_fake_mode(seen["bw"].graph) is not None


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_forward_input_can_be_saved_for_the_backward():
    with canary("aot/torch_graphs.py:save_for_backward"):
        w = torch.randn(4, requires_grad=True)
        seen = _partitioned(lambda x, b: x * w + b, torch.randn(4), torch.randn(4))
        fw, bw = seen["fw"], seen["bw"]
        saved = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
        unused = next(n for n in fw.graph.nodes if n.op == "placeholder" and n.name not in saved)  # `b`
        before = len([n for n in bw.graph.nodes if n.op == "placeholder"])
        placeholder = torch_graphs.save_for_backward(fw, bw, unused)
        assert placeholder.op == "placeholder"
        assert len([n for n in bw.graph.nodes if n.op == "placeholder"]) == before + 1
        assert torch_graphs.save_for_backward(fw, bw, unused) is placeholder  # saved once
        fw.recompile()
        bw.recompile()
        assert placeholder.name in bw.code


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("version_checked", [True, False])
def test_an_input_saved_unchecked_reaches_the_backward_after_an_in_place_write(version_checked):
    """What `optimizer_in_backward` relies on for the parameters it updates: saved unchecked, a tensor written
    in place between the forward and the backward (as `nn.Embedding(max_norm=...)` writes its weight) still
    reaches the backward; saved checked, autograd refuses it, as torch 2.13 does for any saved tensor."""
    with canary("aot/torch_graphs.py:save_for_backward(version_checked=False)"):
        from functorch.compile import min_cut_rematerialization_partition

        p = torch.randn(4)
        w = torch.randn(4, requires_grad=True)

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            live = next(n for n in fw.graph.nodes if n.op == "placeholder" and n.meta["val"].shape == (4,))
            torch_graphs.save_for_backward(fw, bw, live, version_checked=version_checked)
            fw.recompile()
            bw.recompile()
            return fw, bw

        backend = torch_aot.aot_autograd_backend(
            fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward, partition_fn=partition
        )
        out = torch.compile(lambda x: (x + w).square().sum(), backend=backend)(p)  # saves x + w, not x
        p.add_(1.0)  # the in-place write between the forward and the backward
        if version_checked:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.backward()
        else:
            out.backward()
            torch.testing.assert_close(w.grad, 2 * (p - 1.0 + w.detach()))


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_saved_tensors_pair_up_when_symbolic_sizes_are_saved_too():
    # The forward returns saved tensors then saved sizes; the backward takes the sizes first.
    with canary("aot/torch_graphs.py:save_for_backward"):
        w = torch.randn(4, requires_grad=True)
        seen = _partitioned(
            lambda x, b: (x.sum(0) * w).sin() + b.sum(), torch.randn(3, 4), torch.randn(5, 4), dynamic=True
        )
        fw, bw = seen["fw"], seen["bw"]
        n_saved = torch_graphs.saved_count(bw.graph)
        fw_saved = list(next(n for n in fw.graph.nodes if n.op == "output").args[0])[-n_saved:]
        is_tensor = lambda n: isinstance(n.meta.get("val"), torch.Tensor)  # noqa: E731
        assert not is_tensor(fw_saved[-1]), "no symbolic size saved: the order would not matter here"
        for value in filter(is_tensor, fw_saved):  # already saved: found, by the name it keeps in the backward
            assert torch_graphs.save_for_backward(fw, bw, value).name == value.name
        unsaved = next(n for n in fw.graph.nodes if n.op == "placeholder" and is_tensor(n) and n not in fw_saved)
        torch_graphs.save_for_backward(fw, bw, unsaved)
        n_saved = torch_graphs.saved_count(bw.graph)
        fw_tensors = [n.name for n in list(next(n for n in fw.graph.nodes if n.op == "output").args[0])[-n_saved:]]
        bw_saved = [n for n in bw.graph.nodes if n.op == "placeholder"][:n_saved]
        bw_tensors = [n.name.removeprefix("saved_") for n in bw_saved if is_tensor(n)]
        assert [n for n in fw_tensors if n in bw_tensors] == bw_tensors and unsaved.name in bw_tensors
        assert not is_tensor(bw_saved[0]), "the backward takes the saved sizes first"


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_saved_values_are_the_backward_inputs_before_the_tangents():
    with canary("aot/torch_graphs.py:saved_count"):
        w = torch.randn(4, requires_grad=True)
        seen = _partitioned(lambda x: (x * w).sin(), torch.randn(4))
        fw_outputs = next(n for n in seen["fw"].graph.nodes if n.op == "output").args[0]
        assert torch_graphs.saved_count(seen["bw"].graph) == len(fw_outputs) - 1 >= 1  # one user output


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_mutating_function_is_captured_as_a_functional_graph():
    with canary("aot/torch_dynamo.py:capture_functional"):

        def update(p, g, lr):
            p.sub_(g * lr)

        args = [torch.ones(4), torch.full((4,), 2.0), torch.tensor(0.5)]
        graph, positions = torch_dynamo.capture_functional(update, args)
        assert sorted(p for p in positions if p is not None) == [0, 1, 2]
        assert any(n.target is torch.ops.aten.copy_.default for n in graph.graph.nodes)
        p = torch.ones(4)
        inputs = [None] * 3
        for arg, pos in zip([p, torch.full((4,), 2.0), torch.tensor(0.5)], positions):
            inputs[pos] = arg
        graph(*inputs)
        torch.testing.assert_close(p, torch.zeros(4))


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_extra_inputs_leave_dynamos_graph_alone():
    with canary("aot/torch_graphs.py:with_extra_inputs"):
        seen = {}

        def backend(gm, example_inputs):
            extended = torch_graphs.with_extra_inputs(gm, ["extra"])
            seen["placeholders"] = [n.name for n in extended.graph.nodes if n.op == "placeholder"]
            seen["original"] = len([n for n in gm.graph.nodes if n.op == "placeholder"])
            compiled = torch_aot.aot_autograd_backend(fw_compiler=lambda g, i: g.forward)(
                extended, [*example_inputs, torch.zeros(1)]
            )
            return lambda *args: compiled(*args, torch.zeros(1))

        torch.compile(lambda x: x * 2, backend=backend)(torch.randn(3))
        assert seen["placeholders"][-1] == "extra" and len(seen["placeholders"]) == seen["original"] + 1


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_an_extra_input_at_a_fixed_address_is_static_for_cuda_graphs():
    # AOTAutograd hands Inductor the static inputs (`fw_metadata.static_input_indices`, read by its CUDA graphs):
    # the parameters, and an extra input marked as a fixed address; the batch and an unmarked extra input not.
    with canary("aot/torch_graphs.py:with_extra_inputs(fixed_address)"):
        seen = {}

        def fw_compiler(gm, example_inputs):
            static = torch._guards.TracingContext.try_get().fw_metadata.static_input_indices
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            seen["static"] = {names[i] for i in static}
            seen["count"] = len(names)
            return gm.forward

        def backend(gm, example_inputs):
            extended = torch_graphs.with_extra_inputs(gm, ["state", "table"], fixed_address=[0])
            compiled = torch_aot.aot_autograd_backend(fw_compiler=fw_compiler)(
                extended, [*example_inputs, torch.zeros(3), torch.zeros(2)]
            )
            return lambda *args: compiled(*args, torch.zeros(3), torch.zeros(2))

        torch.compile(nn.Linear(3, 3), backend=backend)(torch.randn(2, 3))
        assert seen["count"] == 5 and len(seen["static"]) == 3, seen  # weight, bias, state
        assert "primals_4" in seen["static"] and "primals_5" not in seen["static"], seen  # state, table


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_compiled_functions_autograd_node_and_its_parameter_edges():
    with canary("aot/torch_graphs.py:compiled_backward_node/param_edges"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        out = torch.compile(model, backend="aot_eager")(torch.randn(3, 4))
        node = torch_graphs.compiled_backward_node(out)
        assert node is not None
        assert {id(p) for _, p in torch_graphs.param_edges(node)} == {id(p) for p in model.parameters()}
        assert torch_graphs.compiled_backward_node(torch.randn(2)) is None


# -- aot/torch_graphs.py: nested compile regions (invoke_subgraph) ----------------------------------


def _region_graph() -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of 3 blocks under one nested_compile_region (the field tests' model)."""
    from tests.multi_gpu.field_models import Regioned

    torch._dynamo.reset()
    captured: list = []

    def capture(gm, inputs):
        captured.append((gm, inputs))
        return gm.forward

    torch.compile(Regioned(), backend=capture)(torch.randn(4, 64))
    return captured[0]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_nested_region_calls_counts_the_invoke_subgraph_calls_of_a_dynamo_graph():
    gm, _ = _region_graph()
    assert torch_graphs.nested_region_calls(gm) >= 2
    plain = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert torch_graphs.nested_region_calls(plain) == 0


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (the region op's eager backward: see below).
def test_inline_nested_regions_calls_the_region_bodies_and_gives_the_same_gradients():
    """The eager fallback of a graph with regions: no invoke_subgraph left, the graph's outputs, a gradient for
    every parameter, and Dynamo's graph itself unchanged."""
    gm, inputs = _region_graph()
    before = torch_graphs.nested_region_calls(gm)
    plain = torch_graphs.inline_nested_regions(gm)
    assert torch_graphs.nested_region_calls(plain) == 0 and torch_graphs.nested_region_calls(gm) == before
    real = [
        torch.randn(t.shape) if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) else t for t in inputs
    ]
    with torch.no_grad():
        expected = gm(*real)  # the op's forward runs eagerly; its backward does not (below)
    out = plain(*real)
    torch.testing.assert_close(out, expected)
    (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
    params = [p for p in inputs if isinstance(p, nn.Parameter)]
    grads = [p.grad.clone() for p in params if p.grad is not None]
    assert len(grads) == len(params) > 0 and all(g.abs().sum() > 0 for g in grads)
    with canary("aot/torch_graphs.py:inline_nested_regions (invoke_subgraph's eager backward)"):
        # Why it exists: on torch 2.11 and 2.13 Dynamo's graph as it is cannot run a backward eagerly (the
        # region op's autograd rule wants a fake mode). 2.14 runs the body under plain autograd when it is
        # given real tensors; inlining is then not needed, and both must give the same gradients.
        for p in params:
            p.grad = None
        try:
            out = gm(*real)
            (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
        except AssertionError as err:
            assert "fake_mode" in str(err), err
        else:
            for p, g in zip(params, grads):
                torch.testing.assert_close(p.grad, g)


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11 partitions the body twice).
def test_region_bodies_reach_the_partition_step_without_input_descriptors():
    """AOTAutograd partitions each nested region's body with the graph's own partition step, first: the
    in-graph pass tells the bodies from the graph by its input descriptors. torch 2.13 and 2.14 partition the
    one body once; 2.11 partitions it twice (block 0's input needs no gradient, the others' do), which the
    pass handles alike: every body before the graph, without descriptors."""
    from functorch.compile import min_cut_rematerialization_partition

    from aot import nop_compiler
    from tests.multi_gpu.field_models import Regioned

    with canary("aot/torch_graphs.py:has_input_descriptors (invoke_subgraph bodies partitioned alone)"):
        seen: list[bool] = []

        def partition(joint, joint_inputs, **kwargs):
            seen.append(torch_graphs.has_input_descriptors(joint.graph))
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        torch._dynamo.reset()
        backend = torch_aot.aot_autograd_backend(
            fw_compiler=nop_compiler, bw_compiler=nop_compiler, partition_fn=partition
        )
        torch.compile(Regioned(), backend=backend)(torch.randn(4, 64)).sum().backward()
        assert len(seen) >= 2 and seen[-1] and not any(seen[:-1]), seen
