"""The optimizer update compiled once per repeated block (`ChunkedUpdate`), for SGD, Adam and AdamW.

Note [Optimizer update per block]
---------------------------------
Background: torch's CPU optimizers loop over the parameters in Python, so Dynamo traces one copy of
the update per parameter: for a 12-block transformer that is ~200 copies to trace, lower and
generate, every run (Dynamo's tracing is never cached), and it dominated a compiled train step's first step.
A `foreach` step (torch's default on CUDA) has no such loop to trace, and compiled whole it becomes a few
horizontally fused kernels: it is compiled whole (compile_core/step/update.py: `multi_tensor_step`).

Algorithm (`ChunkedUpdate`, for exactly SGD, Adam and AdamW: `optim_math.support`, as compile_core/in_backward/):
  * the parameters of each param group are cut into chunks (compile_core/step/chunk_plan.py): one per
    repeated block (from the parameter names, ddp/bucketing/repeats.py) and one for the rest;
  * one function applies the update math of compile_core/step/optim_math.py to each parameter of a chunk,
    fed with a vector of scalars per parameter computed on the host as eager torch computes them
    (a graph input: schedulers change values, never the graph);
  * it is compiled once per group and chunk signature (shapes, strides, dtypes of the parameters and
    their state), and every chunk of that signature reuses it: 12 identical blocks, one compile;
  * update 1 runs `optimizer.step()` eagerly (it creates the optimizer state exactly as torch does),
    then each distinct chunk is compiled by running it once on copies of one chunk's tensors, so the
    compile still happens in the first step; from update 2 each chunk runs compiled, under no_grad.
    When the state already exists at update 1 (a run resumed from a checkpoint, or plain SGD, which
    keeps none), update 1 runs compiled too: a resumed run applies the same compiled math at every
    update as the run it continues.
  * ahead of update 1 (`compile_ahead`), when the model compiles as one graph (`ddp="in_graph"`): one
    rank compiles the model while the others wait for it, so a rank about to wait first compiles the
    chunks on stand-ins (compile_core/step/stand_ins.py: copies with zero gradients and the state a
    throwaway optimizer of the same class creates, so its layout is torch's own; the step offers this
    work through compile_core/reuse/idle_work.py). Through the chunks' claims the compiling rank later
    loads them; update 1 compiles only a chunk whose real key differs. A rank that never waits (a warm
    start) compiles at update 1 as before.
  * clipping (`clip_grad_norm_` over all gradients) is its own compiled function, called first;
  * a parameter without a gradient has no optimizer state (unused so far, `find_unused_parameters`, or
    frozen so far: chunks hold every parameter of a group, `requires_grad` or not, as torch's step does):
    the update in which one first has a gradient runs `optimizer.step()` eagerly, which creates its
    state as torch does. A chunk updates the parameters that have a gradient, as torch's step skips
    the others: it is compiled for the set it has (a pooler that never gets a gradient leaves the rest
    of its chunk compiled), up to `MAX_SUBSETS` different sets per chunk (experts that switch per
    step), past which a set not seen before runs eagerly.
The optimizer state tensors are the optimizer's own, updated in place, so `optimizer.state_dict()`
is what an eager run gives. Optimizers with step hooks, other optimizer classes, differentiable or
sparse groups keep `CompiledUpdate`.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any, Callable, Mapping

import torch

from aot.torch_dynamo import DynamoError, lookup_backend, watch_caches
from compile_core.events import CompileEvents
from compile_core.reuse.compile_once import Compiled, CompileOnce, Job, rank_offset, say
from compile_core.step import optim_math
from compile_core.step.chunk_math import UPDATES, chunk_arguments
from compile_core.step.chunk_plan import Chunk, plan_chunks
from compile_core.step.stand_ins import stand_ins

MAX_SUBSETS = 4
"""Compiled variants per chunk for different sets of parameters with a gradient (see the Note)."""

_NO_STATE: Mapping[str, Any] = types.MappingProxyType({})
"""The state of a parameter the optimizer keeps none for (read only)."""


class ChunkedUpdate:
    """The optimizer update per block (see Note [Optimizer update per block]); `compiled(update_index)`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        names: dict[int, str],
        backend: str | Callable[..., Any],
        events: CompileEvents,
        *,
        clip_max_norm: float | None = None,
        eager_step: Callable[[], Any] | None = None,
        claims: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self._eager_step = eager_step or optimizer.step
        self.events = events
        self.clip_max_norm = clip_max_norm
        self.records: list[dict[str, Any]] = []
        """One per chunk: `name`, `cache` (reused, or the cache outcome), `seconds`, `reused_from`."""
        self._backend = lookup_backend(backend)
        self._backend_name = backend if isinstance(backend, str) else "custom"
        self._chunks = plan_chunks(optimizer, names)
        self._params = [p for c in self._chunks for p in c.params]
        self._fns: dict[tuple, Callable[..., Any]] = {}
        self._clip: Callable[[], Any] | None = None
        self._calls = 0
        self._stateless: list[torch.Tensor] = []  # parameters with no optimizer state yet (no gradient so far)
        self._state_watch = optim_math.StateWatch(optimizer)  # marked after every update
        # Claims only (no reuse here: Dynamo's cache per chunk signature does that): with Inductor,
        # the ranks of a node compile different chunks and load the others' (Note [Compile once]).
        self._once = CompileOnce(reuse=False, claims=claims, records=[], lock=threading.Lock()) if claims else None
        self._ahead = False  # compiling ahead of update 1 (`compile_ahead`): recorded per compile
        self.shares_compiles = self._once is not None
        """The ranks' compiles of a chunk are shared (claims): worth compiling ahead (`compile_ahead`)."""
        self.failure: BaseException | None = None
        """Why the chunks could not be compiled (update 1 was applied eagerly; use eager from now on)."""

    def __call__(self, update_index: int) -> torch.Tensor | None:
        self.events.label = {"update": update_index}
        if self._calls == 0 and self._resumed():
            # A resumed run (the optimizer state was loaded): no eager update to create it, so the
            # updates after a restart are the same compiled math as those of an uninterrupted run.
            try:
                with self.events.call(), self.events.count_breaks():
                    self._prepare()
            except DynamoError as err:
                self.failure = err
                norm = self._eager(update_index)
            else:
                norm = self._compiled_update()
        elif self._calls == 0:
            norm = self._eager(update_index)  # creates the optimizer state, as torch does
            try:
                with self.events.call(), self.events.count_breaks():
                    self._prepare()
            except DynamoError as err:  # nothing compiled ran on real tensors: update 1 stands
                self.failure = err
        elif self._gains_state():
            # A parameter has its first gradient, or lost its state: torch's own step creates it (as in update 1).
            norm = self._eager(update_index)
            self._stateless = self._without_state()
        else:
            norm = self._compiled_update()
        self._calls += 1
        self._state_watch.mark()
        return norm

    def _compiled_update(self) -> torch.Tensor | None:
        with self.events.call():
            norm = self._clip() if self._clip is not None else None
            with torch.no_grad():
                for chunk in self._chunks:
                    present = [p for p in chunk.params if p.grad is not None]
                    if present:  # torch's step skips parameters without a gradient: so do we
                        self._run(chunk, self._compiled_fn(chunk, present), params=present)
        return norm

    def _resumed(self) -> bool:
        """Every parameter that has a gradient now already has the optimizer state its update reads (a
        loaded checkpoint; or an optimizer that keeps none, like plain SGD)."""
        groups = self.optimizer.param_groups
        with_grad = [(p, groups[c.group]) for c in self._chunks for p in c.params if p.grad is not None]
        return bool(with_grad) and all(self._has_state(p, g) for p, g in with_grad)

    def uncaptured(self, params: list[torch.Tensor]) -> list[int]:
        """Indices of `params` that no compiled graph updates (all of them if nothing compiled)."""
        return [] if self.events.graphs else list(range(len(params)))

    # -- update 1 ----------------------------------------------------------------------------------

    def _eager(self, update_index: int) -> torch.Tensor | None:
        norm = None
        if self.clip_max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self._params, self.clip_max_norm)
        self._eager_step()
        return norm

    # -- parameters without a gradient or optimizer state yet ----------------------------------------

    def _states(self, params: list) -> list[Mapping[str, Any]]:
        """The optimizer's state of each parameter, read without adding entries (`optimizer.state` is a
        defaultdict): torch's SGD without momentum keeps none, and `state_dict()` must show none either."""
        state = self.optimizer.state
        return [state.get(p, _NO_STATE) for p in params]

    def _has_state(self, p: torch.Tensor, group: dict) -> bool:
        state = self.optimizer.state.get(p, _NO_STATE)
        if isinstance(self.optimizer, torch.optim.SGD):
            return group["momentum"] == 0 or state.get("momentum_buffer") is not None
        return "step" in state

    def _without_state(self) -> list[torch.Tensor]:
        groups = self.optimizer.param_groups
        return [p for c in self._chunks for p in c.params if not self._has_state(p, groups[c.group])]

    def _gains_state(self) -> bool:
        """Whether a parameter that has no optimizer state yet (it had no gradient so far) has one now:
        the functional update cannot create state, `optimizer.step()` does.

        The user may also drop state between updates: `optimizer.state.clear()`, `del optimizer.state[p]`,
        or `load_state_dict` of a checkpoint that lacks some parameters (a new `state` object). torch's
        step then starts those parameters afresh (step 0, zero moments), so the stateless set is
        recomputed whenever the state mapping was replaced or shrank."""
        if self._state_watch.changed():
            self._stateless = self._without_state()
        return any(p.grad is not None for p in self._stateless)

    def _key(self, chunk: Chunk, present: list[torch.nn.Parameter]) -> tuple[tuple, tuple]:
        """(ids, key) of a set of the chunk's parameters; a set seen before costs a dict lookup."""
        ids = tuple(map(id, present))
        key = chunk.keys.get(ids)
        return ids, key if key is not None else (chunk.group, self._signature(present))

    def _compiled_fn(self, chunk: Chunk, present: list[torch.nn.Parameter]) -> Callable[..., Any] | None:
        """The compiled update for these parameters of the chunk (those with a gradient); compiled now,
        on the real tensors by this call, for a set not seen at update 1. None (eager) past
        `MAX_SUBSETS` sets in this chunk."""
        ids, key = self._key(chunk, present)
        if ids not in chunk.keys:
            if len(chunk.keys) >= MAX_SUBSETS:
                return None
            chunk.keys[ids] = key
        if key not in self._fns:
            self._fns[key] = self._new_chunk_fn(chunk)
        return self._fns[key]

    def _prepare(self) -> None:
        """Compile each distinct chunk (and the clip) by running it once on copies of its tensors."""
        start = time.perf_counter()
        first: dict[tuple, str] = {}
        distinct: list[tuple[Chunk, list[torch.nn.Parameter], tuple]] = []
        self._stateless = self._without_state()
        stateless = set(map(id, self._stateless))
        for chunk in self._chunks:
            present = [p for p in chunk.params if p.grad is not None and id(p) not in stateless]
            if not present:
                continue  # compiled when its parameters first have a gradient (`_compiled_fn`)
            ids, key = self._key(chunk, present)
            chunk.keys[ids] = key
            if key in first:
                self.records.append(
                    {
                        "name": f"update.{chunk.name}",
                        "cache": "reused",
                        "seconds": 0.0,
                        "reused_from": f"update.{first[key]}",
                    }
                )
                continue
            first[key] = chunk.name
            distinct.append((chunk, present, key))
        # Each rank starts with another chunk, so that with claims they compile different ones at once.
        offset = rank_offset(len(distinct))
        for chunk, present, key in distinct[offset:] + distinct[:offset]:
            if key in self._fns:
                continue  # compiled ahead, on stand-ins (`compile_ahead`)
            fn = self._new_chunk_fn(chunk)
            self._fns[key] = fn
            # Copies as Parameters: Dynamo's guards check the tensor type too.
            params = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in present]
            for p, real in zip(params, present):
                p.grad = real.grad.detach().clone()
            states = [
                {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
                for state in self._states(present)
            ]
            with torch.no_grad():
                self._run(chunk, fn, params=params, states=states)
        if self.clip_max_norm is not None:
            params, max_norm = self._params, self.clip_max_norm
            self._clip = self.events.compile(
                lambda: torch.nn.utils.clip_grad_norm_(params, max_norm),
                self._recording("clip"),
                isolate_recompiles=True,
            )
            saved = [p.grad.detach().clone() if p.grad is not None else None for p in params]
            self._clip()  # compiles; scales the gradients, which are restored below
            for p, g in zip(params, saved):
                if g is not None:
                    p.grad.copy_(g)
        reused = sum(1 for r in self.records if r["reused_from"] is not None)
        say(
            "optimizer update: %d chunk(s), %d compiled, %d reused; %.2f s",
            len(self._chunks),
            len(self._chunks) - reused,
            reused,
            time.perf_counter() - start,
        )

    def compile_ahead(self) -> int:
        """Compile each distinct chunk before update 1, on stand-ins (`stand_ins`); returns how many.

        For a job whose model compiles as one graph: one rank compiles the model while the others wait for
        it, and a rank about to wait runs this first (offered by the step: compile_core/reuse/idle_work.py),
        on a core that would idle; through the chunks' claims the compiling rank loads them later. Update 1
        still runs eagerly; `_prepare` then compiles only the chunks whose real key differs."""
        if self._calls or self._fns:
            return 0
        start, compiled = time.perf_counter(), 0
        self._ahead = True
        try:
            compiled = self._compile_ahead_each()
        finally:
            self._ahead = False
        say(
            "optimizer update: %d distinct chunk(s) compiled ahead of update 1; %.2f s",
            compiled,
            time.perf_counter() - start,
        )
        return compiled

    def _compile_ahead_each(self) -> int:
        compiled = 0
        for chunk in self._chunks:
            params = [p for p in chunk.params if p.requires_grad]
            if not params:
                continue
            copies, states = stand_ins(self.optimizer, chunk.group, params)
            key = (chunk.group, self._signature(copies, states))
            if key in self._fns:
                continue
            fn = self._new_chunk_fn(chunk)
            with torch.no_grad():
                self._run(chunk, fn, params=copies, states=states)
            self._fns[key] = fn
            compiled += 1
        return compiled

    def _new_chunk_fn(self, chunk: Chunk) -> Callable[..., Any]:
        # Static shapes: every chunk runs the same function, and Dynamo made the second distinct chunk a
        # process compiled through it dynamic (automatic dynamic shapes). The graph, and its cache key, then
        # depended on which chunk a rank compiled first, so ranks that start apart missed each other's compile.
        return self.events.compile(
            UPDATES[type(self.optimizer)], self._recording(chunk.name), dynamic=False, isolate_recompiles=True
        )

    def _signature(self, params: list[torch.nn.Parameter], states: list[dict] | None = None) -> tuple:
        def meta(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type)
            return type(t).__name__

        states = self._states(params) if states is None else states
        return tuple(
            (meta(p), meta(p.grad), tuple(sorted((k, meta(v)) for k, v in state.items())))
            for p, state in zip(params, states)
        )

    def _recording(self, name: str) -> Callable[..., Any]:
        backend = self._backend
        backend_name = self._backend_name

        def compile_chunk(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
            def compile_it(job: Job) -> Compiled:
                with watch_caches() as cache:
                    fn = backend(job.gm, job.inputs)
                return Compiled(fn=fn, used_aot=True, backend=backend_name, cache=cache)

            job = Job(gm=gm, inputs=list(example_inputs), name=f"update.{name}")
            if self._once is not None:
                compiled = self._once.compile_all([job], ("optimizer", backend_name), compile_it)[0]
                self.records.append({**self._once.records[-1].to_dict(), "ahead": self._ahead})
                return compiled.fn
            start = time.perf_counter()
            compiled = compile_it(job)
            record = {
                "name": job.name,
                "cache": compiled.cache.describe(),
                "seconds": time.perf_counter() - start,
                "reused_from": None,
                "ahead": self._ahead,
            }
            self.records.append(record)
            say("%s compiled (%s) %.2f s", job.name, record["cache"], record["seconds"])
            return compiled.fn

        return compile_chunk

    # -- every update ------------------------------------------------------------------------------

    def _run(
        self,
        chunk: Chunk,
        fn: Callable[..., Any] | None,
        *,
        params: list | None = None,
        states: list[dict] | None = None,
    ) -> None:
        params = chunk.params if params is None else params
        if states is None:
            states = self._states(params)
        if fn is None or any(p.grad is None for p in params):
            # torch skips parameters without a gradient; so does this (rare) path, eagerly.
            kept = [(p, s) for p, s in zip(params, states) if p.grad is not None]
            if kept:
                UPDATES[type(self.optimizer)](*chunk_arguments(self.optimizer, chunk.group, *zip(*kept)))
            return
        fn(*chunk_arguments(self.optimizer, chunk.group, params, states))
