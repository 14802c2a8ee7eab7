"""`compile_core.compile`: compile a (DDP) model through bucket-aligned pieces.

We compile the module DDP wraps, never DDP's own forward (Dynamo cannot trace its bookkeeping, and
skips torch.nn frames: `torch.compile(DDP(nn.Sequential(...)))` compiles nothing). The compiled
function is installed as the inner module's `_compiled_call_impl` (what `nn.Module.compile()` does), so
DDP's forward still runs eagerly around it, `state_dict()` keys do not change, and the entry frame is
ours, so Dynamo traces into `nn.Sequential` too. While our compiled function runs, DDP's "active
module" slot is cleared: otherwise Dynamo would wrap our backend in PyTorch's DDPOptimizer again.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel

from aot import GraphPair, aot_compile, nop_compiler
from compile_core.config import CompileConfig
from compile_core.report import CompileLog, CompileReport, GraphEntry
from ddp.alignment import alignment_blocker, rebuild_reducer
from ddp.bucketing import MiB, resolve_caps
from ddp.splitter import DDPSplitter, SplitGraph, SplitterConfig
from inductor import inductor_compile

log = logging.getLogger(__name__)


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
) -> "CompiledModel":
    """Compile `model` (a DDP model or a plain module); see DESIGN.md for the contract."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (or DistributedDataParallel), got {type(model).__name__}; "
            "wrap your function in an nn.Module or use torch.compile for plain functions"
        )
    if isinstance(model, CompiledModel):
        raise TypeError("model is already compiled by compile_core.compile; pass the original model")
    config = CompileConfig(
        backend=backend, ddp=ddp, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
        fullgraph=fullgraph, dynamic=dynamic, mode=mode, options=options,
    )
    return CompiledModel(model, config)


