"""The one contract between the in-graph reducer and work that runs where a bucket's all-reduce lands.

The reducer all-reduces each bucket inside the compiled backward and knows nothing of optimizers. A caller
that wants to do more at that spot (compile_core/in_backward/: the optimizer update per bucket) hands the
reducer a `BackwardHook` and reads one `StepOutcome` back:

    reducer.begin_step(hook)          # before the forward of a synchronising micro-batch (None: no hook)
    ... forward, backward ...
    outcome = reducer.step_outcome()  # after its backward

The hook stays in effect for the synchronising forwards that follow, until the next `begin_step`. While
one is set, the reducer compiles its hooked variants (`ddp/in_graph/variants.py`), and for each graph it
compiles there:

  * compile time, per graph: `BackwardHook.for_graph(GraphToCompile)` may add graph inputs (through
    `GraphInputs.add`) and returns a `HookedGraph`: the `AfterReduce` the graph pass calls, and which
    parameters' gradients it uses up inside the graph (they are not returned);
  * graph pass, per graph: once every bucket's all-reduce is issued, `AfterReduce.place(ReducedBackward)`
    places each bucket's wait and what runs after it. Without a hook the pass places the waits itself,
    just before the backward's output.

Nothing here imports anything above `ddp`: the arrows go down.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.fx as fx

from aot.torch_aot import static_example, traced_fake_mode
from ddp.bucketing.grad_buckets import GradBucketPlan

# -- compile time ------------------------------------------------------------------------------------


class GraphInputs:
    """The example inputs of a graph being compiled, and the inputs added to it: each added input has an
    example (for the compile) and a producer called at every run of the graph, in the order it takes them.
    A producer takes no argument, or the run's own inputs where it said so (`add(..., of_run=True)`)."""

    def __init__(self, examples: Sequence[Any]) -> None:
        self.examples: list[Any] = list(examples)
        self.fixed_address: list[bool] = []
        """Per added input, in order: whether its producer hands over the same tensor at every run."""
        self._producers: list[tuple[Callable[..., Any], str]] = []  # (producer, "one" | "many" | "of_run")
        self._fake_mode = traced_fake_mode(self.examples)

    def add(
        self,
        example: torch.Tensor,
        make: Callable[..., torch.Tensor],
        *,
        fixed_address: bool = False,
        of_run: bool = False,
    ) -> int:
        """Append one input (`example` to compile with, `make` for every run); returns its index. The
        example is compiled with static shapes (`aot.torch_aot.static_example`: a graph may index it).
        `of_run`: `make` is called with the run's own inputs (a graph Dynamo runs for the parameters of
        several modules takes what belongs to this run's).

        `fixed_address`: `make` returns the same long-lived tensor at every run, which the graph may write in
        place (optimizer state). CUDA graphs then read and write it where it lives, as they do a parameter;
        an ordinary input is copied into the captured graph's own buffer at every replay, and an in-place
        write to that copy would never reach the tensor."""
        self._producers.append((make, "of_run" if of_run else "one"))
        return self._append(example, fixed_address)

    def add_many(
        self,
        examples: Sequence[torch.Tensor],
        make: Callable[[], Sequence[torch.Tensor]],
        *,
        fixed_address: bool = False,
    ) -> list[int]:
        """Append several inputs made by one call of `make` at every run (a list, in `examples`' order), as
        `add` does one: one Python call per run for all of them, not one each (hundreds of optimizer state
        tensors, each a call before every forward)."""
        self._producers.append((make, "many"))
        return [self._append(example, fixed_address) for example in examples]

    def _append(self, example: torch.Tensor, fixed_address: bool) -> int:
        self.examples.append(static_example(self._fake_mode, example))
        self.fixed_address.append(fixed_address)
        return len(self.examples) - 1

    @property
    def added(self) -> int:
        """How many inputs were added."""
        return len(self.fixed_address)

    def produce(self, run_inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The added inputs for one run whose own inputs are `run_inputs`, in order."""
        out: list[torch.Tensor] = []
        for make, kind in self._producers:
            if kind == "many":
                out.extend(make())
            elif kind == "of_run":
                out.append(make(run_inputs))
            else:
                out.append(make())
        return out


@dataclasses.dataclass(frozen=True)
class GraphToCompile:
    """One graph the reducer compiles in a hooked variant, as the hook sees it."""

    name: str
    gm: fx.GraphModule
    """The captured graph (Dynamo's), before AOTAutograd."""
    inputs: GraphInputs
    """Its inputs; the hook may add its own."""
    plan: GradBucketPlan
    """The buckets its backward all-reduces (by graph input index)."""
    names: Mapping[int, str]
    """id(parameter) -> the user's parameter name."""
    elsewhere: frozenset[int] = frozenset()
    """Graph input indices of planned parameters whose gradient another graph's backward or eager code adds to
    (a layer called on both sides of a graph break, as tied embeddings are): a graph run earlier in this
    forward takes them, or the eager step took them in more ops than this graph holds (ddp/in_graph/probe.py,
    Note [Counting a parameter's uses]). The hook must not use up their gradient."""


class NodeBuilder(Protocol):
    """Adds call_function nodes to the backward graph, each with its fake value (what Inductor lowers)."""

    graph: fx.Graph

    def call(self, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> fx.Node:
        """A node at the graph's current insertion point."""
        ...

    def after(
        self, cursor: fx.Node, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
    ) -> fx.Node:
        """A node right after `cursor`."""
        ...


@dataclasses.dataclass(frozen=True)
class IssuedBucket:
    """A bucket whose all-reduce the backward has issued, not yet waited for."""

    members: tuple[tuple[int, fx.Node], ...]
    """(output position, gradient node) per parameter of the bucket with a gradient in this graph."""
    input_indices: tuple[int, ...]
    """The graph input index of each member's parameter, in the same order."""
    dtype: torch.dtype
    """The gradients' dtype (the wire may be narrower)."""
    reduced: fx.Node
    """The all_reduce node."""


@dataclasses.dataclass(frozen=True)
class Landed:
    """A bucket waited for and split back into its gradients (`ReducedBackward.wait_and_split`)."""

    wait: fx.Node
    """Its wait_tensor node."""
    views: tuple[tuple[int, fx.Node], ...]
    """(output position, reduced gradient) per member, in the bucket's order."""


@dataclasses.dataclass(frozen=True)
class ReducedBackward:
    """What the graph pass hands `AfterReduce.place`: a backward whose buckets are issued, none waited for."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    buckets: tuple[IssuedBucket, ...]
    """In plan order (each bucket's `reduced` node says where it was issued)."""
    builder: NodeBuilder
    outputs: list[Any]
    """The backward's outputs by position: a member's position must receive its reduced gradient (`views`),
    or None when the hook used the gradient up inside the graph."""
    wait_and_split: Callable[[IssuedBucket], Landed]
    """Adds, at the builder's insertion point, the bucket's wait and its split into gradients."""
    saved_input: Callable[[int], fx.Node]
    """The backward's node for forward input `index`, saved for the backward when it is not yet. Saved
    without autograd's version check: a hook may write it in place, live."""


class AfterReduce(Protocol):
    """Places each bucket's wait, and what runs after it, in one backward graph."""

    def place(self, backward: ReducedBackward) -> None:
        """Wait for every bucket of `backward` (through `wait_and_split`) and fill its outputs."""
        ...

    def cache_key(self) -> str:
        """Everything that shapes what `place` adds (its code included): compiled graphs are reused from a
        cache only when it is the same."""
        ...


@dataclasses.dataclass(frozen=True)
class HookedGraph:
    """What a hook does in one graph (`BackwardHook.for_graph`)."""

    after_reduce: AfterReduce | None
    """Placed by the graph pass; None: this graph's backward only reduces (see `reason`)."""
    consumed: frozenset[int] = frozenset()
    """Graph input indices whose reduced gradient `after_reduce` uses up inside the graph: those gradients
    are not returned, so nothing outside the graph may add to them."""
    skipped: tuple[str, ...] | None = None
    """Planned parameters the hook leaves alone (their reduced gradient is returned); None: not looked at."""
    reason: str | None = None
    """Why `after_reduce` is None, for people."""


class BackwardHook(Protocol):
    """What the reducer is handed by `begin_step`."""

    generation: int
    """Bumped when what the hook places in a graph changes for graphs already compiled: the hooked variant's
    graphs compile again (ddp/in_graph/variants.py: `variant_for`). Each bump is a compile of the model."""

    def for_graph(self, graph: GraphToCompile) -> HookedGraph:
        """What this hook does in `graph` (called once per graph compiled in a hooked variant)."""
        ...


# -- run time -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """The reducer after a synchronising backward (`InGraphReducer.step_outcome`)."""

    used_up: frozenset[int]
    """The ids of the parameters whose gradient a hook used up in this step's backward (empty: none)."""
    hook_reason: str | None
    """Why the last graph compiled in a hooked variant does not use its hook (None: it does)."""
    stop_reason: str | None
    """Why no synchronising step may have the hook again (a hooked graph ran for other parameters than
    those it was compiled for: that run went uncompiled); None: nothing stops it."""
    skipped: tuple[str, ...]
    """Planned parameters the last hooked graph leaves alone (their gradient is returned)."""
    graphs: int
    """Compiled graphs the last synchronising forward ran."""
    reduced_after: tuple[str, ...]
    """Parameters reduced after the last synchronising backward, not inside a graph."""
    ignored: tuple[str, ...]
    """Parameters DDP ignores (never reduced)."""
    grads_kept: int
    """Parameters holding a `.grad` when the last synchronising backward ended."""
    in_graph: bool
    """Whether the compiled backward reduces (else DDP's reducer does, with the user's comm hook)."""
    not_in_graph_reason: str | None
    """Why it does not, for people."""

    @property
    def hook_ran(self) -> bool:
        """A graph whose hook used gradients up ran in this step's backward."""
        return bool(self.used_up)
