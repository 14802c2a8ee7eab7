"""What the compile caches did during one compile: the private counters and records of AOTAutograd's
and Inductor's caches, in one place (a home of private torch internals, like `aot/torch_dynamo.py`).

Each function says which torch 2.13 file it mirrors; `tests/single/test_torch_internals_dynamo.py` has its
canary. `aot/torch_dynamo.py` holds Dynamo's and AOTAutograd's graph internals; this module only
watches the caches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
from typing import Any, Iterator

_AOT_CACHE_LOGGER = "torch._functorch._aot_autograd.autograd_cache"
"""Where AOTAutogradCache logs its bypasses (`_aot_autograd/autograd_cache.py`, `log`)."""


class AotCache(str, enum.Enum):
    """What AOTAutogradCache did for one compile (decisions read this; `CacheOutcome.describe()` is for people)."""

    HIT = "hit"
    MISS = "miss"
    BYPASS = "bypass"
    UNUSED = ""
    """Not consulted (aot_eager, caches off), or nothing compiled (a reused piece)."""


@dataclasses.dataclass
class CacheOutcome:
    """What the compile caches did during one compile (see `watch_caches`)."""

    aot: AotCache = AotCache.UNUSED
    """AOTAutogradCache's outcome (compares equal to "hit", "miss", "bypass", "")."""
    fx_hits: int = 0
    """Inductor FX graph cache hits (a forward and a backward loaded from an AOT entry count too)."""
    fx_misses: int = 0
    """Inductor FX graph cache misses (graphs lowered and generated)."""
    fx_bypasses: int = 0
    """Graphs Inductor could not cache."""
    reason: str | None = None
    """Why AOTAutogradCache bypassed, in its own words (for people)."""

    @property
    def traced(self) -> bool:
        """Whether AOTAutograd traced the graph (everything but an AOT cache hit)."""
        return self.aot is not AotCache.HIT

    def describe(self) -> str:
        """`aot cache hit`, `aot cache miss, fx cache 1 hit 1 miss`, `aot cache bypass (reason)`."""
        if self.aot is AotCache.UNUSED and not (self.fx_hits or self.fx_misses or self.fx_bypasses):
            return "no disk cache"
        parts = [f"aot cache {self.aot.value or 'not used'}" + (f" ({self.reason})" if self.reason else "")]
        if self.aot is not AotCache.HIT:
            counts = ((self.fx_hits, "hit"), (self.fx_misses, "miss"), (self.fx_bypasses, "bypass"))
            fx = [f"{n} {word}" for n, word in counts if n]
            if fx:
                parts.append("fx cache " + " ".join(fx))
        return ", ".join(parts)


class _BypassErrors(logging.Handler):
    """The exceptions AOTAutogradCache bypassed for, taken from its log records' arguments.

    Mirrors `AOTAutogradCache.try_load` and `_handle_save_error` (`_aot_autograd/autograd_cache.py`):
    each counts a bypass (`counters["aot_autograd"]["autograd_cache_bypass"] += 1`) and right after
    logs `log.info("Bypassing autograd cache due to: %s", e)`, the exception as the record's one
    argument. Torch 2.13 keeps that exception nowhere else we can read cheaply: its copies in the
    structured trace (`aotautograd_cache_bypass`) and the chromium event log are only written while
    those traces are on, and turning them on costs every compile. So the record that follows a new
    bypass count gives its exception object; the formatted text is never read.
    """

    def __init__(self, aot_counters: Any) -> None:
        super().__init__(logging.INFO)
        self._counters = aot_counters
        self._bypasses_seen = aot_counters.get("autograd_cache_bypass", 0)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        bypasses = self._counters.get("autograd_cache_bypass", 0)
        if bypasses == self._bypasses_seen:
            return
        self._bypasses_seen = bypasses
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 1 and isinstance(args[0], BaseException):
            self.errors.append(args[0])


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


@contextlib.contextmanager
def watch_caches() -> Iterator[CacheOutcome]:
    """The cache outcome of the compile inside the block, from Dynamo's counters.

    Mirrors `torch._dynamo.utils.counters["aot_autograd"]` (`autograd_cache_hit/miss/bypass`,
    `_aot_autograd/autograd_cache.py`) and `counters["inductor"]` (`fxgraph_cache_*`,
    `_inductor/codecache.py`). The bypass reason is the exception AOTAutogradCache logs at INFO
    (`_BypassErrors`); when that logger is not already enabled for INFO, its records go only to us
    meanwhile.
    """
    from torch._dynamo.utils import counters

    aot_before = dict(counters["aot_autograd"])
    fx_before = dict(counters["inductor"])
    logger = logging.getLogger(_AOT_CACHE_LOGGER)
    handler = _BypassErrors(counters["aot_autograd"])
    saved = (logger.level, logger.propagate)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.addHandler(handler)
    outcome = CacheOutcome()
    try:
        yield outcome
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]

        def delta(table: Any, before: dict, key: str) -> int:
            return table.get(key, 0) - before.get(key, 0)

        aot = counters["aot_autograd"]
        for state in (AotCache.HIT, AotCache.MISS, AotCache.BYPASS):  # one AOT compile per watch: at most one
            if delta(aot, aot_before, f"autograd_cache_{state.value}"):
                outcome.aot = state
        fx = counters["inductor"]
        outcome.fx_hits = delta(fx, fx_before, "fxgraph_cache_hit")
        outcome.fx_misses = delta(fx, fx_before, "fxgraph_cache_miss")
        outcome.fx_bypasses = delta(fx, fx_before, "fxgraph_cache_bypass")
        if outcome.aot is AotCache.BYPASS and handler.errors:
            outcome.reason = _first_line(handler.errors[-1])


def aot_cache_off() -> contextlib.AbstractContextManager:
    """AOTAutogradCache neither read nor written by the compiles inside the block.

    Mirrors `torch._functorch.config.enable_autograd_cache`, which AOTAutograd reads at every compile
    (`_aot_autograd/autograd_cache.py: should_use_local_autograd_cache`). The FX graph cache of Inductor's
    inner compiles stays on: it keys the graphs AOTAutograd produced, numbers baked in included.
    """
    import torch._functorch.config as functorch_config

    return functorch_config.patch(enable_autograd_cache=False)
