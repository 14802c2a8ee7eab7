"""`GraphCompiler`: one graph Dynamo captured, compiled for `ddp="in_graph"` in the variant of the step.

The compile of a graph, in order (the step around it is the reducer's, ddp/in_graph/runtime.py):
  * in the "local" variant nothing is reduced: the graph is compiled as it is;
  * otherwise its buckets: the parameters of DDP's reducer it reads, in the order their gradients are
    ready (`Bucketing.plan`, ddp/in_graph/after_backward.py: `graph_buckets`);
  * with gradients accumulated under `no_sync()` ("reduce_acc"), one extra input per bucketed parameter,
    produced at each run from what the reducer holds for that run's parameter (accumulated.py);
  * with a hook after each bucket's all-reduce (the "_update" variants), what the hook adds (hooks.py);
  * the partitioner that places each bucket's all-reduce, and the hook, in the backward (partitioner.py);
  * a graph AOTAutograd did not take (it runs eagerly) is reported as a fallback and reduced after the
    backward; any other becomes a `GraphRun` (dispatch.py), which Dynamo reaches through a
    `VariantDispatch` that compiles the same graph again for another variant or another layer's run.
What the compile needs to know about the step comes through `CompileSite`; what decides the buckets is
fixed when the model is wrapped (`Bucketing`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, ContextManager, Iterable, Mapping, Protocol, Sequence

import torch
import torch.fx as fx

from aot.torch_aot import static_tracing
from aot.torch_dynamo import saved_tensors_hooks_disabled
from aot.torch_graphs import inline_nested_regions, with_extra_inputs
from ddp import torch_ddp
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.in_graph.accumulated import AccumulatedGradients
from ddp.in_graph.after_backward import AfterBackward, graph_buckets, ours_to_bucket
from ddp.in_graph.dispatch import (
    EagerRun,
    GraphLog,
    GraphRun,
    RunParams,
    RunSite,
    VariantDispatch,
    compiled_again_for_variants,
)
from ddp.in_graph.hooks import GraphInputs, HookedGraph
from ddp.in_graph.partitioner import InGraphPartitioner
from ddp.in_graph.policy import Reduction
from ddp.in_graph.variants import accumulates, hooked

log = logging.getLogger(__name__)

CompileFn = Callable[..., "tuple[Callable[..., Any], bool]"]
"""(gm, example_inputs, name, partitioner=...) -> (compiled, whether AOTAutograd ran)."""


@dataclasses.dataclass(frozen=True)
class Bucketing:
    """Which parameters a graph may all-reduce, and over what: one per DDP model."""

    names: Mapping[int, str]
    """The user's parameter names, by id."""
    ignored: Iterable[str]
    """Parameters DDP ignores."""
    ours: Mapping[int, torch.nn.Parameter]
    """The parameters of DDP's reducer, by id."""
    after: AfterBackward
    """Parameters left to the reduction after the backward (outside producers, gradient hooks)."""
    caps: tuple[int, int]
    """(bucket cap, first bucket cap) in bytes."""
    group_name: str
    world_size: int

    def plan(self, gm: fx.GraphModule, example_inputs: list) -> GradBucketPlan:
        return graph_buckets(
            gm,
            example_inputs,
            names=self.names,
            ignored=self.ignored,
            ours=self.ours,
            after=self.after,
            caps=self.caps,
        )

    def reduces_in_graph(self, param: Any) -> bool:
        """Whether a graph may all-reduce the gradient of `param` as DDP would (not ignored, no gradient hooks)."""
        mine = ours_to_bucket(param, names=self.names, ignored=self.ignored, ours=self.ours, after=self.after)
        return mine and not torch_ddp.has_gradient_hooks(param)


class CompileSite(RunSite, Protocol):
    """What a graph's compile needs from the reducer (ddp/in_graph/runtime.py), besides what its runs need."""

    reduction: Reduction

    def compiling(self) -> ContextManager[None]:
        """Held around each compile: other ranks waiting for this one wait longer."""
        ...

    def hook_for(self, name: str, gm: fx.GraphModule, inputs: GraphInputs, plan: GradBucketPlan) -> HookedGraph:
        """What the step's hook after each bucket's all-reduce does in this graph (it may add inputs)."""
        ...


