"""One object per `ddp=` mode: what Dynamo's backend does with each graph, what runs around each call,
what the mode installs on the DDP object and what it adds to the report.

`CompiledModel` picks one with `make_mode` when it is built and never looks at the mode string again.
Every mode has the same small contract (`CompileMode`):

* `backend(gm, example_inputs)` -- the Dynamo backend: compile one captured graph;
* `around_call()` -- the context the compiled call runs in (whose DDPOptimizer may split);
* `install(model, inner, events)` -- hooks on the DDP object and its module, once;
* `before_forward()` -- between iterations, before DDP's own pre-forward;
* `report_fields()` -- extra keyword fields of `CompileReport` (e.g. `in_graph=`).

| `ddp=` | class | graphs | who all-reduces |
|---|---|---|---|
| "split" | `SplitMode` | cut at bucket boundaries | DDP's reducer, rebuilt to our buckets |
| "none" / not DDP | `WholeMode` | whole | DDP's reducer as DDP built it (or nobody) |
| "torch" | `TorchMode` | cut by PyTorch's DDPOptimizer | DDP's reducer |
| "in_graph" | `InGraphMode` | whole | the compiled backward (a comm hook it cannot run: DDP's reducer, our buckets) |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager

import torch
import torch.fx as fx
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from aot.torch_dynamo import pytorch_ddp_optimizer
from compile_core.config import CompileConfig
from compile_core.events import CompileEvents
from compile_core.in_place import detached_hook
from compile_core.pieces import PieceCompiler
from compile_core.report import CompileLog, GraphEntry
from ddp import torch_ddp
from ddp.agreement import RankAgreement
from ddp.alignment import PlannedGraph, ReducerAlignment
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.in_graph import GraphLog, InGraphReducer, guard_variant_in, in_graph_blocker
from ddp.splitter import DDPSplitter, SplitGraph, SplitterConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeContext:
    """What every mode is built from (shared with `CompiledModel`)."""

    model: torch.nn.Module
    """The model the user handed in (DDP object or plain module)."""
    ddp: DistributedDataParallel | None
    """The DDP object, None for a plain module."""
    inner: torch.nn.Module
    """The module whose forward is compiled (`ddp.module` for a DDP model)."""
    names: dict[int, str]
    """Parameter name by `id(parameter)`, in the inner module's naming."""
    config: CompileConfig
    """The user's compile options, validated."""
    log: CompileLog
    """Where graphs, pieces and fallbacks are recorded for `report()`."""
    pieces: PieceCompiler
    """Compiles one piece (forward + backward) with the user's backend."""
    agreement: RankAgreement | None
    """Store-backed agreement between this model's ranks (None without DDP)."""
    cap_bytes: int
    """Bucket cap in bytes (the user's, or DDP's)."""
    first_cap_bytes: int
    """First bucket's cap in bytes."""
    calls: Callable[[], int]
    """The number of forward calls so far (graphs are recorded with it)."""
    eager: Callable[[], bool] = lambda: False
    """True during a forward the caller runs uncompiled (`CompiledModel.eager()`): modes keep out of it."""


