"""`compile_core.compile`: compile a (DDP) model in place, through bucket-aligned pieces (docs/design.md).

The model handed in is the model handed back, compiled in place (compile_core/in_place.py); what the
compile keeps is one `CompileState`, reachable as `model.compile_state`.

We compile the module DDP wraps, never DDP's own forward (Dynamo cannot trace its bookkeeping, and
skips torch.nn frames: `torch.compile(DDP(nn.Sequential(...)))` compiles nothing). The compiled
function is installed as the inner module's `_compiled_call_impl` (what `nn.Module.compile()` does), so
DDP's forward still runs eagerly around it, `state_dict()` keys do not change, and the entry frame is
ours, so Dynamo traces into `nn.Sequential` too; our own work before each forward stays outside that frame
(a pre-hook of the DDP object; without DDP, the start of the compiled call). While our compiled function
runs, DDP's "active module" slot is cleared: otherwise Dynamo would wrap our backend in PyTorch's
DDPOptimizer again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, Iterator

import torch
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from aot.torch_dynamo import DynamoError, root_cause
from aot.torch_eager import (
    call_uncompiled,
    install_compiled_call,
    installed_compiled_call,
    torch_compile_original,
    uninstall_compiled_call,
)
from compile_core import progress
from compile_core.config import CompileConfig
from compile_core.events import CompileEvents
from compile_core.in_place import CompiledModel, Detached, compile_in_place, detached_hook, uncompile_in_place
from compile_core.modes import ModeContext, make_mode
from compile_core.other_compiles import ddp_wrapper_note, refuse_module_compile_after_ours, take_their_place
from compile_core.pieces import PieceCompiler
from compile_core.regions import apply_nested_regions, remove_nested_regions
from compile_core.report import CompileLog, CompileReport
from compile_core.reuse.idle_work import IdleWork
from ddp.agreement import RankAgreement, RankAgreementError
from ddp.bucketing import MiB
from ddp.bucketing.auto_cap import AutoCap
from ddp.in_graph import InGraphReducer
from ddp.link_probe import auto_bucket_cap

log = logging.getLogger(__name__)

_models = itertools.count()
"""Numbers compiled models in creation order: every rank creates them in the same order, so the
number names the same model on every rank (the prefix of its rank-agreement keys)."""


def compile(
    model: torch.nn.Module,
    *,
    backend: str | Callable[..., Any] = "inductor",
    ddp: str | None = None,
    bucket_cap_mb: float | str | None = None,
    first_bucket_cap_mb: float | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    mode: str | None = None,
    options: dict | None = None,
    reuse_pieces: bool = True,
    reduce_dtype: torch.dtype | None = None,
    nested_regions: bool = False,
    disable: bool = False,
) -> "CompiledModel":
    """Compile `model` (a DDP model or a plain module) in place and return it; see docs/design.md.

    The result is `model` itself: its attributes, `.module`, `state_dict()` and `isinstance` checks are the
    ones the script had; `model.report()` and `model.compile_state` are added. Handed `torch.compile(ddp)`, it
    compiles and returns the DDP model inside (the wrapper's call then runs it). `disable=True` (torch.compile's
    switch, as in `disable=not args.compile`) checks the arguments and returns `model` untouched."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (or DistributedDataParallel), got {type(model).__name__}; "
            "wrap your function in an nn.Module or use torch.compile for plain functions"
        )
    handed, original = model, torch_compile_original(model)
    if isinstance(original, DistributedDataParallel):
        # `torch.compile(ddp)`: the DDP model inside is what we compile and hand back (compiling the wrapper as a
        # plain module would compile nothing: its call is DDP's, whose frame Dynamo skips).
        model = original
    if isinstance(model, CompiledModel):
        raise ValueError(
            f"this {type(model).__name__} is already compiled by compile_core.compile (which compiles in place "
            "and returns the same object): compile each model once, and hand the uncompiled DDP model to "
            "compile_core.train_step (it compiles the model itself)"
        )
    config = CompileConfig(
        backend=backend,
        ddp=ddp,
        bucket_cap_mb=bucket_cap_mb,
        first_bucket_cap_mb=first_bucket_cap_mb,
        fullgraph=fullgraph,
        dynamic=dynamic,
        mode=mode,
        options=options,
        reuse_pieces=reuse_pieces,
        reduce_dtype=reduce_dtype,
        nested_regions=nested_regions,
    )
    if not isinstance(disable, bool):
        raise TypeError(f"disable={disable!r}: pass True (compile nothing) or False, as to torch.compile")
    if disable:
        return handed
    state = CompileState(model, config, handed=handed)
    compile_in_place(model, state)
    return model


