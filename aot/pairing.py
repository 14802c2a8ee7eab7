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

A graph loaded from AOTAutograd's cache is never handed to the compilers: such a pair has no graphs,
`cache="hit"`, and the sizes its caller kept when it was compiled (`sizes`/`restore`).

Debugging: `GraphPair.describe()` prints both graphs' sizes; `pair.forward.print_readable()` shows code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.fx as fx

from aot.torch_graphs import saved_count

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
    cache: str | None = None
    """AOTAutograd's cache: "hit" (the graphs were never handed to us: sizes come from `restore`),
    "miss", "bypass", or None (no cache consulted)."""
    forward_ops: int | None = None
    """Operations of the forward graph (None: not known, a cache hit without recorded sizes)."""
    backward_ops: int | None = None
    """Operations of the backward graph (None: no backward, or not known)."""

    def record(self, graph: fx.GraphModule, *, backward: bool) -> None:
        """Note a graph AOTAutograd produced for this pair."""
        if backward:
            self.backward = graph
            self.num_saved = _count_saved(graph)
            self.backward_ops = _ops(graph)
        else:
            self.forward = graph
            self.forward_ops = _ops(graph)

    def sizes(self) -> dict:
        """What `restore` needs to describe this pair without its graphs (kept next to a cache entry)."""
        return {"forward_ops": self.forward_ops, "backward_ops": self.backward_ops, "num_saved": self.num_saved}

    def restore(self, sizes: dict) -> None:
        self.forward_ops = sizes["forward_ops"]
        self.backward_ops = sizes["backward_ops"]
        self.num_saved = int(sizes["num_saved"])

    def describe(self) -> str:
        fw = "?" if self.forward_ops is None else str(self.forward_ops)
        bw = "-" if self.backward_ops is None else f"{self.backward_ops} ops"
        cached = f" (aot cache {self.cache})" if self.cache else ""
        return f"{self.name}: forward {fw} ops, backward {bw}, saved {self.num_saved}{cached}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "forward_ops": self.forward_ops,
            "backward_ops": self.backward_ops,
            "num_saved": self.num_saved,
            "cache": self.cache,
        }


def _ops(graph: fx.GraphModule) -> int:
    return sum(1 for n in graph.graph.nodes if n.op == "call_function")


def _count_saved(backward: fx.GraphModule) -> int:
    return saved_count(backward.graph)


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

    from aot.torch_aot import aot_autograd_backend

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


def nop_forward_compiler(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """`nop_compiler` for a forward whose backward is a `nop_compiler` too: its backward may then run
    with `retain_graph=True`, as under `torch.compile(backend="aot_eager")` (nothing reuses the saved
    tensors' memory; aot/torch_aot.py:declare_nothing_donated)."""
    from aot.torch_aot import declare_nothing_donated

    declare_nothing_donated()
    return nop_compiler(gm, example_inputs)