class CompiledModel:
    """Callable like the model; `report()` tells how it was compiled. Attributes delegate to the model."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig) -> None:
        self._model = model
        self._config = config
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        inner = model.module if self._ddp is not None else model
        if getattr(inner, "_compiled_call_impl", None) is not None:
            raise ValueError(
                f"{type(inner).__name__} is already compiled (module.compile() or compile_core.compile); "
                "compile each module once"
            )
        self._inner = inner
        self._mode = config.ddp or "split"
        if self._ddp is None and self._mode == "torch":
            raise ValueError("ddp='torch' compares against PyTorch's DDPOptimizer and needs a DDP model; use ddp='none'")
        self._log = CompileLog()
        self._calls = 0
        self._pending_guard_failures: list[dict] = []
        self._split_graphs: list[tuple[int, SplitGraph]] = []
        self._aligned_buckets: list[frozenset[str]] | None = None

        cap, first = self._resolve_caps()
        names = {id(p): n for n, p in inner.named_parameters()}
        ignore = frozenset(getattr(self._ddp, "parameters_to_ignore", ()) or ())
        split = self._ddp is not None and self._mode == "split"
        self._aligns = split
        if self._ddp is None:
            self._log.notes.append("not a DDP model: graphs are compiled whole")
        if self._mode == "torch":
            backend: Callable[..., Any] = self._torch_mode_backend
            self._log.alignment = {"status": "not ours", "detail": "ddp='torch' leaves bucketing to PyTorch"}
        else:
            splitter_config = SplitterConfig(
                bucket_cap_bytes=cap, first_bucket_cap_bytes=first, param_names=names, ignore=ignore, split=split
            )
            backend = _TimedBackend(DDPSplitter(splitter_config, self._compile_piece, self._on_graph), self)
            if not split:
                self._log.alignment = {"status": "not applicable", "detail": f"ddp={self._mode!r}" if self._ddp else "no DDP"}
        self._compiled = torch._dynamo.optimize(
            backend, nopython=config.fullgraph, dynamic=config.dynamic, guard_fail_fn=self._on_guard_fail
        )(_entry_for(inner))
        inner._compiled_call_impl = self._run_inner
        # Runs before DDP's own forward, however the model is called (through us or directly).
        model.register_forward_pre_hook(self._before_forward)
        log.info(
            "compile_core: %s compiled with backend=%s ddp=%s cap=%.3g MiB first=%.3g MiB",
            type(inner).__name__, config.backend_name, self._mode, cap / MiB, first / MiB,
        )

    # ---- calling ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Between iterations, before DDP's pre-forward: the only safe moment to swap DDP's reducer.
        if self._aligned_buckets is None and self._split_graphs and torch.is_grad_enabled():
            self._align_ddp_buckets()
        self._calls += 1

    def _run_inner(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode == "torch":
            with torch._dynamo.config.patch(optimize_ddp="ddp_optimizer"):
                return self._compiled(*args, **kwargs)
        # Hide the DDP module from Dynamo: our backend splits; DDPOptimizer must not split again.
        saved = DistributedDataParallel._active_ddp_module
        DistributedDataParallel._active_ddp_module = None
        try:
            return self._compiled(*args, **kwargs)
        finally:
            DistributedDataParallel._active_ddp_module = saved

    # ---- compiling -------------------------------------------------------------------------------

    def _resolve_caps(self) -> tuple[int, int]:
        cfg = self._config
        if cfg.bucket_cap_mb is not None:
            cap = int(cfg.bucket_cap_mb * MiB)
        elif self._ddp is not None:
            cap = int(self._ddp.bucket_bytes_cap)
        else:
            cap = 25 * MiB
        first = None if cfg.first_bucket_cap_mb is None else int(cfg.first_bucket_cap_mb * MiB)
        if first is not None and first > cap:
            raise ValueError(
                f"first_bucket_cap_mb={cfg.first_bucket_cap_mb} is larger than the bucket cap "
                f"({cap / MiB:.3g} MiB, from the DDP object); lower first_bucket_cap_mb or pass bucket_cap_mb"
            )
        return resolve_caps(max(cap, 1), first)

    def _compile_piece(self, gm: fx.GraphModule, example_inputs: list, name: str) -> tuple[Callable[..., Any], bool]:
        """Compile one piece, falling back along the chain; every fallback is recorded."""
        chain = self._config.fallback_chain()
        first_error: tuple[str, BaseException] | None = None
        for backend in chain:
            try:
                compiled, used_aot = self._compile_with(backend, gm, example_inputs, name)
            except torch._dynamo.exc.RestartAnalysis:
                raise  # Dynamo's own control flow (e.g. specialize a float and trace again), not a failure
            except Exception as exc:  # noqa: BLE001 - any compiler failure moves to the next backend
                if backend == chain[-1]:
                    raise
                log.warning("compile_core: %s failed to compile %s: %r; falling back", backend, name, exc, exc_info=log.isEnabledFor(logging.DEBUG))
                if first_error is None:
                    first_error = (backend, exc)
                continue
            if first_error is not None:
                failed, exc = first_error
                with self._log.lock:
                    self._log.fallbacks.append(
                        {"piece": name, "from": failed, "to": backend, "error": f"{type(exc).__name__}: {exc}"[:500]}
                    )
            return compiled, used_aot
        raise AssertionError("unreachable: the last backend either returns or raises")

    def _compile_with(self, backend: str, gm: fx.GraphModule, example_inputs: list, name: str) -> tuple[Callable[..., Any], bool]:
        if backend == "eager":
            return gm.forward, False
        if backend == "custom":
            return self._config.backend(gm, example_inputs), False
        pair = GraphPair(name=name)
        if backend == "aot_eager":
            compiled = aot_compile(gm, example_inputs, fw_compiler=nop_compiler, bw_compiler=nop_compiler, pair=pair)
        else:
            compiled = inductor_compile(
                gm, example_inputs, settings=self._config.inductor_settings(),
                on_graph=lambda graph, is_backward: pair.record(graph, backward=is_backward),
            )
        with self._log.lock:
            self._log.pairs.append(pair)
        return compiled, True

    def _torch_mode_backend(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        # PyTorch's DDPOptimizer calls this once per piece it made.
        start = time.perf_counter()
        self._note_recompile()
        self._note_graph_break(gm)
        name = f"torch_piece_{len(self._log.graphs)}"
        compiled, _ = self._compile_piece(gm, list(example_inputs), name)
        seconds = time.perf_counter() - start
        with self._log.lock:
            self._log.graphs.append(GraphEntry(name=name, pieces=1, buckets=[], seconds=seconds, step=self._calls))
            self._log.compile_seconds += seconds
        return compiled

    def _on_graph(self, graph: SplitGraph) -> None:
        buckets = [b.to_dict() for b in graph.plan.buckets]
        with self._log.lock:
            self._log.graphs.append(
                GraphEntry(name=graph.name, pieces=graph.pieces, buckets=buckets, seconds=0.0, step=self._calls)
            )
        if self._aligns:
            self._split_graphs.append((self._calls, graph))
        if self._aligned_buckets is not None:
            self._check_late_graph(graph)

    def _note_graph_break(self, gm: fx.GraphModule) -> None:
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is None or not getattr(reason, "graph_break", False):
            return
        where = "<unknown>"
        stack = getattr(reason, "user_stack", None) or []
        if stack:
            frame = stack[-1]
            where = f"{frame.filename}:{frame.lineno}"
        with self._log.lock:
            self._log.graph_breaks.append({"reason": str(reason.reason), "where": where})

    def _on_guard_fail(self, failure: Any) -> None:
        # Dynamo calls this once per cached entry that failed, just before it recompiles; the
        # failures are folded into one recompile when the backend is next called (`_note_recompile`).
        code = getattr(failure, "orig_code", None)
        where = f"{code.co_filename}:{code.co_firstlineno} {code.co_name}" if code is not None else ""
        with self._log.lock:
            self._pending_guard_failures.append({"reason": str(getattr(failure, "reason", failure)), "where": where})

    def _note_recompile(self) -> None:
        with self._log.lock:
            pending, self._pending_guard_failures = self._pending_guard_failures, []
            if pending:
                reasons = list(dict.fromkeys(f["reason"] for f in pending))
                self._log.recompiles.append({"reason": "; ".join(reasons), "where": pending[0]["where"]})

    # ---- DDP bucket alignment --------------------------------------------------------------------

    def _planned_buckets(self) -> list[list[torch.nn.Parameter]]:
        """Every bucket of the graphs compiled in the first compiling step, in backward order."""
        first_step = [g for step, g in self._split_graphs if step == self._split_graphs[0][0]]
        buckets: list[list[torch.nn.Parameter]] = []
        for graph in reversed(first_step):  # later graphs run their backward first
            buckets.extend(graph.params)
        # A parameter used by several graphs is ready after the earliest of them: keep its last place.
        seen: set[int] = set()
        deduped: list[list[torch.nn.Parameter]] = []
        for bucket in reversed(buckets):
            kept = [p for p in bucket if id(p) not in seen]
            seen.update(id(p) for p in kept)
            deduped.append(kept)
        return [b for b in reversed(deduped) if b]

    def _align_ddp_buckets(self) -> None:
        """Before the second call: make DDP's buckets equal our pieces (see ddp/alignment.py)."""
        buckets = self._planned_buckets()
        blocker = alignment_blocker(self._ddp, buckets)
        if blocker is not None:
            self._aligned_buckets = []
            self._log.alignment = {"status": "skipped", "detail": blocker}
            log.warning("compile_core: DDP buckets left as DDP built them: %s", blocker)
            return
        layout, differing = rebuild_reducer(self._ddp, buckets)
        names = {id(p): n for n, p in self._inner.named_parameters()}
        params, _ = self._ddp._build_params_for_reducer()
        self._aligned_buckets = [frozenset(names[id(params[i])] for i in b) for b in layout]
        self._log.alignment = {
            "status": "aligned",
            "detail": f"DDP reducer uses our {len(layout)} bucket(s) from step {self._calls + 1}",
            "buckets": [sorted(b) for b in self._aligned_buckets],
        }
        if differing:
            # Correct on every rank (all reduce rank 0's buckets), but this rank's pieces may not match.
            self._log.alignment["detail"] += f"; ranks {differing} planned differently and use rank 0's buckets"
            self._log.notes.append(f"ranks {differing} compiled other pieces than rank 0 (see alignment)")

    def _check_late_graph(self, graph: SplitGraph) -> None:
        aligned = set(self._aligned_buckets or [])
        stray = [list(b.params) for b in graph.plan.buckets if b.params and frozenset(b.params) not in aligned]
        if stray and self._log.alignment.get("status") == "aligned":
            self._log.notes.append(
                f"{graph.name} (compiled at step {self._calls}) has pieces that are not DDP buckets: {stray}"
            )

    # ---- reporting and delegation ------------------------------------------------------------------

    def report(self) -> CompileReport:
        self._check_observed_buckets()
        return self._log.snapshot(mode=self._mode if self._ddp is not None else "none", backend=self._config.backend_name)

    def _check_observed_buckets(self) -> None:
        """With an `OverlapRecorder` attached, compare our pieces with the buckets DDP really reduced."""
        from ddp.overlap import OverlapRecorder, check_alignment

        if self._ddp is None or not self._split_graphs:
            return
        recorders = [getattr(h, "__self__", None) for h, _ in self._ddp._comm_hooks]
        recorder = next((r for r in recorders if isinstance(r, OverlapRecorder)), None)
        steps = recorder.steps() if recorder is not None else []
        if not steps:
            return
        names = {id(p): n for n, p in self._inner.named_parameters()}
        planned = [[names[id(p)] for p in b] for b in self._planned_buckets()]
        result = check_alignment(planned, steps[-1].bucket_names())
        with self._log.lock:
            self._log.observed_alignment = {"step": len(steps), **result.to_dict(), "text": str(result)}

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


class _TimedBackend:
    """The Dynamo backend we hand over: notes graph breaks, times compiles."""

    def __init__(self, splitter: DDPSplitter, owner: CompiledModel) -> None:
        self.splitter = splitter
        self.owner = owner

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        start = time.perf_counter()
        self.owner._note_recompile()
        self.owner._note_graph_break(gm)
        compiled = self.splitter(gm, example_inputs)
        seconds = time.perf_counter() - start
        log_ = self.owner._log
        with log_.lock:
            if log_.graphs:
                log_.graphs[-1].seconds = seconds
            log_.compile_seconds += seconds
        return compiled


def _entry_for(inner: torch.nn.Module) -> Callable[..., Any]:
    # Our own frame, so Dynamo traces it (and inlines torch.nn code, nn.Sequential included).
    def compiled_entry(*args: Any, **kwargs: Any) -> Any:
        return inner._call_impl(*args, **kwargs)

    return compiled_entry
