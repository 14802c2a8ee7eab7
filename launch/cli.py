"""``python -m launch``: run a DDP (+ torch.compile) script on N ranks through the torchx runner.

Why not just ``torchrun``: the same job must run locally, on slurm and on kubernetes, so it is expressed
once as a torchx AppDef (``launch.components.trainer``) and this CLI only picks sensible local defaults
(GPU count or 2 gloo ranks), streams the ranks' output, and turns a failure into one readable line that
names the failing rank and its reason. Four guarantees matter to users:

* bad input (missing script, ``--nproc-per-node 0``, malformed ``-j``, unknown scheduler, ``--hang-timeout
  0``) is a one-line error with exit code 2, before any process starts (``launch.args``);
* a failing job exits 1 and prints which rank failed first and why: its exception, the signal that killed
  it, or its exit code (``launch.failures``);
* with ``--hang-timeout``, a job whose ranks all stop making progress is stopped, exit code 3, naming the
  stuck rank, its host and its Python stack (``launch.watchdog``, ``launch.heartbeat``);
* Ctrl-C / SIGTERM stops every rank: the torchx app is cancelled (torchrun forwards SIGTERM to its ranks),
  then any process still carrying this run's marker in its environment is killed (``launch.run``).

This module is the thin entry point; it re-exports the pieces callers and tests use. Nothing from the
compile stack (compile_core, ddp, aot, inductor) and not even torch is imported: the launcher must start
fast and must not depend on the code it launches.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from launch.args import USAGE_EXIT, LaunchConfig, UsageError, parse_args, visible_gpus
from launch.failures import find_exits, find_failures, order_failures, report_failure
from launch.run import RUN_MARKER_ENV, build_app, reap, run
from launch.watchdog import HANG_EXIT

__all__ = [
    "HANG_EXIT",
    "RUN_MARKER_ENV",
    "USAGE_EXIT",
    "LaunchConfig",
    "UsageError",
    "build_app",
    "find_exits",
    "find_failures",
    "main",
    "order_failures",
    "parse_args",
    "reap",
    "report_failure",
    "run",
    "visible_gpus",
]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(argv)
    except UsageError as exc:
        print(f"launch: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    try:
        return run(cfg)
    except ValueError as exc:  # e.g. a component argument torchx rejects, before anything started
        print(f"launch: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
