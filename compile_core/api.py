"""`compile_core.compile`: compile a (DDP) model through bucket-aligned pieces (docs/design.md).

We compile the module DDP wraps, never DDP's own forward (Dynamo cannot trace its bookkeeping, and
skips torch.nn frames: `torch.compile(DDP(nn.Sequential(...)))` compiles nothing). The compiled
function is installed as the inner module's `_compiled_call_impl` (what `nn.Module.compile()` does), so
DDP's forward still runs eagerly around it, `state_dict()` keys do not change, and the entry frame is
ours, so Dynamo traces into `nn.Sequential` too. While our compiled function runs, DDP's "active
module" slot is cleared: otherwise Dynamo would wrap our backend in PyTorch's DDPOptimizer again.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel

from aot.torch_dynamo import (DynamoError, call_uncompiled, install_compiled_call, installed_compiled_call,
                              pytorch_ddp_optimizer, root_cause)
from compile_core.config import CompileConfig
from compile_core.events import CompileEvents
from compile_core.pieces import PieceCompiler
from compile_core.report import CompileLog, CompileReport, GraphEntry
from ddp import torch_ddp
from ddp.agreement import RankAgreement, RankAgreementError
from ddp.alignment import ReducerAlignment
from ddp.bucketing import MiB
from ddp.in_graph import InGraphReducer, in_graph_blocker
from ddp.splitter import DDPSplitter, SplitGraph, SplitterConfig
from launch.heartbeat import beat

log = logging.getLogger(__name__)

_models = itertools.count()
"""Numbers compiled models in creation order: every rank creates them in the same order, so the
number names the same model on every rank (the prefix of its rank-agreement keys)."""


def compile(
    model: torch.nn.Module,
    *,
    backend: str | Callable[..., Any] = "inductor",
    ddp: str | None = None,
    bucket_cap_mb: float | None = None,
    first_bucket_cap_mb: float | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    mode: str | None = None,
    options: dict | None = None,
    reuse_pieces: bool = True,
    reduce_dtype: torch.dtype | None = None,
) -> "CompiledModel":
    """Compile `model` (a DDP model or a plain module); see docs/design.md for the contract."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (or DistributedDataParallel), got {type(model).__name__}; "
            "wrap your function in an nn.Module or use torch.compile for plain functions"
        )
    if isinstance(model, CompiledModel):
        raise TypeError("model is already compiled by compile_core.compile; pass the original model")
    config = CompileConfig(
        backend=backend, ddp=ddp, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
        fullgraph=fullgraph, dynamic=dynamic, mode=mode, options=options, reuse_pieces=reuse_pieces,
        reduce_dtype=reduce_dtype,
    )
    return CompiledModel(model, config)


