"""Progress the library reports while a rank runs, for whoever watches the process (a hang watchdog).

The library calls `report()` on every compiled-model and train-step call, and `report("compile")` right
before something long and silent (a compile), so a watchdog can tell a slow compile from a stuck rank.
The library knows no listener by name. A listener joins in one of two ways:

* `subscribe(fn)` in the same process: `fn(phase)` runs on every report;
* the environment variable `COMPILE_CORE_PROGRESS_LISTENERS`: comma-separated `module:function` names,
  imported at the first report. This is how a launcher that never imports the compile stack subscribes
  its ranks (`python -m launch` sets `launch.heartbeat:beat`), as `PYTHONBREAKPOINT` names a debugger.

A report costs one call per listener (none without listeners). A listener that raises is dropped with a
warning: progress reporting never stops training.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Callable

LISTENERS_ENV = "COMPILE_CORE_PROGRESS_LISTENERS"
"""Comma-separated `module:function` listeners imported at the first report (see the module docstring)."""

Listener = Callable[[str], None]
"""Called with the phase: "step" (progress) or "compile" (a long silent stretch begins)."""

log = logging.getLogger(__name__)

_listeners: list[Listener] = []
_from_env_loaded = False


def subscribe(listener: Listener) -> Callable[[], None]:
    """Call `listener(phase)` on every report from now on; returns a function that unsubscribes it."""
    if not callable(listener):
        raise TypeError(f"listener={listener!r} is not callable: pass a function taking the phase (a str)")
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def report(phase: str = "step") -> None:
    """This rank made progress (`phase` "step"), or starts something long and silent ("compile")."""
    if not _from_env_loaded:
        _load_from_env()
    for listener in tuple(_listeners):
        try:
            listener(phase)
        except Exception as exc:  # noqa: BLE001 - a broken listener must not stop training
            _listeners.remove(listener)
            log.warning(
                "compile_core: progress listener %r raised %s: %s; it is dropped", listener, type(exc).__name__, exc
            )


def _load_from_env() -> None:
    global _from_env_loaded
    _from_env_loaded = True
    for spec in filter(None, (s.strip() for s in os.environ.get(LISTENERS_ENV, "").split(","))):
        module, _, name = spec.partition(":")
        try:
            listener = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            log.warning(
                "compile_core: %s=%r: cannot load %r (%s); ignored", LISTENERS_ENV, os.environ[LISTENERS_ENV], spec, exc
            )
            continue
        subscribe(listener)