class CompileMode:
    """The contract every `ddp=` mode keeps; subclasses override what they need."""

    name: str = ""
    """The mode as the report names it ("split", "none", "torch", "in_graph")."""

    def __init__(self, ctx: ModeContext) -> None:
        self.ctx = ctx
        self.alignment = self._alignment()

    def _alignment(self) -> ReducerAlignment:
        ctx = self.ctx
        if ctx.ddp is None:
            return ReducerAlignment(ddp=None, names=ctx.names, status="not applicable", detail="no DDP")
        return ReducerAlignment(ddp=ctx.ddp, names=ctx.names, status="not applicable", detail=f"ddp={self.name!r}")

    def backend(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        raise NotImplementedError

    def around_call(self) -> ContextManager[Any]:
        # Our backend splits (or keeps whole): PyTorch's DDPOptimizer must not split again.
        return torch_ddp.hidden_from_dynamo()

    def install(self, model: torch.nn.Module, inner: torch.nn.Module, events: CompileEvents) -> None:
        """Hooks this mode needs on the model, once, after the compiled function is in place."""

    def join_hook(self, hook: JoinHook) -> JoinHook:
        """DDP's join hook for `ddp.join()` (called on every rank as the context is entered), or a wrapper."""
        return hook

    def before_forward(self) -> None:
        """Between iterations, before DDP's pre-forward."""

    def report_fields(self) -> dict[str, Any]:
        """Extra keyword fields for `CompileLog.snapshot` (the report)."""
        return {}

    @property
    def reducer(self) -> InGraphReducer | None:
        """The in-graph reducer (only `InGraphMode` has one)."""
        return None


class SplitMode(CompileMode):
    """`ddp="split"`: graphs cut at gradient-bucket boundaries, DDP's reducer rebuilt to the same buckets."""

    name = "split"
    split = True

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        config = SplitterConfig(
            bucket_cap_bytes=ctx.cap_bytes,
            first_bucket_cap_bytes=ctx.first_cap_bytes,
            param_names=ctx.names,
            ignore=torch_ddp.ignored_names(ctx.ddp) if ctx.ddp is not None else frozenset(),
            split=self.split,
            align_to_repeats=ctx.config.reuse_pieces,
        )
        self._splitter = DDPSplitter(config, ctx.pieces, self._on_graph, compile_pieces=ctx.pieces.compile_many)

    def _alignment(self) -> ReducerAlignment:
        ctx = self.ctx
        return ReducerAlignment(ddp=ctx.ddp, names=ctx.names, agreement=ctx.agreement)

    def backend(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        return self._splitter(gm, example_inputs)

    def _on_graph(self, graph: SplitGraph) -> None:
        plan = graph.plan
        caps = {
            "requested_bytes": plan.bucket_cap_bytes,
            "requested_first_bytes": plan.first_bucket_cap_bytes,
            "planned_bytes": [b.nbytes for b in plan.buckets],
            "aligned_to": list(plan.aligned_to),
        }
        entry = GraphEntry(
            name=graph.name,
            pieces=graph.pieces,
            buckets=[b.to_dict() for b in plan.buckets],
            seconds=0.0,
            step=self.ctx.calls(),
            bucket_caps=caps,
            restrided=graph.restrided if graph.pieces > 1 else None,
            grad=torch.is_grad_enabled(),
        )
        with self.ctx.log.lock:
            self.ctx.log.graphs.append(entry)
        self.alignment.record(self.ctx.calls(), PlannedGraph(graph.name, graph.params))

    def install(self, model: torch.nn.Module, inner: torch.nn.Module, events: CompileEvents) -> None:
        if self.alignment.status == "pending":
            model.register_forward_hook(detached_hook(self._after_forward))

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.ctx.eager():
            self.alignment.after_forward(output)

    def before_forward(self) -> None:
        self.alignment.before_forward(self.ctx.calls())


class WholeMode(SplitMode):
    """`ddp="none"`, or a plain module: whole graphs, DDP's reducer (if any) left as DDP built it."""

    name = "none"
    split = False

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        if ctx.ddp is None:
            ctx.log.notes.append("not a DDP model: graphs are compiled whole")

    _alignment = CompileMode._alignment


class TorchMode(CompileMode):
    """`ddp="torch"`: PyTorch's own DDPOptimizer splits; we compile each of its pieces."""

    name = "torch"

    def _alignment(self) -> ReducerAlignment:
        return ReducerAlignment(
            ddp=self.ctx.ddp, names=self.ctx.names, status="not ours", detail="ddp='torch' leaves bucketing to PyTorch"
        )

    def backend(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        log = self.ctx.log  # PyTorch's DDPOptimizer calls this once per piece it made
        name = f"torch_piece_{len(log.graphs)}"
        compiled, _ = self.ctx.pieces(gm, list(example_inputs), name, reuse=False)
        with log.lock:
            log.graphs.append(
                GraphEntry(
                    name=name, pieces=1, buckets=[], seconds=0.0, step=self.ctx.calls(), grad=torch.is_grad_enabled()
                )
            )
        return compiled

    def around_call(self) -> ContextManager[Any]:
        return pytorch_ddp_optimizer()


class InGraphMode(CompileMode):
    """`ddp="in_graph"`: one graph whose compiled backward all-reduces its buckets (ddp/in_graph/)."""

    name = "in_graph"

    def __init__(self, ctx: ModeContext) -> None:
        blocker = in_graph_blocker(ctx.ddp)
        if blocker is not None:
            raise ValueError(f"ddp='in_graph' cannot keep DDP's behaviour here: {blocker.text}; use ddp='split'")
        super().__init__(ctx)
        self._reducer = InGraphReducer(
            ctx.ddp,
            names=ctx.names,
            bucket_cap_bytes=ctx.cap_bytes,
            first_bucket_cap_bytes=ctx.first_cap_bytes,
            agreement=ctx.agreement,
            reduce_dtype=ctx.config.reduce_dtype,
            cuda_graphs=ctx.config.backend == "inductor" and ctx.config.inductor_settings().cuda_graphs,
        )
        self._alignment_settled = False  # `_follow_reduction` chose the alignment for good
        self._follow_reduction()

    def _alignment(self) -> ReducerAlignment:
        # The compiled backward all-reduces unless a comm hook says otherwise (`_follow_reduction`).
        return ReducerAlignment(ddp=self.ctx.ddp, names=self.ctx.names, status="not applicable", detail=_IN_GRAPH)

    def _follow_reduction(self) -> None:
        """Where DDP's reducer reduces for good (a comm hook the compiled backward cannot run, registered before the
        first synchronising step), it is to reduce the buckets the eager script's DDP reduces: after update 1 eager
        DDP rebuilds them from the order its gradients became ready, an order-dependent hook (PowerSGD draws its
        projections tensor by tensor, in bucket order) depends on it, and a rebuild after a compiled backward,
        which hands every gradient over at its end, would follow another. So its reducer gets our graphs' buckets,
        planned in the backward's order (ddp/alignment.py), unless DDP keeps or builds the eager layout itself:
        `find_unused_parameters=True` (DDP never rebuilds) or an update 1 run eagerly (the in-backward step)."""
        alignment, reducer = self.alignment, self._reducer
        if alignment.status == "pending" and reducer.eager_steps and not alignment.synced:
            self._alignment_not_applicable(_EAGER_REBUILT)  # a forward before the train step's eager update 1
            return
        if self._alignment_settled:
            return
        if reducer.reduction.in_graph:
            self._alignment_settled = reducer.sync_steps > 0  # comm hooks are fixed from then on
            return
        self._alignment_settled = True
        if self.ctx.ddp.find_unused_parameters:
            self._alignment_not_applicable(_NEVER_REBUILT)
        elif reducer.eager_steps:
            self._alignment_not_applicable(_EAGER_REBUILT)
        else:
            self.alignment = ReducerAlignment(ddp=self.ctx.ddp, names=self.ctx.names, agreement=self.ctx.agreement)

    def _alignment_not_applicable(self, detail: str) -> None:
        ctx = self.ctx
        self.alignment = ReducerAlignment(ddp=ctx.ddp, names=ctx.names, status="not applicable", detail=detail)

    @property
    def reducer(self) -> InGraphReducer:
        return self._reducer

    def backend(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        graphs = GraphLog(new_name=lambda: f"graph_{len(self.ctx.log.graphs)}", record=self._record)
        return self._reducer.compile(gm, example_inputs, self.ctx.pieces, graphs)

    def _record(self, name: str, plan: GradBucketPlan | None, after: list[str]) -> None:
        buckets = [] if plan is None else [b.to_dict() for b in plan.buckets]
        by_ddp = plan is not None and not self._reducer.reduction.in_graph
        if by_ddp:
            param_of = {self.ctx.names[id(p)]: p for p in self._reducer.params if id(p) in self.ctx.names}
            planned = [[param_of[n] for n in b.params if n in param_of] for b in plan.buckets]
            self.alignment.record(self.ctx.calls(), PlannedGraph(name, planned))
        unplaced = _BY_DDP if by_ddp else "(compiled artifact from cache)"
        for bucket, op in zip(buckets, after or [unplaced] * len(buckets)):
            bucket["after"] = op
        log = self.ctx.log
        with log.lock:
            log.graphs.append(
                GraphEntry(
                    name=name,
                    pieces=1,
                    buckets=buckets,
                    seconds=0.0,
                    step=self.ctx.calls(),
                    variant=self._reducer.variant,
                    grad=torch.is_grad_enabled(),
                )
            )

    def install(self, model: torch.nn.Module, inner: torch.nn.Module, events: CompileEvents) -> None:
        guard_variant_in(inner, self._reducer)
        first_in_grad_mode = events.expected_switch or (lambda: False)
        events.expected_switch = lambda: self._reducer.first_call_in_variant() or first_in_grad_mode()
        model.register_forward_hook(detached_hook(self._after_forward), always_call=True)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.ctx.eager():
            self._reducer.after_forward(output)
            self.alignment.after_forward(output)

    def before_forward(self) -> None:
        self._reducer.before_forward()  # takes up a comm hook registered since the last forward
        self._follow_reduction()
        self.alignment.before_forward(self.ctx.calls())

    def join_hook(self, hook: JoinHook) -> JoinHook:
        return self._reducer.join_hook(hook)

    def report_fields(self) -> dict[str, Any]:
        return {"in_graph": self._reducer.to_dict()}


_IN_GRAPH = "ddp='in_graph': the compiled backward all-reduces, DDP's reducer stays idle"
_BY_DDP = "the backward, by DDP's reducer (its comm hook)"
_NEVER_REBUILT = (
    "DDP's reducer runs the comm hook; with find_unused_parameters=True it keeps the buckets it was built with, "
    "as in the eager script"
)
_EAGER_REBUILT = (
    "DDP's reducer runs the comm hook and rebuilt its buckets after update 1, which ran eagerly, as the eager "
    "script's DDP does"
)

MODES: dict[str, type[CompileMode]] = {
    "split": SplitMode,
    "none": WholeMode,
    "torch": TorchMode,
    "in_graph": InGraphMode,
}
"""The class behind each `ddp=` value (compile_core.config.DDP_MODES)."""


def make_mode(ctx: ModeContext) -> CompileMode:
    """The mode object for `ctx.config.ddp` (None: "split" for a DDP model, whole graphs otherwise)."""
    asked = ctx.config.ddp
    if ctx.ddp is None:
        if asked in ("torch", "in_graph"):
            raise ValueError(
                f"ddp={asked!r} needs a DDP model (DistributedDataParallel; got {type(ctx.model).__name__}): "
                "wrap it in DDP, or use ddp='none' for a plain module"
            )
        return WholeMode(ctx)
    return MODES[asked or "split"](ctx)


__all__ = ["MODES", "CompileMode", "InGraphMode", "ModeContext", "SplitMode", "TorchMode", "WholeMode", "make_mode"]
