"""`InGraphReducer`: DDP semantics when the compiled backward all-reduces its own gradients.

Note [ddp="in_graph" at run time]
---------------------------------
Background: the user still hands us a DDP model, and its `no_sync()`, `forward_sync_buffers`,
`process_group`, bucket caps, ignored parameters, `find_unused_parameters`, `static_graph` and comm
hook keep their meaning; but DDP's reducer must not reduce what the compiled backward already
reduced. The user's eager DDP script is the specification: every gradient ends the backward as
the average over the ranks of that parameter's *total* gradient, whatever produced it.

Algorithm, per forward of the DDP model:
  * before DDP's forward, choose the variant of the compiled graph (ddp/in_graph/variants.py):
    "reduce" (grad mode on and DDP would sync), "reduce_acc" (the same, with gradients accumulated
    by earlier micro-batches under `no_sync()`), "local" (no collective at all), each with
    "_update" while a hook after each bucket's all-reduce is set (`begin_step`, ddp/in_graph/hooks.py:
    the optimizer update inside the backward). The compiled entry branches on it,
    so Dynamo keeps one cache entry per variant. DDP's `require_backward_grad_sync` is off for the
    duration of its forward, exactly what `no_sync()` does, so its reducer stays idle. A comm hook
    we cannot compile (ddp/in_graph/policy.py) leaves everything to DDP's reducer instead ("local" graphs).
  * accumulation under `no_sync()` ("reduce_acc"): the gradients accumulated by earlier micro-batches
    become extra inputs of the graph, whose backward reduces `accumulated + this micro-batch` in its
    buckets (Note [Accumulated gradients in ddp="in_graph"], ddp/in_graph/accumulated.py). Any other
    `.grad` held when the backward begins (gradients not zeroed after a synchronised step) is reduced
    after the backward.
  * after DDP's forward, its flags are restored as its own forward would leave them. Then the
    graphs this rank ran (their buckets, by parameter name) are compared with the last set all
    ranks agreed on; when they differ (the first step, a new graph, a rank that took another
    branch), the coming backward is probed for gradients from outside the graphs
    (ddp/in_graph/probe.py), and when that backward begins, before any of its collectives, the ranks
    agree again through the store. Not at the forward: a forward some ranks run alone (evaluation on
    rank 0) must not wait for the others. In steady state nothing is exchanged and nothing is probed.
  * a hook on the forward's outputs queues one end-of-backward callback: it reduces what the graphs
    did not reduce alone (ddp/in_graph/leftovers.py) and puts back accumulated gradients no graph
    consumed. After a step whose graphs the ranks agreed on anew, it also checks, through the store,
    that the gradients the graphs reduced are the same on every rank (`GraphsAgreement.check_reduced`):
    a compile that lost the inserted all-reduces stops the job there instead of training every rank alone.

Notes: a parameter used by several graphs, or by a graph and eager code, is reduced after the
backward (found by the probe; later graphs leave it out of their buckets). Ranks that would pair
mismatched collectives stop with `RankMismatchError` naming the rank; a rank that changed its graphs
alone waits in the store, so no collective can pair wrongly, and the other ranks' collectives end
with its error. Tied weights inside one graph are one input, reduced once.

Where Dynamo's frames do not read the variant (a graph break inside the loop over a model's blocks), what
Dynamo runs for a graph compiles it again for each variant it meets, and a graph Dynamo runs for several
layers reduces (or updates) the parameters of each run: Note [A graph per variant, where Dynamo does not
guard] (ddp/in_graph/dispatch.py).

Debugging: `report()["in_graph"]` (reducer, comm hook, wire dtype, parameters reduced outside the
graph, fallbacks); each graph's buckets name the backward op after which their all-reduce is issued.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from aot.torch_eager import tree_leaves
from ddp import torch_ddp, torch_ddp_reducer
from ddp.agreement import RankAgreement
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.in_graph.accumulated import AccumulatedGradients
from ddp.in_graph.after_backward import AfterBackward
from ddp.in_graph.compile_graph import Bucketing, CompileFn, GraphCompiler
from ddp.in_graph.dispatch import GraphLog, RunParams
from ddp.in_graph.hooked_runs import HookedRuns
from ddp.in_graph.hooks import BackwardHook, GraphInputs, GraphToCompile, HookedGraph, StepOutcome
from ddp.in_graph.join import REASON as JOIN_REASON
from ddp.in_graph.join import JoinWindow
from ddp.in_graph.leftovers import LeftoverReducer
from ddp.in_graph.policy import Reduction, reduction_for
from ddp.in_graph.probe import OutsideGradientProbe, graph_uses
from ddp.in_graph.variants import GraphsAgreement, variant_for

log = logging.getLogger(__name__)


class InGraphReducer:
    """Owns gradient reduction for one DDP model in `ddp="in_graph"` mode (see the Note above)."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        *,
        names: dict[int, str],
        bucket_cap_bytes: int,
        first_bucket_cap_bytes: int,
        agreement: RankAgreement,
        reduce_dtype: torch.dtype | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        """`cuda_graphs`: the graphs are compiled for CUDA graphs (`mode="reduce-overhead"`), whose replay copies
        ordinary graph inputs: accumulated gradients are not lent to them, and they are compiled only where Dynamo
        asks (Note [A graph per variant, where Dynamo does not guard], ddp/in_graph/dispatch.py)."""
        self.ddp = ddp
        self.names = names
        self.agreement = agreement
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.ignored = torch_ddp.ignored_names(ddp)
        self.reduce_dtype = reduce_dtype
        self.reduction: Reduction = reduction_for(ddp, reduce_dtype)
        self._hooks_seen = list(torch_ddp.comm_hooks(ddp))
        self.variant = "local"
        """One of `VARIANTS` (ddp/in_graph/variants.py), read by the compiled code: Dynamo guards on it."""
        self.params = list(torch_ddp.reducer_params(ddp)[0])
        self._by_id = {id(p): p for p in self.params}
        # A static graph's DDP finds the unused parameters itself (in its first backward) and leaves their `.grad`
        # as find_unused_parameters=True does.
        find_unused = bool(ddp.find_unused_parameters or getattr(ddp, "static_graph", False))
        self._leftovers = LeftoverReducer(
            group=self.group, world_size=self.world_size, find_unused=find_unused, names=names
        )
        self.after = AfterBackward(names)
        """Parameters reduced after the backward instead of inside a graph (outside producers, hooks)."""
        self._user_sync = True
        self._runs: list[tuple[tuple, frozenset[int], frozenset[int], Any]] = []  # this forward's graphs
        self._covered: list[frozenset[int]] = []  # param ids reduced in-graph, per graph run this step
        self._consumed: set[int] = set()  # param ids whose gradient a hook used up in this step's backward
        self._graphs_run = GraphsAgreement(agreement)  # the graphs every rank ran, as last agreed
        self._agreed_now = False  # the ranks exchanged on this step's graphs: check the reduction after it
        self._signature: tuple = ()  # the graphs this rank's last synchronising forward ran
        self._compiled_this_step = False  # a compile may keep other ranks busy: wait longer for them
        self._seen_variants: set[str] = set()
        self._new_variant = False
        self._had_grad: set[int] = set()  # covered params holding a .grad when the backward began
        self._eager_uses: dict[int, int] | None = None  # ops per parameter in an eager step (`after_eager_step`)
        self.eager_steps = 0
        """Synchronising steps the caller ran eagerly (`after_eager_step`): DDP's reducer reduced them."""
        self.accumulated = AccumulatedGradients(self.params, lend=not cuda_graphs)
        """Gradients accumulated under no_sync, on their way into the synchronising graph (accumulated.py)."""
        bucketing = Bucketing(
            names=names,
            ignored=self.ignored,
            ours=self._by_id,
            after=self.after,
            caps=(bucket_cap_bytes, first_bucket_cap_bytes),
            group_name=self.group.group_name,
            world_size=self.world_size,
        )
        self._compiler = GraphCompiler(self, bucketing, self.accumulated, cuda_graphs=cuda_graphs)
        self._probe: OutsideGradientProbe | None = None
        self._armed = False
        self.sync_steps = 0
        self.last_leftovers: list[str] = []
        self._hook: BackwardHook | None = None  # `begin_step`'s: used by the synchronising forwards after it
        self._hook_reason: str | None = None  # why the last graph compiled with the hook does not use it
        self._skipped: tuple[str, ...] = ()  # planned parameters the last hooked graph leaves alone
        self._hooked_runs = HookedRuns()  # when a graph compiled with the hook runs uncompiled
        self.released_bytes: int | None = None
        """Bytes of DDP's gradient buckets released at the first synchronising step (None: kept)."""
        self.graphs_last_step = 0
        """How many compiled graphs ran in the last synchronising step's forward."""
        self.grads_kept = 0
        """Parameters holding a `.grad` when the last synchronising backward ended."""
        self.join = JoinWindow(ddp)
        """Open from `ddp.join()` to the end of its post-hook: DDP's reducer reduces meanwhile (join.py)."""
        self._ddp_reduces = False  # this forward's reduction is DDP's (no comm hook of ours, or inside join())
        if not self.reduction.in_graph:
            log.warning("compile_core: ddp='in_graph' is not reducing in the graph: %s", self.reduction.reason)

    # -- the contract with a hook after the all-reduces (ddp/in_graph/hooks.py) ------------------------

    def begin_step(self, hook: BackwardHook | None) -> None:
        """Before the forward of a synchronising micro-batch: the hook its graphs run after each bucket's
        all-reduce (None: none), in effect until the next call."""
        self._hook = hook

    def step_outcome(self) -> StepOutcome:
        """The reducer after the last synchronising backward."""
        return StepOutcome(
            used_up=frozenset(self._consumed),
            hook_reason=self._hook_reason,
            stop_reason=self._hooked_runs.stop_reason,
            skipped=self._skipped,
            graphs=self.graphs_last_step,
            reduced_after=tuple(self.last_leftovers),
            ignored=tuple(sorted(self.ignored)),
            grads_kept=self.grads_kept,
            in_graph=self.reduction.in_graph and not self._ddp_reduces,
            not_in_graph_reason=self.reduction.reason or (JOIN_REASON if self._ddp_reduces else None),
        )

    def join_hook(self, hook: JoinHook) -> JoinHook:
        """`ddp.join()` is entered (every rank at once): DDP's reducer gets buckets again and reduces until the
        join window closes after `hook`'s post-hook (Note [ddp="in_graph" inside join()], ddp/in_graph/join.py)."""
        if getattr(self.ddp, "static_graph", False):
            raise RuntimeError(
                "ddp='in_graph' with DDP static_graph=True cannot run inside DistributedDataParallel.join() "
                "(uneven inputs): use ddp='split', or give every rank the same number of batches"
            )
        if self.released_bytes is not None:
            torch_ddp_reducer.restore_reducer_buckets(self.ddp)
            self.released_bytes = None  # released again at the first synchronising step after the window
        return self.join.enter(hook)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.reduction.to_dict(),
            **self.after.to_dict(),
            "leftovers_last_step": list(self.last_leftovers),
            "fallbacks": list(self._compiler.fallbacks),
            "graphs_run_for_other_parameters": {g: list(n) for g, n in self._compiler.run_for_others.items()},
            "find_unused_parameters": self._leftovers.find_unused,
            "not_updated_in_backward": list(self._skipped),
            "ddp_buckets_released_bytes": self.released_bytes,
            "joins": self.join.opened,
        }

    # -- around DDP's forward ------------------------------------------------------------------------

    def before_forward(self) -> None:
        """Pick the variant; keep DDP's reducer idle during its forward (what `no_sync()` does)."""
        self._abandon_backward()  # a previous forward whose backward never ran
        self._check_hooks()
        self._ddp_reduces = not self.reduction.in_graph or self.join.ddp_reduces()
        if self._ddp_reduces:
            self.variant = "local"  # DDP's reducer (with the user's hook, or a joined rank's shadow) does everything
            return
        if getattr(self.ddp, "static_graph", False):
            torch_ddp.keep_static_graph_reducer_idle(self.ddp)
        self._user_sync = self.ddp.require_backward_grad_sync
        sync = torch.is_grad_enabled() and self._user_sync
        if sync and self.released_bytes is None and not getattr(self.ddp, "static_graph", False):
            # From the first synchronising step on, comm hooks are fixed (`_check_hooks`) and every
            # reduction is ours: DDP's bucket buffers, a full copy of the gradients, go.
            self.released_bytes = torch_ddp_reducer.release_reducer_buckets(self.ddp)
        accumulated = self.accumulated.at_forward(sync=sync)
        hook = self._hook
        self.variant = variant_for(
            sync=sync, accumulated=accumulated, hooked=hook is not None, generation=hook.generation if hook else 0
        )
        self._new_variant = self.variant not in self._seen_variants
        self._seen_variants.add(self.variant)
        self.ddp.require_backward_grad_sync = False

    def after_forward(self, output: Any) -> None:
        """Restore DDP's flags as its own forward would leave them; agree if the graphs changed; arm the
        end-of-backward callback."""
        if self._ddp_reduces:
            return
        runs, self._runs = self._runs, []
        sync = self.variant != "local"
        self.ddp.require_backward_grad_sync = self._user_sync
        self.ddp.require_forward_param_sync = sync  # DDP broadcasts buffers at the next forward
        if not sync:
            return
        self.sync_steps += 1
        self.graphs_last_step = len(runs)
        self._covered = [covered for _, covered, _, _ in runs]
        self._consumed = set().union(*(consumed for _, _, consumed, _ in runs))
        self._signature = tuple(entry for entry, _, _, _ in runs)
        if self._graphs_run.changed(self._signature):
            # Probed on this rank's own judgement (the signature the ranks last agreed on is the same on
            # every rank); the ranks agree when the backward begins, not here (see `_queue_finish`).
            probed = {i for covered in self._covered for i in covered if i not in self.after}
            self._probe = OutsideGradientProbe([out for *_, out in runs], [self._by_id[i] for i in probed])
        self._armed = False
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._queue_finish)

    def _queue_finish(self, grad: torch.Tensor) -> None:
        if not self._armed:
            self._armed = True
            # The backward begins and no compiled graph's backward (none of its collectives) has run yet:
            # the ranks agree on the graphs here, where eager DDP synchronises too, and not after the
            # forward, which some ranks may run alone (evaluation on rank 0, with or without gradients).
            self._agreed_now = self._graphs_run.agree(self._signature, compiled_this_step=self._compiled_this_step)
            # The backward begins (no compiled graph has run yet): what the graphs were lent is settled;
            # any other gradient held here was not zeroed since the last synchronised step, autograd adds
            # this step's reduced share to it, and the sum is reduced after the backward.
            self.accumulated.at_backward_start()
            if not self.accumulated.move_out:
                self._had_grad = {i for covered in self._covered for i in covered if self._by_id[i].grad is not None}
            torch_ddp.queue_end_of_backward(self._finish_backward)

    def first_call_in_variant(self) -> bool:
        """Whether this forward is the first in its variant (its compiles are expected, not recompiles)."""
        return self._new_variant

    def after_eager_step(self, outside: set[int], uses: dict[int, int]) -> None:
        """After a synchronising step the caller ran eagerly (DDP's reducer reduced it): take up the comm
        hooks registered so far, the parameters that step found with gradients from outside the model's
        outputs (`probe.eager_outside_producers`), and how many ops took each parameter
        (`probe.gradient_uses`); every rank calls this at the same step."""
        self.eager_steps += 1
        self._check_hooks()
        self.after.learn_outside(outside, self.agreement, self.params)
        # The most uses any rank saw (a branch some rank's data skipped): every rank's graphs then leave the
        # same parameters to the normal step, and the ranks' parameters stay bit-identical.
        mine = {self.names[pid]: count for pid, count in uses.items() if pid in self._by_id and pid in self.names}
        most: dict[str, int] = {}
        for counts in self.agreement.exchange("eager uses", mine).values():
            for name, count in counts.items():
                most[name] = max(count, most.get(name, 0))
        self._eager_uses = {id(p): most[self.names[id(p)]] for p in self.params if self.names.get(id(p)) in most}
        self.grads_kept = sum(p.grad is not None for p in self.params)  # DDP's backward keeps them all

    def _check_hooks(self) -> None:
        hooks = list(torch_ddp.comm_hooks(self.ddp))
        if hooks == self._hooks_seen and self.sync_steps:
            return
        reduction = reduction_for(self.ddp, self.reduce_dtype)
        self._hooks_seen = hooks
        if reduction == self.reduction:
            return
        if self.sync_steps:
            raise ValueError(
                f"a comm hook ({reduction.hook}) was registered after the first synchronising step of a "
                "ddp='in_graph' model, whose compiled backward already reduces without it: register comm hooks "
                "right after wrapping the model in DDP, before the first step"
            )
        self.reduction = reduction
        if not reduction.in_graph:
            log.warning("compile_core: ddp='in_graph' is not reducing in the graph: %s", reduction.reason)

    # -- compiling (ddp/in_graph/compile_graph.py: CompileSite) ------------------------------------

    def compile(
        self, gm: fx.GraphModule, example_inputs: list, compile_piece: CompileFn, graph_log: GraphLog
    ) -> Callable[..., Any]:
        """What Dynamo runs for one graph it captured: the graph compiled for the variant of each step."""
        return self._compiler.compile(gm, example_inputs, compile_piece, graph_log)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        self._compiled_this_step = True
        with self.agreement.busy():  # a rank waiting for this one in `GraphsAgreement.agree` waits longer
            yield

    def hook_for(self, name: str, gm: fx.GraphModule, inputs: GraphInputs, plan: GradBucketPlan) -> HookedGraph:
        """What the step's hook does in this graph (it may add inputs); remembered for `step_outcome`."""
        if self._hook is None:  # a hooked variant is only chosen with a hook set
            return HookedGraph(None)
        elsewhere = frozenset(i for i in plan.input_indices() if self._shared(gm, i, inputs.examples[i]))
        graph = GraphToCompile(name=name, gm=gm, inputs=inputs, plan=plan, names=self.names, elsewhere=elsewhere)
        hooked_graph = self._hook.for_graph(graph)
        self._hook_reason = hooked_graph.reason
        if hooked_graph.skipped is not None:
            self._skipped = tuple(hooked_graph.skipped)
        return hooked_graph

    def _shared(self, gm: fx.GraphModule, index: int, param: torch.nn.Parameter) -> bool:
        """Whether another graph or eager code adds to the gradient of `param`, input `index` of `gm`: a graph
        that ran before this one in this forward (it compiles on its first run) takes it, or the eager step
        took it in more ops than `gm` holds (a graph after this one, Note [Counting a parameter's uses])."""
        if any(id(param) in covered for _, covered, _, _ in self._runs):
            return True
        if self._eager_uses is None:  # no eager step: update 1 ran compiled, as one graph (the controller's rule)
            return False
        most = self._eager_uses.get(id(param))
        return most is None or graph_uses(gm, index) < most  # not reached by the eager step: counted as shared

    # -- the contract with a compiled graph's runs (ddp/in_graph/dispatch.py: RunSite) -----------------

    def may_run_compiled(
        self, name: str, *, compiled_in: str, args: Sequence[Any], compiled_for: Sequence[tuple[int, torch.Tensor]]
    ) -> bool:
        return self._hooked_runs.may_run_compiled(
            name, compiled_in=compiled_in, variant=self.variant, args=args, compiled_for=compiled_for
        )

    def ran(self, params: RunParams, consumed: frozenset[int], out: Any) -> None:
        self._runs.append((params.entry, params.covered, consumed, out))

    # -- end of backward -----------------------------------------------------------------------------

    def _abandon_backward(self) -> None:
        self.accumulated.abandon()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._covered, self._consumed, self._runs, self._had_grad = [], set(), [], set()
        self._compiled_this_step = False

    def _finish_backward(self) -> None:
        """Reduce what the graphs did not reduce alone (see the Note)."""
        covered = frozenset().union(*self._covered)
        self._covered = []
        given_back = self.accumulated.at_backward_end()  # not reduced: no graph result reached their `.grad`
        if self._probe is not None:
            found = self._probe.close()
            self._probe = None
            self.after.learn_outside(found, self.agreement, self.params)
        # A gradient a hook used up inside the graph was the whole gradient only if nothing outside added to it.
        late = [self.names.get(i, "?") for i in self._consumed if self._by_id[i].grad is not None]
        if late:
            raise RuntimeError(
                f"parameters {late[:8]} were updated inside the backward with only their compiled graph's "
                "gradient, but code outside the graph added to their gradient in this step (first seen now, "
                "after the update was compiled). Their update missed that share. Use ddp='split', or "
                "optimizer_in_backward=False, for a model whose parameters are used outside the compiled graph"
            )
        had, self._had_grad = self._had_grad, set()
        leftovers = [p for p in self.params if id(p) not in covered or id(p) in self.after or id(p) in had]
        self.last_leftovers = self._leftovers.reduce(leftovers, self.reduction.wire_dtype)
        self.grads_kept = sum(p.grad is not None for p in self.params)
        if self._agreed_now:
            self._agreed_now = False
            self._graphs_run.check_reduced(
                [(self.names.get(id(p), "?"), p.grad) for p in self.params if id(p) in covered - given_back]
            )
