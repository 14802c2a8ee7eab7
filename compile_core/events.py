"""`CompileEvents`: one recorder of what Dynamo compiled, why, and how long it took.

Both parts of a train step (the model and the optimizer update) are compiled through
`CompileEvents.compile`, which wraps their backend, and every call of the compiled function runs
inside `CompileEvents.call()`. Every graph Dynamo hands the backend is one event: it is timed, and
a graph break that caused it is noted with its user file:line. The guard failures Dynamo reports
(one per cached entry that no longer matched, just before it compiles again) are folded into one
recompile per call that compiled something, with their reasons: one call that recompiles three
frames of an optimizer step, or three cached entries failing before one new compile, is one
recompile. Breaks that produce no graph of their own (a skipped frame, code Dynamo runs eagerly) are
only visible in Dynamo's counters: `count_breaks()` collects those around a call.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

from aot.torch_dynamo import break_counters, compile_with_guard_hook, graph_break_of
from compile_core import progress
from compile_core.recompile_reasons import EntryNames
from compile_core.reuse.compile_once import say

Backend = Callable[..., Callable[..., Any]]


class CompileEvents:
    """What was compiled for one callable; filled by the backend wrapper and Dynamo's guard hook."""

    def __init__(self, *, breaks_from: str = "graphs", name: str = "model") -> None:
        if breaks_from not in ("graphs", "counters"):
            raise ValueError(f"breaks_from={breaks_from!r}: use 'graphs' or 'counters'")
        self.name = name
        """What is compiled (`model`, `optimizer update`), for the progress summary line."""
        self._calls = 0
        self.breaks_from = breaks_from
        """'graphs': a break is read off each graph Dynamo hands us (with file:line); 'counters': only
        through `count_breaks()` (also sees breaks that produce no graph, e.g. in optimizer.step)."""
        self.expected_switch: Callable[[], bool] | None = None
        """Asked at each guard failure: True when the call is a deliberate switch (the first call in an
        in-graph variant), whose compiles are expected, not recompiles."""
        self.lock = threading.Lock()
        self.graphs = 0
        """Graphs the backend compiled (a split graph counts once)."""
        self.backend_seconds = 0.0
        """Wall time spent inside the backend (AOTAutograd tracing, splitting, codegen)."""
        self.compile_seconds = 0.0
        """Wall time of the calls that compiled something (Dynamo tracing + backend + that call's run);
        the same as `backend_seconds` for graphs compiled outside `call()`."""
        self.recompiles: list[dict[str, Any]] = []
        """One `{"reason", "where", **label}` per compile that followed failed guards."""
        self.graph_breaks: list[dict[str, str]] = []
        """`{"reason", "where"}` per graph break (`where` is absent for counter-only breaks)."""
        self.label: dict[str, Any] = {}
        """Keys added to every recompile noted from now on (e.g. `{"update": 3}`)."""
        self._guard_failures: list[tuple[str, str]] = []
        self._entry: EntryNames | None = None
        self._graphs_at_call_start: int | None = None

    # -- wiring --------------------------------------------------------------------------------------

    def compile(
        self,
        fn: Callable[..., Any],
        backend: Backend,
        *,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        isolate_recompiles: bool = False,
        on_compiled: Callable[[float], None] | None = None,
        guard_module_hooks: bool = False,
        runs: Any = None,
    ) -> Callable[..., Any]:
        """`fn` compiled by Dynamo with `backend`, every event recorded here (`guard_module_hooks`: see
        `compile_with_guard_hook`). `runs`: the module `fn` calls as it is called, whose `forward` and
        parameter names its recompiles are reported in (compile_core/recompile_reasons.py)."""
        if runs is not None:
            self._entry = EntryNames.of(fn, runs)
        return compile_with_guard_hook(
            fn,
            self.wrap(backend, on_compiled=on_compiled),
            on_guard_fail=self.on_guard_fail,
            fullgraph=fullgraph,
            dynamic=dynamic,
            isolate_recompiles=isolate_recompiles,
            guard_module_hooks=guard_module_hooks,
        )

    def record(self, build: Callable[[], Any]) -> Any:
        """`build()`, a compile made without Dynamo, timed and counted as one graph."""
        return self.wrap(lambda _graph, _inputs: build())(None, [])

    def wrap(self, backend: Backend, *, on_compiled: Callable[[float], None] | None = None) -> Backend:
        """A backend that records each graph, then calls `backend`; `on_compiled(seconds)` after each."""

        def recorded(gm: Any, example_inputs: list) -> Callable[..., Any]:
            progress.report("compile")  # a launcher watching for hangs gives compiles its long grace
            start = time.perf_counter()
            if self._graphs_at_call_start is None:  # compiled outside `call()`: fold right away
                self._fold_guard_failures()
            brk = graph_break_of(gm) if self.breaks_from == "graphs" else None
            if brk is not None:
                with self.lock:
                    self.graph_breaks.append(brk)
            compiled = backend(gm, example_inputs)
            seconds = time.perf_counter() - start
            # Counted once compiled: a backend error makes Dynamo retry the same graph, not a new one.
            with self.lock:
                self.graphs += 1
                self.backend_seconds += seconds
                if self._graphs_at_call_start is None:
                    self.compile_seconds += seconds
            if on_compiled is not None:
                on_compiled(seconds)
            return compiled

        return recorded

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One call of the compiled function: the guard failures it met become one recompile."""
        outer = self._graphs_at_call_start is not None
        if not outer:
            self._graphs_at_call_start = self.graphs
        start = time.perf_counter()
        if not outer:
            self._calls += 1
        try:
            yield
        finally:
            if not outer:
                new_graphs = self.graphs - self._graphs_at_call_start
                self._graphs_at_call_start = None
                if new_graphs:
                    seconds = time.perf_counter() - start
                    with self.lock:
                        self.compile_seconds += seconds
                    self._fold_guard_failures()
                    say(
                        "%s: call %d compiled %d graph(s) in %.2f s (first-run time included)",
                        self.name,
                        self._calls,
                        new_graphs,
                        seconds,
                    )
                else:
                    with self.lock:
                        self._guard_failures.clear()

    def on_guard_fail(self, reason: str, where: str) -> None:
        if self.expected_switch is not None and self.expected_switch():
            return
        if self._entry is not None:  # another frame's failure (a resumed frame, in the user's names) stays
            reason, where = self._entry.translate(reason, where)
        with self.lock:
            self._guard_failures.append((reason, where))

    @contextlib.contextmanager
    def count_breaks(self) -> Iterator[None]:
        """Record the breaks Dynamo counted during the block (first line of each message)."""
        before = break_counters()
        try:
            yield
        finally:
            new = [
                {"reason": _first_line(reason)}
                for reason, count in break_counters().items()
                if count > before.get(reason, 0)
            ]
            with self.lock:
                self.graph_breaks.extend(new)

    @contextlib.contextmanager
    def count_skipped_frames(self) -> Iterator[None]:
        """Record breaks Dynamo counted in the block that left no graph behind (in "graphs" mode).

        A graph break Dynamo cannot resume from (e.g. inside a loop) makes it skip the whole frame
        and run it eagerly: no graph reaches the backend, only Dynamo's counters know.
        """
        if self.breaks_from != "graphs":
            yield
            return
        before, recorded = break_counters(), len(self.graph_breaks)
        try:
            yield
        finally:
            after = break_counters()
            if after != before and len(self.graph_breaks) == recorded:
                new = [
                    {"reason": _first_line(reason), "where": "(no graph: Dynamo ran the frame eagerly)"}
                    for reason, count in after.items()
                    if count > before.get(reason, 0)
                ]
                with self.lock:
                    self.graph_breaks.extend(new)

    # -- internals -----------------------------------------------------------------------------------

    def _fold_guard_failures(self) -> None:
        with self.lock:
            pending, self._guard_failures = self._guard_failures, []
            if pending:
                reasons = list(dict.fromkeys(reason for reason, _ in pending))
                self.recompiles.append({"reason": "; ".join(reasons), "where": pending[0][1], **self.label})


def _first_line(message: str) -> str:
    # Dynamo's message starts with the kind of break (its `gb_type`); the rest (explanation, hints,
    # developer context) is text for people that torch keeps in no field of its own: not parsed here.
    lines = message.strip().splitlines()
    return lines[0] if lines else message
