"""Work a rank may do while it waits for another rank's compile (`CompileOnce`, Note [Compile once]).

In a job whose model compiles as one graph, one rank compiles it and the others wait for its cache entry,
their cores idle. A step offers here what it will need soon and can compile on its own (the optimizer
update, on stand-ins: `ChunkedUpdate.compile_ahead`); a rank that is about to wait runs what is on offer
first. A rank that never waits (the one compiling, or any rank of a warm start) runs none of it and
compiles that work where it needs it, as without this. Offers are per process; each runs at most once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from aot.torch_dynamo import outside_any_compile

log = logging.getLogger(__name__)

_offers: dict[str, Callable[[], Any]] = {}
_lock = threading.Lock()


def offer(name: str, work: Callable[[], Any]) -> None:
    """Offer `work` (replacing an offer of the same name) to the next wait for another rank's compile."""
    with _lock:
        _offers[name] = work


def withdraw(name: str) -> bool:
    """Take back the offer `name` if it has not run; True when it was still on offer."""
    with _lock:
        return _offers.pop(name, None) is not None


def run_offered() -> list[str]:
    """Run every offer once (called by a rank about to wait); returns the names that ran. A failure is
    logged, not raised: the work is done again where it is needed."""
    with _lock:
        offers = list(_offers.items())
        _offers.clear()
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
