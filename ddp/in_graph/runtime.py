"""`InGraphReducer`: DDP semantics when the compiled backward all-reduces its own gradients.

Note [ddp="in_graph" at run time]
---------------------------------
Background: the user still hands us a DDP model, and its `no_sync()`, `forward_sync_buffers`,
`process_group`, bucket caps and ignored parameters keep their meaning; but DDP's reducer must not
reduce what the compiled backward already reduced.

Algorithm, per forward of the DDP model:
  * before DDP's forward, choose the variant of the compiled graph: "reduce" (grad mode on and DDP
    would sync), "reduce_acc" (the same, with gradients accumulated by earlier micro-batches under
    `no_sync()`), or "local" (no collective at all). The compiled entry branches on it, so Dynamo
    keeps one cache entry per variant: a run with accumulation compiles two variants once, then
    never recompiles. DDP's `require_backward_grad_sync` is set to False for the duration of its
    forward, exactly what `no_sync()` does, so its reducer stays idle.
  * "reduce_acc": the accumulated gradients are moved out of `.grad` into extra inputs of the
    graph; its backward reduces `accumulated + this micro-batch` (ddp/in_graph/graph_pass.py) and
    autograd stores the reduced sum into `.grad`.
  * after DDP's forward, its flags are restored and `require_forward_param_sync` is set the way
    DDP's own forward would have set it, so DDP broadcasts buffers at the next forward as usual.
    Gradient hooks on the forward's outputs queue one end-of-backward callback, which all-reduces,
    in one flat buffer per dtype, every gradient that no compiled graph reduced in this backward
    (parameters used by code Dynamo ran eagerly, or graphs that fell back to eager) and puts back
    accumulated gradients that no graph consumed.

Notes: every rank checks, through `ddp.agreement`, that all ranks planned the same buckets before a
graph with collectives first runs, and that all ranks reduce the same leftovers; a mismatch is an
error naming the rank, never a hang or a wrong sum. A parameter used by several graphs has its
gradient reduced by each of them (partial sums add up to the reduced total); tied weights inside
one graph are one input and reduced once. Comm hooks registered on the DDP object do not apply
(the report says so).

Debugging: `report()` lists each graph's in-graph buckets and, per bucket, the backward op after
which its all-reduce is issued; `InGraphReducer.last_leftovers` names what the callback reduced.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.nn.parallel import DistributedDataParallel

from aot.torch_dynamo import with_extra_inputs
from ddp import torch_ddp
from ddp.agreement import RankAgreement
from ddp.bucketing import ParamInfo
from ddp.bucketing.grad_buckets import GradBucketPlan, GradSlot, plan_grad_buckets, ready_order
from ddp.in_graph.graph_pass import UpdateSpec, UpdateTemplate
from ddp.in_graph.partitioner import InGraphPartitioner

log = logging.getLogger(__name__)

VARIANTS = ("local", "reduce", "reduce_acc", "reduce_update", "reduce_acc_update")
"""local: no collective (no_sync, no grad); reduce: all-reduce per bucket; _acc: plus the gradients
accumulated by earlier micro-batches; _update: plus the optimizer update per bucket."""


class UpdateProvider(Protocol):
    """What the backward needs from the optimizer to update parameters in place (compile_core.in_backward)."""

    clip_max_norm: float | None
    norm: torch.Tensor | None

    def template_for(self, param: torch.nn.Parameter) -> UpdateTemplate | None: ...

    def states(self, param: torch.nn.Parameter, template: UpdateTemplate) -> list[torch.Tensor]: ...

    def hypers(self, param: torch.nn.Parameter, template: UpdateTemplate) -> list[tuple[Any, torch.Tensor]]: ...

CompileFn = Callable[..., "tuple[Callable[..., Any], bool]"]
"""(gm, example_inputs, name, partitioner=...) -> (compiled, whether AOTAutograd ran)."""


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
    ) -> None:
        self.ddp = ddp
        self.names = names
        self.caps = (bucket_cap_bytes, first_bucket_cap_bytes)
        self.agreement = agreement
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.group_name = self.group.group_name
        self.ignored = torch_ddp.ignored_names(ddp)
        self.variant = "local"
        """Read by the compiled entry: Dynamo guards on it (one cache entry per variant)."""
        self.params = [p for p in torch_ddp.reducer_params(ddp)[0]]
        self._by_id = {id(p): p for p in self.params}
        self._user_sync = True
        self._stash: dict[int, torch.Tensor] = {}  # accumulated grads moved out of .grad
        self._covered: list[frozenset[int]] = []  # param ids reduced in-graph, per graph run this step
        self._armed = False
        self._agreed: set[tuple] = set()
        self.last_leftovers: list[str] = []
        self.updates: UpdateProvider | None = None
        """Set (by train_step) to update parameters inside the backward from the next sync step."""
        self.update_blocker: str | None = None
        """Why the last graph compiled for an update variant does not update (None: it does)."""
        self.updated_in_backward = False
        """True once a graph that updates parameters ran in the current step."""
        self.graphs_last_step = 0
        """How many compiled graphs ran in the last synchronising step's forward."""

    # -- around DDP's forward ------------------------------------------------------------------------

    def before_forward(self) -> None:
        """Pick the variant; keep DDP's reducer idle during its forward (what `no_sync()` does)."""
        self._put_back_stash()  # a previous sync step that never ran a backward
        self._covered.clear()
        self.updated_in_backward = False
        self._user_sync = self.ddp.require_backward_grad_sync
        sync = torch.is_grad_enabled() and self._user_sync
        if not sync:
            self.variant = "local"
        else:
            accumulated = any(p.grad is not None for p in self.params)
            if accumulated:
                self._stash = {id(p): p.grad for p in self.params if p.grad is not None}
                for p in self.params:
                    p.grad = None
            self.variant = "reduce" + ("_acc" if accumulated else "") + ("_update" if self.updates else "")
        self.ddp.require_backward_grad_sync = False

    def after_forward(self, output: Any) -> None:
        """Restore DDP's flags as its own forward would leave them; arm the end-of-backward callback."""
        sync = self.variant != "local"
        self.ddp.require_backward_grad_sync = self._user_sync
        self.ddp.require_forward_param_sync = sync  # DDP broadcasts buffers at the next forward
        if not sync:
            return
        if not self._covered and not self._agreed:
            # This rank ran its first synchronising forward without any compiled graph (Dynamo ran
            # it eagerly): ranks that did compile wait for our plan; tell them, instead of a timeout.
            self._agree_on(GradBucketPlan(buckets=(), bucket_cap_bytes=self.caps[0],
                                          first_bucket_cap_bytes=self.caps[1]), in_graph=False)
        self._armed = False
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._queue_finish)

    def _queue_finish(self, grad: torch.Tensor) -> None:
        if not self._armed:
            self._armed = True
            torch_ddp.queue_end_of_backward(self._finish_backward)

    # -- compiling -----------------------------------------------------------------------------------

    def plan(self, gm: fx.GraphModule, example_inputs: list) -> tuple[GradBucketPlan, list[GradSlot]]:
        """The in-graph buckets of one captured graph (pure; the same on every rank)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        slots: dict[str, GradSlot] = {}
        for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if not isinstance(value, torch.nn.Parameter) or not value.requires_grad:
                continue
            name = self.names.get(id(value))
            if name is None or name in self.ignored or id(value) not in self._by_id:
                continue
            info = ParamInfo(name=name, nbytes=value.numel() * value.element_size(), key=f"{value.dtype}/{value.device}")
            slots[node.name] = GradSlot(input_index=index, info=info)
        ordered = ready_order(gm.graph, slots)
        cap, first = self.caps
        return plan_grad_buckets(ordered, bucket_cap_bytes=cap, first_bucket_cap_bytes=first), ordered

    def compile(
        self, gm: fx.GraphModule, example_inputs: list, name: str, compile_piece: CompileFn,
        on_partitioned: Callable[[list[str]], None],
    ) -> tuple[Callable[..., Any], GradBucketPlan | None]:
        """Compile one graph in the current variant; returns (callable for Dynamo, plan or None)."""
        variant = self.variant
        if variant == "local":
            compiled, _ = compile_piece(gm, list(example_inputs), name)
            return compiled, None
        plan, _ = self.plan(gm, example_inputs)
        original = gm
        inputs = list(example_inputs)
        extras: list[Callable[[], torch.Tensor]] = []  # run-time producers of the extra inputs, in order
        accumulated: dict[int, int] = {}
        if "_acc" in variant:
            for i in sorted(plan.input_indices()):
                accumulated[i] = _add_input(inputs, extras, torch.zeros_like(inputs[i]),
                                            lambda p=inputs[i]: self._take_accumulated(p))
        spec = self._update_spec(gm, inputs, plan, extras) if variant.endswith("_update") else None
        if self.updates is not None and spec is None and variant.endswith("_update"):
            log.warning("ddp in_graph: %s: optimizer update stays after the backward: %s", name, self.update_blocker)
        if extras:
            gm = with_extra_inputs(gm, [f"ddp_compile_input_{k}" for k in range(len(extras))])
        partitioner = InGraphPartitioner(
            plan, group_name=self.group_name, world_size=self.world_size,
            accumulated_input_of=accumulated, updates=spec, on_partitioned=on_partitioned,
        )
        compiled, used_aot = compile_piece(gm, inputs, name, partitioner=partitioner)
        # Before this graph's first collective: every rank must have planned the same buckets, and
        # compiled them into its backward (a rank that fell back to eager would reduce otherwise).
        self._agree_on(plan, in_graph=used_aot)
        if not used_aot:  # fell back to eager everywhere: the end-of-backward callback reduces
            return original.forward, None
        covered = frozenset(id(inputs[i]) for i in plan.input_indices())
        updates = spec is not None

        def run(*args: Any) -> Any:
            self._covered.append(covered)
            if updates:
                self.updated_in_backward = True
            if extras:
                args = (*args, *(make() for make in extras))
            return compiled(*args)

        return run, plan

    def _update_spec(
        self, gm: fx.GraphModule, inputs: list, plan: GradBucketPlan, extras: list[Callable[[], torch.Tensor]]
    ) -> UpdateSpec | None:
        """Extra inputs and templates for updating every planned parameter, or None (with the reason)."""
        provider = self.updates
        from aot.torch_dynamo import graph_break_of

        if graph_break_of(gm) is not None:
            self.update_blocker = "the model does not compile into one graph (graph break)"
            return None
        params = [inputs[i] for i in sorted(plan.input_indices())]
        templates = {i: provider.template_for(inputs[i]) for i in sorted(plan.input_indices())}
        missing = [self.names.get(id(inputs[i]), "?") for i, t in templates.items() if t is None]
        if missing:
            self.update_blocker = f"parameters {missing[:5]} have no update (not in the optimizer, or no state yet)"
            return None
        hyper_inputs: dict[Any, int] = {}
        role_inputs: dict[int, tuple[int, ...]] = {}
        for i, param in zip(sorted(templates), params):
            template = templates[i]
            roles = [
                _add_input(inputs, extras, torch.zeros_like(t), lambda p=param, t=template, k=k: provider.states(p, t)[k])
                for k, t in enumerate(provider.states(param, template))
            ]
            for k, (key, tensor) in enumerate(provider.hypers(param, template)):
                if key not in hyper_inputs:
                    hyper_inputs[key] = _add_input(inputs, extras, tensor.detach().clone(),
                                                   lambda p=param, t=template, k=k: provider.hypers(p, t)[k][1])
                roles.append(hyper_inputs[key])
            role_inputs[i] = tuple(roles)
        norm_input = None
        if provider.clip_max_norm is not None and provider.norm is not None:
            norm_input = _add_input(inputs, extras, torch.zeros_like(provider.norm), lambda: provider.norm)
        self.update_blocker = None
        return UpdateSpec(templates=templates, role_inputs=role_inputs, clip_max_norm=provider.clip_max_norm,
                          norm_input=norm_input)

    def _agree_on(self, plan: GradBucketPlan, *, in_graph: bool) -> None:
        fingerprint = (in_graph, plan.fingerprint())
        if fingerprint in self._agreed:
            return  # e.g. a recompile for new input sizes, with the same buckets as before

        def describe(fp: tuple) -> str:
            where = "in the compiled backward" if fp[0] else "NOT in the backward (compile fell back to eager)"
            return f"{len(fp[1])} bucket(s) {where}: " + ", ".join(f"{n}B/{k}/{c} params" for n, k, c in fp[1])

        self.agreement.agree("in-graph buckets", fingerprint, describe=describe)
        self._agreed.add(fingerprint)

    def _take_accumulated(self, param: torch.nn.Parameter) -> torch.Tensor:
        acc = self._stash.pop(id(param), None)
        return torch.zeros_like(param) if acc is None else acc

    # -- end of backward -----------------------------------------------------------------------------

    def _put_back_stash(self) -> None:
        for pid, acc in self._stash.items():
            p = self._by_id[pid]
            p.grad = acc if p.grad is None else p.grad.add_(acc)
        self._stash = {}

    def _finish_backward(self) -> None:
        """All-reduce what no compiled graph reduced in this backward (see the Note)."""
        covered = frozenset().union(*self._covered)
        self.graphs_last_step = len(self._covered)
        self._covered.clear()
        self._put_back_stash()
        leftovers = [p for p in self.params if id(p) not in covered and p.grad is not None]
        self.last_leftovers = [self.names.get(id(p), "?") for p in leftovers]
        if not leftovers:
            return
        # A rank without leftovers never comes: the others time out naming it, instead of hanging.
        self.agreement.agree("leftover gradients", sorted(self.last_leftovers), timeout_s=self.agreement.timeouts.timeout_s)
        for key in dict.fromkeys((p.dtype, p.device) for p in leftovers):
            group = [p for p in leftovers if (p.dtype, p.device) == key]
            flat = torch.cat([p.grad.reshape(-1) for p in group]).div_(self.world_size)
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n


def _add_input(inputs: list, extras: list, example: torch.Tensor, make: Callable[[], torch.Tensor]) -> int:
    """Append one extra graph input (example for compiling, `make` for every call); return its index."""
    inputs.append(example)
    extras.append(make)
    return len(inputs) - 1
