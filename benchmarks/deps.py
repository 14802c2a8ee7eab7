"""What `python -m benchmarks` needs, checked before any job runs (a missing package must not fail a run
after minutes of measurements). `find_spec` locates a package without importing it: the check takes
milliseconds, torch included."""

from __future__ import annotations

import importlib.util

REQUIRED: dict[str, str] = {
    "torch": "pip install torch==2.13.0 (first, pinned: see README)",
    "compile_core": "run from the repository root, or pip install -e .",
    "ddp": "run from the repository root, or pip install -e .",
    "examples": "run from the repository root (examples/gpt.py is the benchmark's model)",
}
"""Module -> how to get it, for every run."""

FOR_PLOTS: dict[str, str] = {
    "matplotlib": 'pip install -e ".[bench]" (or pip install matplotlib), or pass --no-plot',
}
"""Module -> how to get it, when the run draws the chart and the overlap timelines."""


def missing(*, plot: bool) -> list[str]:
    """One line per missing module: its name and how to get it (empty when everything is there)."""
    wanted = dict(REQUIRED)
    if plot:
        wanted.update(FOR_PLOTS)
    out = []
    for module, fix in wanted.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(f"{module} is not importable: {fix}")
    return out
