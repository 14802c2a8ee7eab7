"""A rank that compiles in parallel with others, then waits for its turn to be timed alone (torch-free).

The GPU benchmark (benchmarks/gpu.py) starts every mode's job at once so the cold compiles share the machine's
cores, and times the steady steps of one job at a time, so no timed step shares the GPU. Between the two a job
waits here: after its warm-up steps the worker calls `Gate.arrive` (writes `ready.json` with what it measured
so far), then `Gate.wait` until the orchestrator writes `go` (time this job now) or `stop` (no time left: leave
without timing). Files, not pipes: the worker is a subprocess of the runner, and a file survives either side
being slow; polling every 20 ms costs nothing next to a compile.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

POLL_S = 0.02


class GateStopped(RuntimeError):
    """The orchestrator told a waiting job to leave without timing its steps (out of time)."""


class Gate:
    """One job's gate directory: `ready.json` (worker -> orchestrator), `go` / `stop` (orchestrator -> worker)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    # -- the worker's side -----------------------------------------------------------------------------
    def arrive(self, info: dict[str, Any]) -> None:
        """Say the warm-up is done (atomically: the orchestrator never reads half a file)."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / "ready.json.tmp"
        tmp.write_text(json.dumps(info))
        tmp.replace(self.path / "ready.json")

    def wait(self, timeout_s: float) -> float:
        """Block until `go`; return the seconds waited. Raises GateStopped on `stop`, TimeoutError after
        `timeout_s` (the runner's own timeout kills the job anyway; this names the cause)."""
        t0 = time.monotonic()
        while True:
            if (self.path / "stop").exists():
                raise GateStopped("the GPU benchmark stopped this job before its timed steps (out of time)")
            if (self.path / "go").exists():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"no 'go' in {self.path} within {timeout_s:.0f}s")
            time.sleep(POLL_S)

    # -- the orchestrator's side ---------------------------------------------------------------------------
    def ready(self) -> dict[str, Any] | None:
        """What the worker wrote on arrival, or None while it is still warming up."""
        try:
            return json.loads((self.path / "ready.json").read_text())
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "go").touch()

    def stop(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "stop").touch()
