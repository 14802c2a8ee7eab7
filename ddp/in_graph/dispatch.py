"""What Dynamo runs for one graph of `ddp="in_graph"`: per variant of the step, the graph compiled for it.

Note [A graph per variant, where Dynamo does not guard]
-------------------------------------------------------
Background: a step's variant (ddp/in_graph/variants.py) decides what a graph's backward does with its
gradients: keep them local (`no_sync()`), all-reduce them, take the gradients accumulated under `no_sync()`,
update the parameters. Dynamo keeps one cache entry per variant because every frame it compiles inside the
model reads the variant in the module pre-hooks it inlines (`guard_variant_in`). Not every frame does:
when a graph break inside the loop over a model's blocks makes Dynamo skip that frame ("graph break in a
for/while loop"), the blocks run eagerly and Dynamo (torch 2.13) compiles the forward of every leaf module
they call (each `nn.Linear.forward`) as a frame of its own (2.14 too); torch 2.11 compiles none of them. Those frames
start below the module's `_call_impl`, whose pre-hooks ran outside them: they never read the variant, and
one compiled graph served every variant. With gradient accumulation the first forward is a `no_sync()` one,
so each such graph kept its local variant for good and every gradient was all-reduced after the backward,
none overlapped. And one such graph runs for every layer of its shape, each run with that layer's
parameters (Dynamo lifts them to inputs and does not guard on which module they belong to), where the
reducer had taken its backward to reduce the first layer's only: it reduced the others again after the
backward, and averaged a layer DDP ignores.

Algorithm: `VariantDispatch` is the callable Dynamo gets. It holds the graph compiled in the variant of
the step Dynamo compiled it in; in a step of another variant it compiles the same captured graph for
that variant (once; the compile sees this run's inputs as Dynamo would have handed them) and runs that.
Where the graph compiled at Dynamo's call is the one that variant would get, nothing changes: for a frame
that guards, Dynamo's entry only ever runs in its own variant. `GraphRun` is what a variant's entry runs:
a run for other parameters than the graph was compiled for reduces those (its part of the step's
signature, and what the reduction after the backward leaves alone, are theirs), or, where the graph
updates its parameters inside the backward, runs the graph compiled again for them, with their update;
a run for parameters DDP does not average as it averages the first's (ignored, with gradient hooks) runs
uncompiled, reduced after the backward as DDP would. A graph with symbolic shapes or values, or
one compiled for CUDA graphs, is compiled only where Dynamo asks (AOTAutograd and Inductor would specialise
it outside Dynamo's tracing context, where no guard checks what they assume): it runs what it was compiled
as, and its gradients are reduced after the backward where that variant does not fit
(ddp/in_graph/hooked_runs.py for a graph that updates).

Debugging: every graph compiled for another variant (or for another layer's update) is a `graphs` entry of
`report()` of its own, with its variant and the step it was compiled at; `report()["in_graph"]
["graphs_run_for_other_parameters"]` names, per graph, the other layers' parameters it reduced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.fx as fx

from aot.structure import compiles_statically
from aot.torch_graphs import inline_nested_regions
from ddp.bucketing.grad_buckets import GradBucketPlan


@dataclasses.dataclass(frozen=True)
class GraphLog:
    """Where the reducer names and records each graph it compiles (compile_core's report)."""

    new_name: Callable[[], str]
    """A name for the next graph (`graph_<n>`)."""
    record: Callable[[str, GradBucketPlan | None, list[str]], None]
    """(name, its buckets or None where it reduces nothing, the backward op after which each bucket's all-reduce
    is issued), in the variant the reducer holds. In the "local" variant, buckets and no ops: the buckets DDP's
    reducer is to reduce where it reduces for good (a comm hook the graph cannot run)."""


@dataclasses.dataclass(frozen=True)
class RunParams:
    """The parameters one run of a compiled graph reduces."""

    entry: tuple
    """Its part of the step's signature (ddp/in_graph/variants.py): bucket parameter names, wire dtype."""
    covered: frozenset[int]
    """ids of the parameters whose gradient its backward all-reduces."""


class EagerRun:
    """A captured graph run uncompiled (its gradients are then reduced after the backward); built at first use."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self._gm = gm
        self._fn: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self._fn is None:
            self._fn = inline_nested_regions(self._gm).forward
        return self._fn(*args)


class VariantHolder(Protocol):
    variant: str


class RunSite(Protocol):
    """What the runs of a compiled graph need from the reducer (ddp/in_graph/runtime.py)."""

    variant: str

    def may_run_compiled(
        self, name: str, *, compiled_in: str, args: Sequence[Any], compiled_for: Sequence[tuple[int, torch.Tensor]]
    ) -> bool:
        """Whether a graph compiled with the step's hook may run compiled (ddp/in_graph/hooked_runs.py)."""
        ...

    def ran(self, params: RunParams, consumed: frozenset[int], out: Any) -> None:
        """A compiled graph ran in this forward: it reduces `params`, its hook used up `consumed`."""
        ...


class GraphRun:
    """One graph compiled in one variant, as Dynamo runs it: for the parameters it was compiled for, or for
    another module's (see the Note). A run for other parameters reduces theirs, or, where the graph updates
    its own inside the backward, runs the graph compiled again with their update (`again`); a run whose
    parameters the graph must not all-reduce (DDP ignores them, they have gradient hooks) runs uncompiled."""

    def __init__(
        self,
        site: RunSite,
        *,
        name: str,
        variant: str,
        compiled: Callable[..., Any],
        produce: Callable[[Sequence[Any]], list] | None,
        plan: GradBucketPlan,
        inputs: Sequence[Any],
        consumed: frozenset[int],
        wire: str,
        eager: EagerRun,
        again: Callable[[list], Callable[..., Any]] | None,
        params_of_run: Callable[[Sequence[Any]], RunParams | None],
    ) -> None:
        """`params_of_run(args)`: what the graph reduces when it runs for `args`, another module's parameters
        than it was compiled for (None: it must not all-reduce them)."""
        self._site, self._name, self._variant = site, name, variant
        self._compiled, self._produce = compiled, produce
        self._planned = sorted(plan.input_indices())
        self._compiled_for = [(i, inputs[i]) for i in self._planned]
        self._own = RunParams(
            entry=(tuple(b.params for b in plan.buckets), wire),
            covered=frozenset(id(inputs[i]) for i in self._planned),
        )
        self._consumed = consumed
        self._eager, self._again, self._params_of_run = eager, again, params_of_run
        self._others: dict[tuple[int, ...], RunParams | None] = {}  # runs for other parameters, by their ids
        self._updating_others: dict[tuple[int, ...], Callable[..., Any]] = {}  # compiled to update theirs

    def __call__(self, *args: Any) -> Any:
        own = all(args[i] is p for i, p in self._compiled_for)
        if self._consumed:  # compiled with updates: for its own parameters only
            if not own and self._again is not None:
                key = tuple(id(args[i]) for i in self._planned)
                if key not in self._updating_others:
                    self._updating_others[key] = self._again(list(args))
                return self._updating_others[key](*args)
            same = own and self._site.variant == self._variant
            if not same and not self._site.may_run_compiled(
                self._name, compiled_in=self._variant, args=args, compiled_for=self._compiled_for
            ):
                return self._eager(*args)
            params = self._own
        elif own:
            params = self._own
        else:
            key = tuple(id(args[i]) for i in self._planned)
            if key not in self._others:
                self._others[key] = self._params_of_run(args)
            params = self._others[key]
            if params is None:
                return self._eager(*args)
        extra = self._produce(args) if self._produce is not None else ()
        out = self._compiled(*args, *extra)
        self._site.ran(params, self._consumed, out)
        return out


class VariantDispatch:
    """Per variant, the compiled graph one captured graph runs (see the Note)."""

    def __init__(
        self,
        holder: VariantHolder,
        variant: str,
        compiled: Callable[..., Any],
        compile_for_variant: Callable[[list], Callable[..., Any]] | None,
    ) -> None:
        """`compiled`: the graph compiled in `variant`; `compile_for_variant(args)` compiles it for the
        holder's current variant with this run's `args` as example inputs (None: never compiled again)."""
        self._holder = holder
        self._first = compiled
        self._by_variant: dict[str, Callable[..., Any]] = {variant: compiled}
        self._compile_for_variant = compile_for_variant

    def __call__(self, *args: Any) -> Any:
        fn = self._by_variant.get(self._holder.variant)
        if fn is None:
            variant = self._holder.variant
            fn = self._compile_for_variant(list(args)) if self._compile_for_variant is not None else self._first
            self._by_variant[variant] = fn
        return fn(*args)


def compiled_again_for_variants(gm: fx.GraphModule, example_inputs: list, *, cuda_graphs: bool) -> bool:
    """Whether `gm` may be compiled for another variant outside Dynamo's call (see the Note)."""
    return not cuda_graphs and compiles_statically(gm, example_inputs)