class CompiledModel:
    """Callable like the model; `report()` tells how it was compiled. Attributes delegate to the model."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig) -> None:
        self._model = model
        self._config = config
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        inner = model.module if self._ddp is not None else model
        if installed_compiled_call(inner) is not None:
            raise ValueError(
                f"{type(inner).__name__} is already compiled (module.compile() or compile_core.compile); "
                "compile each module once"
            )
        self._inner = inner
        self._mode = config.ddp or "split"
        if self._ddp is None and self._mode in ("torch", "in_graph"):
            raise ValueError(
                f"ddp={self._mode!r} needs a DDP model (DistributedDataParallel; got {type(model).__name__}): "
                "wrap it in DDP, or use ddp='none' for a plain module"
            )
        if self._mode == "in_graph":
            blocker = in_graph_blocker(self._ddp)
            if blocker is not None:
                raise ValueError(f"ddp='in_graph' cannot keep DDP's behaviour here: {blocker.text}; use ddp='split'")
        self._log = CompileLog()
        self._events = CompileEvents()
        self._calls = 0
        self._agreement = (
            RankAgreement(self._ddp.process_group, prefix=f"ddp_compile/model{next(_models)}")
            if self._ddp is not None else None
        )
        names = {id(p): n for n, p in inner.named_parameters()}
        split = self._ddp is not None and self._mode == "split"
        self._alignment = self._new_alignment(names, split=split)
        if self._ddp is None:
            self._log.notes.append("not a DDP model: graphs are compiled whole")

        cap, first = config.caps(int(self._ddp.bucket_bytes_cap) if self._ddp is not None else None)
        self._pieces = PieceCompiler(config, self._log)
        self._in_graph: InGraphReducer | None = None
        if self._mode == "torch":
            backend: Callable[..., Any] = self._torch_piece
        elif self._mode == "in_graph":
            self._in_graph = InGraphReducer(
                self._ddp, names=names, bucket_cap_bytes=cap, first_bucket_cap_bytes=first, agreement=self._agreement,
                reduce_dtype=config.reduce_dtype,
            )
            backend = self._in_graph_graph
            self._in_graph.guard_variant_in(inner)
            self._events.expected_switch = self._in_graph.first_call_in_variant
        else:
            splitter_config = SplitterConfig(
                bucket_cap_bytes=cap, first_bucket_cap_bytes=first, param_names=names,
                ignore=torch_ddp.ignored_names(self._ddp) if self._ddp is not None else frozenset(), split=split,
                align_to_repeats=config.reuse_pieces,
            )
            backend = DDPSplitter(splitter_config, self._pieces, self._on_graph, compile_pieces=self._pieces.compile_many)
        self._compiled = self._events.compile(
            _entry_for(inner), backend, fullgraph=config.fullgraph, dynamic=config.dynamic,
            on_compiled=self._graph_compiled,
        )
        install_compiled_call(inner, self._run_inner)
        # Run around DDP's own forward, however the model is called (through us or directly).
        model.register_forward_pre_hook(self._before_forward)
        if self._in_graph is not None:
            model.register_forward_hook(self._after_forward, always_call=True)
        log.info(
            "compile_core: %s compiled with backend=%s ddp=%s cap=%.3g MiB first=%.3g MiB",
            type(inner).__name__, config.backend_name, self._mode, cap / MiB, first / MiB,
        )

    def _new_alignment(self, names: dict[int, str], *, split: bool) -> ReducerAlignment:
        if self._ddp is None:
            return ReducerAlignment(ddp=None, names=names, status="not applicable", detail="no DDP")
        if self._mode == "torch":
            return ReducerAlignment(ddp=self._ddp, names=names, status="not ours",
                                    detail="ddp='torch' leaves bucketing to PyTorch")
        if self._mode == "in_graph":
            return ReducerAlignment(ddp=self._ddp, names=names, status="not applicable",
                                    detail="ddp='in_graph': the compiled backward all-reduces, DDP's reducer stays idle")
        if not split:
            return ReducerAlignment(ddp=self._ddp, names=names, status="not applicable", detail=f"ddp={self._mode!r}")
        return ReducerAlignment(ddp=self._ddp, names=names, agreement=self._agreement)

    # ---- calling ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Between iterations, before DDP's pre-forward: the only safe moment to swap DDP's reducer.
        beat()  # progress, for a launcher watching for hangs (launch/heartbeat.py)
        self._alignment.before_forward(self._calls)
        if self._in_graph is not None:
            self._in_graph.before_forward()
        self._calls += 1

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._in_graph.after_forward(output)

    def _run_inner(self, *args: Any, **kwargs: Any) -> Any:
        # In ddp='torch' PyTorch's DDPOptimizer splits; otherwise our backend does and DDPOptimizer
        # must not split again.
        around = pytorch_ddp_optimizer() if self._mode == "torch" else torch_ddp.hidden_from_dynamo()
        graphs = self._events.graphs
        try:
            with around, self._events.call(), self._events.count_skipped_frames():
                out = self._compiled(*args, **kwargs)
        except DynamoError as err:
            ours = root_cause(err, RankAgreementError)
            if ours is not None:
                raise ours from None  # ranks diverged: say so, not "backend failed"
            raise
        if self._agreement is not None and (self._events.graphs != graphs or self._calls == 1):
            with self._log.lock:
                summary = self._summary()
            self._agreement.publish("compile summary", summary)  # read by other ranks' report()
        return out

    # ---- compiling -------------------------------------------------------------------------------

    def _torch_piece(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        # PyTorch's DDPOptimizer calls this once per piece it made.
        name = f"torch_piece_{len(self._log.graphs)}"
        compiled, _ = self._pieces(gm, list(example_inputs), name, reuse=False)
        with self._log.lock:
            self._log.graphs.append(GraphEntry(name=name, pieces=1, buckets=[], seconds=0.0, step=self._calls))
        return compiled

    def _in_graph_graph(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        # One graph, never split: its backward all-reduces the plan's buckets (ddp/in_graph/).
        name = f"graph_{len(self._log.graphs)}"
        after: list[str] = []
        compiled, plan = self._in_graph.compile(gm, example_inputs, name, self._pieces, after.extend)
        buckets = [] if plan is None else [b.to_dict() for b in plan.buckets]
        for bucket, op in zip(buckets, after or ["(compiled artifact from cache)"] * len(buckets)):
            bucket["after"] = op
        with self._log.lock:
            self._log.graphs.append(GraphEntry(
                name=name, pieces=1, buckets=buckets, seconds=0.0, step=self._calls, variant=self._in_graph.variant,
            ))
        return compiled

    def _on_graph(self, graph: SplitGraph) -> None:
        plan = graph.plan
        buckets = [b.to_dict() for b in plan.buckets]
        caps = {"requested_bytes": plan.bucket_cap_bytes, "requested_first_bytes": plan.first_bucket_cap_bytes,
                "planned_bytes": [b.nbytes for b in plan.buckets], "aligned_to": list(plan.aligned_to)}
        with self._log.lock:
            self._log.graphs.append(
                GraphEntry(name=graph.name, pieces=graph.pieces, buckets=buckets, seconds=0.0, step=self._calls,
                           bucket_caps=caps, restrided=graph.restrided if graph.pieces > 1 else None)
            )
        self._alignment.record(self._calls, graph)

    def _graph_compiled(self, seconds: float) -> None:
        with self._log.lock:
            if self._log.graphs:
                self._log.graphs[-1].seconds = seconds

    def _summary(self) -> dict[str, Any]:
        """What this rank compiled, in terms other ranks can compare (see `rank_differences`)."""
        return {
            "graphs": [(g.name, g.pieces) for g in self._log.graphs],
            "fallbacks": sorted(f"{f['piece']}: {f['from']} -> {f['to']}" for f in self._log.fallbacks),
            "recompiles": len(self._events.recompiles),
            "graph_breaks": len(self._events.graph_breaks),
        }

    def _rank_differences(self) -> list[dict[str, Any]]:
        """Other ranks whose compile differs from this rank's, and how (never waits for them)."""
        if self._agreement is None:
            return []
        with self._log.lock:
            mine = self._summary()
        out = []
        for rank, theirs in sorted(self._agreement.peek("compile summary").items()):
            if rank == self._agreement.rank:
                continue
            diff = [f"{k}: {theirs.get(k)!r} here {mine[k]!r}" for k in mine if theirs.get(k) != mine[k]]
            if diff:
                out.append({"rank": rank, "difference": "; ".join(diff)})
        return out

    # ---- reporting and delegation ------------------------------------------------------------------

    def report(self) -> CompileReport:
        return self._log.snapshot(
            mode=self._mode if self._ddp is not None else "none", backend=self._config.backend_name,
            events=self._events, alignment=self._alignment.to_dict(),
            observed_alignment=self._alignment.observed(),
            notes=self._alignment.notes,
            rank_differences=self._rank_differences(),
            in_graph=self._in_graph.to_dict() if self._in_graph is not None else None,
        )

    @property
    def in_graph(self) -> InGraphReducer | None:
        """The reducer of `ddp="in_graph"` mode (None in other modes)."""
        return self._in_graph

    @property
    def module(self) -> torch.nn.Module:
        """The model that was compiled (the DDP object for a DDP model)."""
        return self._model

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._model.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._model, name)

    def __repr__(self) -> str:
        return f"CompiledModel(backend={self._config.backend_name!r}, ddp={self._mode!r}, model={type(self._model).__name__})"


def _entry_for(inner: torch.nn.Module) -> Callable[..., Any]:
    # Our own frame, so Dynamo traces it (and inlines torch.nn code, nn.Sequential included).
    def compiled_entry(*args: Any, **kwargs: Any) -> Any:
        return call_uncompiled(inner, *args, **kwargs)

    return compiled_entry