class CompileState:
    """Everything compiling one model keeps (the model itself is compiled in place; see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig, *, handed: torch.nn.Module | None = None) -> None:
        """`handed`: what the script handed to compile_core.compile, when not `model` (torch.compile's wrapper)."""
        self._model = model
        self._config = config
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        inner = model.module if self._ddp is not None else model
        if not isinstance(inner, CompiledModel) and isinstance(installed_compiled_call(inner), Detached):
            # the module inside a DDP model compiled already (one compiled before DDP wrapped it gives way, below)
            raise ValueError(
                f"{type(inner).__name__} is already compiled by compile_core.compile (which compiles in place): "
                "compile each module once"
            )
        self._inner = inner
        self._log = CompileLog()
        for note in take_their_place(handed if handed is not None else model, model, inner):
            self._note(f"{note} (backend={config.backend_name})")
        if config.nested_regions:
            marked = apply_nested_regions(inner)
            self._log.notes.append(
                "nested compile regions: " + ", ".join(f"{name} x{n}" for name, n in marked.items())
                if marked
                else "nested_regions=True: no repeated blocks found in the parameter names (nothing marked)"
            )
        self._events = CompileEvents()
        self.idle_work = IdleWork()
        """What a train step offers this model's compile to do while it waits for another rank's."""
        self._calls = 0
        self._eager = False
        self._wrapped_by_ddp_noted = self._ddp is not None
        self._agreement = (
            RankAgreement(self._ddp.process_group, prefix=f"ddp_compile/model{next(_models)}")
            if self._ddp is not None
            else None
        )
        auto = self._auto_cap(model) if config.auto_cap else None
        cap, first = config.caps(
            int(self._ddp.bucket_bytes_cap) if self._ddp is not None else None,
            auto_cap_bytes=None if auto is None else auto.cap_bytes,
        )
        self._mode = make_mode(
            ModeContext(
                model=model,
                ddp=self._ddp,
                inner=inner,
                names={id(p): n for n, p in inner.named_parameters()},
                config=config,
                log=self._log,
                pieces=PieceCompiler(config, self._log, self.idle_work),
                agreement=self._agreement,
                cap_bytes=cap,
                first_cap_bytes=first,
                calls=lambda: self._calls,
                eager=lambda: self._eager,
            )
        )
        self._compiled = self._events.compile(
            _entry_for(inner),
            self._mode.backend,
            runs=inner,
            fullgraph=config.fullgraph,
            dynamic=config.dynamic,
            on_compiled=self._graph_compiled,
            guard_module_hooks=True,  # a hook the user adds (or removes) after a compile runs as in eager
            # Every compiled model's entry shares one code object, which Dynamo's cache hangs off: shared, each
            # model compiled in a process added cache entries to the same list, and from the 9th on (Dynamo's
            # recompile limit, 8) the model ran uncompiled, with no word but Dynamo's warning.
            isolate_recompiles=True,
        )
        self._installed = Detached(self._run_inner, copied_as=None)
        install_compiled_call(inner, self._installed)
        if model is not inner:
            # Run around DDP's own forward, however the model is called.
            model.register_forward_pre_hook(detached_hook(self._before_forward))
        # Without DDP, `_run_inner` runs it: a hook of `inner` would run inside the frame Dynamo compiles, which
        # skips it (a graph break in every report), and torch 2.11 then compiled no graph at all of an
        # nn.Sequential (2.13 and 2.14 compiled it after the break).
        # The first forward in a grad mode (the first evaluation under no_grad, the first training step after
        # evaluating) compiles graphs of its own: expected, not a recompile. A mode may refine this.
        self._grad_modes_seen: set[bool] = set()
        self._new_grad_mode = False
        self._events.expected_switch = lambda: self._new_grad_mode
        self._mode.install(model, inner, self._events)
        log.info(
            "compile_core: %s compiled with backend=%s ddp=%s cap=%.3g MiB first=%.3g MiB",
            type(inner).__name__,
            config.backend_name,
            self._mode.name,
            cap / MiB,
            first / MiB,
        )

    def _note(self, note: str) -> None:
        self._log.notes.append(note)
        log.warning("compile_core: %s", note)

    def join_hook(self, hook: JoinHook) -> JoinHook:
        """DDP's join hook for `ddp.join()`, as this model's mode needs it (compile_core/in_place.py asks)."""
        return self._mode.join_hook(hook)

    def give_way(self) -> None:
        """Undo this compile of a plain module, for the compile of a DDP model that wrapped it since
        (compile_core/other_compiles.py); without DDP, nothing else of ours is attached to the module."""
        if installed_compiled_call(self._inner) is self._installed:
            uninstall_compiled_call(self._inner)
        if self._config.nested_regions:
            remove_nested_regions(self._inner)
        uncompile_in_place(self._model)

    def _auto_cap(self, model: torch.nn.Module) -> AutoCap:
        if self._ddp is None:
            raise ValueError(
                f"bucket_cap_mb='auto' times the all-reduce of a DDP model's process group, and "
                f"{type(model).__name__} is not DistributedDataParallel: give a number of MiB or None"
            )
        auto = auto_bucket_cap(self._ddp)
        self._log.auto_cap = auto.to_dict()
        log.info(
            "compile_core: bucket_cap_mb='auto': all-reduce %.0f us + %.3g GB/s, %.3g MiB of gradients -> "
            "cap %.3g MiB (%s bound)",
            auto.latency_s * 1e6,
            auto.bytes_per_s / 1e9,
            auto.grad_bytes / MiB,
            auto.cap_bytes / MiB,
            auto.bound,
        )
        return auto

    # ---- calling ---------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    @property
    def model(self) -> torch.nn.Module:
        """The model compiled in place (the object `compile_core.compile` returned)."""
        return self._model

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Forwards inside run as the user's eager model would: no compiled graph, no hook of the mode
        (DDP's own reducer reduces). For a first step whose only job is what eager code does best
        (`train_step` with the optimizer in the backward: create the optimizer state)."""
        self._eager = True
        try:
            yield
        finally:
            self._eager = False

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Between iterations, before DDP's pre-forward: the only safe moment to swap DDP's reducer.
        progress.report()  # for a launcher watching for hangs (compile_core/progress.py)
        if module is not self._inner:
            refuse_module_compile_after_ours(module, self._inner, self._installed)
        if not self._eager:
            self._mode.before_forward()
        grad = torch.is_grad_enabled()
        self._new_grad_mode = grad not in self._grad_modes_seen
        self._grad_modes_seen.add(grad)
        self._calls += 1

    def _run_inner(self, *args: Any, **kwargs: Any) -> Any:
        if self._model is self._inner:  # no DDP: what the pre-forward hook does around DDP (see __init__)
            self._before_forward(self._inner, args)
            note = None if self._wrapped_by_ddp_noted else ddp_wrapper_note(self._inner)
            if note is not None:
                self._wrapped_by_ddp_noted = True
                self._note(note)
        if self._eager:
            return call_uncompiled(self._inner, *args, **kwargs)
        graphs = self._events.graphs
        try:
            with self._mode.around_call(), self._events.call(), self._events.count_skipped_frames():
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

    def _graph_compiled(self, seconds: float) -> None:
        with self._log.lock:
            if self._log.graphs:
                self._log.graphs[-1].seconds = seconds

    def _summary(self) -> dict[str, Any]:
        """What this rank compiled, in terms other ranks can compare (see `rank_differences`): the graphs that
        train, by their pieces and buckets (graph names are numbered per rank, and evaluation graphs that only
        some ranks compile, as when rank 0 alone evaluates, reduce nothing)."""
        return {
            "graphs": [(g.pieces, [b["params"] for b in g.buckets]) for g in self._log.graphs if g.grad],
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
            mode=self._mode.name,
            backend=self._config.backend_name,
            events=self._events,
            alignment=self._mode.alignment.to_dict(),
            observed_alignment=self._mode.alignment.observed(),
            notes=self._mode.alignment.notes,
            rank_differences=self._rank_differences(),
            **self._mode.report_fields(),
        )

    @property
    def in_graph(self) -> InGraphReducer | None:
        """The reducer of `ddp="in_graph"` mode (None in other modes)."""
        return self._mode.reducer

    def __repr__(self) -> str:
        return (
            f"CompileState(backend={self._config.backend_name!r}, ddp={self._mode.name!r}, "
            f"model={type(self._model).__name__})"
        )


def state_of(model: torch.nn.Module) -> CompileState:
    """The `CompileState` of a model `compile_core.compile` compiled (TypeError for any other model)."""
    if not isinstance(model, CompiledModel):
        raise TypeError(f"{type(model).__name__} is not compiled by compile_core.compile")
    return model.compile_state


def _entry_for(inner: torch.nn.Module) -> Callable[..., Any]:
    # Our own frame, so Dynamo traces it (and inlines torch.nn code, nn.Sequential included).
    def compiled_entry(*args: Any, **kwargs: Any) -> Any:
        return call_uncompiled(inner, *args, **kwargs)

    return compiled_entry
