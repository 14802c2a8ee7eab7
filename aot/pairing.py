"""AOTAutograd pairing: every forward graph gets its backward graph, and we keep the pairs.

Note [Forward/backward pairs]
-----------------------------
Background: AOTAutograd traces a graph's forward and backward together (the joint graph), then a
partitioner cuts the joint graph into a forward graph and a backward graph; the forward saves what the
backward needs. The min-cut rematerialization partitioner saves the fewest bytes, recomputing cheap
ops in the backward instead. The pair then runs as one `autograd.Function`.

Algorithm: `aot_compile` runs AOTAutograd over a graph with the compilers it is given, wrapping them
so that each forward graph and the backward graph that follows it are recorded as a `GraphPair`
(forward graph, backward graph, number of saved tensors). Callers whose entry point runs AOTAutograd
itself (Inductor's `compile_fx` runs it with Inductor's decompositions and the same min-cut
partitioner) hand each graph it compiles to `GraphPair.record` instead.

Notes: nothing here knows about DDP or buckets. A backward graph may be compiled lazily, at the first
backward (AOTAutograd does so when the saved values include symbolic sizes): the pair is recorded at
forward time and its backward filled in then.

Debugging: `GraphPair.describe()` prints both graphs' sizes; `pair.forward.print_readable()` shows code.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.fx as fx

Compiler = Callable[[fx.GraphModule, list], Callable[..., Any]]


@dataclasses.dataclass
class GraphPair:
    """A forward graph and the backward graph AOTAutograd paired with it."""

    name: str
    """Which graph or piece this pair compiles (`graph_0.piece_2`)."""
    forward: fx.GraphModule | None = None
    """The forward graph (after decompositions and partitioning)."""
    backward: fx.GraphModule | None = None
    """Its backward graph; None for inference graphs or until compiled lazily."""
    num_saved: int = 0
    """Tensors (and sizes) the forward saves for the backward."""

    def record(self, graph: fx.GraphModule, *, backward: bool) -> None:
        """Note a graph AOTAutograd produced for this pair."""
        if backward:
            self.backward = graph
            self.num_saved = _count_saved(graph)
        else:
            self.forward = graph

    def describe(self) -> str:
        def ops(g: fx.GraphModule | None) -> int:
            return 0 if g is None else sum(1 for n in g.graph.nodes if n.op == "call_function")

        bw = "-" if self.backward is None else f"{ops(self.backward)} ops"
        return f"{self.name}: forward {ops(self.forward)} ops, backward {bw}, saved {self.num_saved}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "forward_ops": 0 if self.forward is None else sum(1 for n in self.forward.graph.nodes if n.op == "call_function"),
            "backward_ops": None if self.backward is None else sum(1 for n in self.backward.graph.nodes if n.op == "call_function"),
            "num_saved": self.num_saved,
        }


def _count_saved(backward: fx.GraphModule) -> int:
    # The backward's inputs are the saved values followed by the incoming gradients ("tangents").
    return sum(1 for n in backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))


def recording_compilers(pair: GraphPair, fw_compiler: Compiler, bw_compiler: Compiler) -> tuple[Compiler, Compiler]:
    """Wrap a forward and a backward compiler so that their graphs are recorded on `pair`."""

    def forward(gm: fx.GraphModule, example_inputs: list, *args: Any, **kwargs: Any) -> Any:
        pair.record(gm, backward=False)
        return fw_compiler(gm, example_inputs, *args, **kwargs)

    def backward(gm: fx.GraphModule, example_inputs: list, *args: Any, **kwargs: Any) -> Any:
        pair.record(gm, backward=True)
        return bw_compiler(gm, example_inputs, *args, **kwargs)

    return forward, backward


def aot_compile(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    fw_compiler: Compiler,
    bw_compiler: Compiler,
    pair: GraphPair,
    decompositions: dict | None = None,
    partition_fn: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """Run AOTAutograd on `gm`, recording the forward/backward pair on `pair`.

    The partitioner defaults to min-cut rematerialization.
    """
    from functorch.compile import min_cut_rematerialization_partition

    from aot.torch_dynamo import aot_autograd_backend

    forward, backward = recording_compilers(pair, fw_compiler, bw_compiler)
    backend = aot_autograd_backend(
        fw_compiler=forward,
        bw_compiler=backward,
        partition_fn=partition_fn or min_cut_rematerialization_partition,
        decompositions=decompositions or {},
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def nop_compiler(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """Run the graph as it is (the `aot_eager` compiler); boxed, as AOTAutograd expects."""
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)