class GraphCompiler:
    """Compiles the graphs Dynamo captures in one DDP model (see the module doc)."""

    def __init__(
        self,
        site: CompileSite,
        bucketing: Bucketing,
        accumulated: AccumulatedGradients,
        *,
        cuda_graphs: bool,
    ) -> None:
        self._site = site
        self.bucketing = bucketing
        self._accumulated = accumulated
        self._cuda_graphs = cuda_graphs
        self.fallbacks: list[dict[str, str]] = []
        """Graphs whose collectives could not be placed in the backward: {"graph", "reason"}."""
        self.run_for_others: dict[str, list[str]] = {}
        """Per graph Dynamo runs for other modules' parameters too (dispatch.py): those parameters' names."""

    def compile(
        self, gm: fx.GraphModule, example_inputs: list, compile_piece: CompileFn, graph_log: GraphLog
    ) -> Callable[..., Any]:
        """Compile one graph Dynamo captured, in the current variant; returns what Dynamo runs: the graph
        compiled for the variant of each step it runs in (ddp/in_graph/dispatch.py)."""
        variant = self._site.variant
        if not compiled_again_for_variants(gm, example_inputs, cuda_graphs=self._cuda_graphs):
            compiled = self._compile(gm, list(example_inputs), compile_piece, graph_log, again=None)
            return VariantDispatch(self._site, variant, compiled, None)

        def again(args: list) -> Callable[..., Any]:
            # For the variant of this step, or for the parameters of this run (dispatch.py: GraphRun), on its
            # inputs; inside the user's forward, whose saved-tensor hooks (save_on_cpu) the trace must not call,
            # as Dynamo keeps them from its backend.
            with static_tracing() as fakeify, saved_tensors_hooks_disabled():
                return self._compile(gm, args, compile_piece, graph_log, again=again, fakeify=fakeify)

        compiled = self._compile(gm, list(example_inputs), compile_piece, graph_log, again=again)
        return VariantDispatch(self._site, variant, compiled, again)

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: list,
        compile_piece: CompileFn,
        graph_log: GraphLog,
        *,
        again: Callable[[list], Callable[..., Any]] | None,
        fakeify: Callable[[list], list] = list,
    ) -> Callable[..., Any]:
        """`example_inputs`: Dynamo's, or a run's (`fakeify` turns them into what the compile is handed);
        `again(args)`: the same graph compiled for a run's inputs (None: it cannot be, see dispatch.py)."""
        site = self._site
        name = graph_log.new_name()
        after_ops: list[str] = []
        with site.compiling():
            variant = site.variant
            if variant == "local":
                compiled, _ = compile_piece(gm, fakeify(example_inputs), name)
                # Where DDP's reducer reduces for good (a comm hook we cannot compile), the buckets it should
                # reduce: the ones eager DDP rebuilds from the order its gradients become ready (ddp/alignment.py).
                by_ddp = not site.reduction.in_graph and torch.is_grad_enabled()
                graph_log.record(name, self.bucketing.plan(gm, example_inputs) if by_ddp else None, after_ops)
                return compiled
            plan = self.bucketing.plan(gm, example_inputs)
            original = gm
            graph_inputs = GraphInputs(example_inputs)
            inputs = graph_inputs.examples
            accumulated: dict[int, int] = {}
            if accumulates(variant):
                for i in sorted(plan.input_indices()):
                    accumulated[i] = graph_inputs.add(
                        torch.zeros_like(inputs[i]), lambda run, i=i: self._accumulated.take(run[i]), of_run=True
                    )
            hook = site.hook_for(name, gm, graph_inputs, plan) if hooked(variant) else HookedGraph(None)
            if graph_inputs.added:
                names = [f"ddp_compile_input_{k}" for k in range(graph_inputs.added)]
                pinned = [k for k, fixed in enumerate(graph_inputs.fixed_address) if fixed]
                gm = with_extra_inputs(gm, names, fixed_address=pinned)
            partitioner = InGraphPartitioner(
                plan,
                group_name=self.bucketing.group_name,
                world_size=self.bucketing.world_size,
                wire_dtype=site.reduction.wire_dtype,
                accumulated_input_of=accumulated,
                after_reduce=hook.after_reduce,
                on_partitioned=after_ops.extend,
            )
            compiled, used_aot = compile_piece(gm, fakeify(inputs), name, partitioner=partitioner)
            if not used_aot:
                # No AOT backward to put collectives in (the graph runs eagerly): its gradients are
                # reduced after the backward. Say so: the user asked for reduction inside the backward.
                reason = "the graph fell back to eager (no compiled backward to hold its all-reduces)"
                self.fallbacks.append({"graph": name, "reason": reason})
                log.warning(
                    "compile_core: ddp='in_graph': %s: %s; its gradients are all-reduced after the backward",
                    name,
                    reason,
                )
                graph_log.record(name, None, after_ops)
                return inline_nested_regions(original).forward
            graph_log.record(name, plan, after_ops)
            wire = str(site.reduction.wire_dtype)
            return GraphRun(
                site,
                name=name,
                variant=variant,
                compiled=compiled,
                produce=graph_inputs.produce if graph_inputs.added else None,
                plan=plan,
                inputs=inputs,
                consumed=frozenset(id(inputs[i]) for i in hook.consumed),
                wire=wire,
                eager=EagerRun(original),
                again=again,
                params_of_run=lambda args: self._params_of_run(name, plan, args, wire),
            )

    def _params_of_run(self, name: str, plan: GradBucketPlan, args: Sequence[Any], wire: str) -> RunParams | None:
        """The parameters graph `name` reduces when Dynamo runs it with `args` (another module's parameters than
        those it was compiled for); None when some of them are not the reducer's to reduce in a graph (DDP
        ignores them, they have gradient hooks, they are not DDP's): the graph must not all-reduce them."""
        params = [args[i] for i in sorted(plan.input_indices())]
        if not all(self.bucketing.reduces_in_graph(p) for p in params):
            return None
        names = self.bucketing.names
        entry = tuple(tuple(names[id(args[i])] for i in b.input_indices) for b in plan.buckets)
        self.run_for_others.setdefault(name, []).extend(n for bucket in entry for n in bucket)
        return RunParams(entry=(entry, wire), covered=frozenset(id(p) for p in params))
