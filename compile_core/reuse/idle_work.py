"""Work a rank may do while it waits for another rank's compile (`CompileOnce`, Note [Compile once]).

In a job whose model compiles as one graph, one rank compiles it and the others wait for its cache entry,
their cores idle. A train step offers what it will need soon and can compile on its own (the optimizer
update, on stand-ins: `ChunkedUpdate.compile_ahead`) to its model's `IdleWork`; a rank about to wait in that
model's compile runs what is on offer first. A rank that never waits (the one compiling, or any rank of a
warm start) runs none of it and compiles that work where it needs it, as without this. The offers belong to
one compiled model (`CompileState.idle_work`) and live as long as it does; each runs at most once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from aot.torch_aot import outside_any_compile

log = logging.getLogger(__name__)


class IdleWork:
    """The work on offer to the waits of one compiled model's compile (see the module docstring)."""

    def __init__(self) -> None:
        self._offers: dict[str, Callable[[], Any]] = {}
        self._lock = threading.Lock()

    def offer(self, name: str, work: Callable[[], Any]) -> None:
        """Offer `work` (replacing an offer of the same name) to the next wait for another rank's compile."""
        with self._lock:
            self._offers[name] = work

    def withdraw(self, name: str) -> bool:
        """Take back the offer `name` if it has not run; True when it was still on offer."""
        with self._lock:
            return self._offers.pop(name, None) is not None

    def run_offered(self) -> list[str]:
        """Run every offer once (called by a rank about to wait); returns the names that ran. A failure is
        logged, not raised: the work is done again where it is needed."""
        with self._lock:
            offers = list(self._offers.items())
            self._offers.clear()
        ran = []
        for name, work in offers:
            try:
                with outside_any_compile():  # the caller waits inside a backend, its fake mode active
                    work()
            except Exception as err:  # noqa: BLE001 - an optional head start; the step redoes it
                log.info(
                    "compile_core: %s, tried while waiting, failed (%s: %s); done later", name, type(err).__name__, err
                )
            else:
                ran.append(name)
        return ran
