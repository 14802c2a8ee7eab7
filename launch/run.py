"""Running a launch: build the AppDef, start it through the torchx runner, stream the ranks' output, wait,
report a failure or a hang, and stop every process on a signal.

Exit codes of ``run``: 0 success, 1 a rank failed, ``HANG_EXIT`` (3) the watchdog stopped a hung job,
128 + N stopped by signal N (Ctrl-C: 130, SIGTERM: 143). Nothing here imports torch.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from typing import Optional

from launch.args import LaunchConfig
from launch.failures import find_exits, find_failures, order_failures, report_failure, report_hang
from launch.restarts import find_restarts, report_restarts
from launch.watchdog import HANG_EXIT, read_verdict

# Environment marker carried by every process of one launch; used to find stragglers after a stop.
RUN_MARKER_ENV = "DDP_LAUNCH_RUN_ID"


class _Stop(Exception):
    """Raised in the main thread by our SIGINT/SIGTERM handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def heartbeat_dir(cfg: LaunchConfig, run_id: str) -> Optional[str]:
    """Where this run's ranks beat, when hang detection is on and the ranks run on this host.

    Under --log-dir it is kept (records and every rank's stack dump are evidence); otherwise it is a temp
    dir removed after the run. Remote schedulers get none: each node's watchdog makes its own.
    """
    if cfg.hang_timeout is None or cfg.scheduler != "local_cwd":
        return None
    if cfg.log_dir:
        return os.path.join(os.path.abspath(cfg.log_dir), f"heartbeat-{run_id[:12]}")
    return os.path.join(tempfile.gettempdir(), f"ddp_launch_heartbeat-{run_id[:12]}")


def build_app(cfg: LaunchConfig, run_id: str, hb_dir: Optional[str] = None):
    """The torchx AppDef for `cfg` (same component `torchx run launch/components.py:trainer` uses)."""
    from launch.components import trainer

    env = dict(cfg.env)
    env[RUN_MARKER_ENV] = run_id
    return trainer(
        *cfg.script_args,
        script=None if cfg.module else cfg.target,
        m=cfg.target if cfg.module else None,
        j=cfg.j,
        env=env,
        max_retries=cfg.max_retries,
        rdzv_port=cfg.rdzv_port,
        gpu=cfg.nproc_per_node if cfg.dist_backend == "nccl" else 0,
        dist_backend=cfg.dist_backend,
        inductor_cache_dir=cfg.inductor_cache_dir,
        torch_logs=cfg.torch_logs,
        trace_dir=cfg.trace_dir,
        hang_timeout=cfg.hang_timeout,
        hang_first_step_timeout=cfg.hang_first_step_timeout,
        heartbeat_dir=hb_dir,
        max_restarts=cfg.max_restarts,
        node_cache_dirs=cfg.node_cache_dirs,
        rdzv_endpoint=cfg.rdzv_endpoint,
        rdzv_id=(cfg.rdzv_id or "ddp_compile_" + "".join(c if c.isalnum() else "_" for c in cfg.rdzv_endpoint))
        if cfg.rdzv_endpoint
        else None,
    )


def _scheduler_cfg(runner, cfg: LaunchConfig) -> dict:
    opts = runner.scheduler_run_opts(cfg.scheduler)
    run_cfg = opts.cfg_from_str(cfg.scheduler_cfg) if cfg.scheduler_cfg else {}
    if cfg.log_dir and cfg.scheduler.startswith("local"):
        run_cfg["log_dir"] = cfg.log_dir
    return run_cfg


def _tail(runner, handle: str, role: str, replica: int, prefix: str, out_lock: threading.Lock) -> None:
    """Copy one node's combined log to stdout line by line (torchrun already prefixes [local_rank])."""
    from torchx.schedulers.api import Stream

    pending = ""
    try:
        for chunk in runner.log_lines(handle, role, replica, should_tail=True, streams=Stream.COMBINED):
            pending += chunk
            *lines, pending = pending.split("\n")
            if lines:
                with out_lock:
                    sys.stdout.write("".join(f"{prefix}{line}\n" for line in lines))
                    sys.stdout.flush()
    except Exception as exc:  # logs are best effort: the exit status is what the user relies on
        with out_lock:
            print(f"launch: log streaming for {role}/{replica} stopped: {exc}", file=sys.stderr)
    if pending:
        with out_lock:
            sys.stdout.write(f"{prefix}{pending}\n")
            sys.stdout.flush()


def reap(run_id: str) -> int:
    """SIGKILL any process of ours still carrying this run's marker; return how many there were."""
    needle = f"{RUN_MARKER_ENV}={run_id}".encode()
    killed = 0
    for pid_dir in glob.glob("/proc/[0-9]*"):
        pid = int(os.path.basename(pid_dir))
        if pid == os.getpid():
            continue
        try:
            with open(os.path.join(pid_dir, "environ"), "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            continue  # gone already, or not ours to read
    return killed


def _local_log_root(status) -> Optional[str]:
    url = getattr(status, "ui_url", None) or ""
    return url[len("file://") :] if url.startswith("file://") else None


def run(cfg: LaunchConfig) -> int:
    """Run the job to completion; return the process exit code."""
    from torchx.runner import get_runner

    run_id = uuid.uuid4().hex
    hb_dir = heartbeat_dir(cfg, run_id)
    app = build_app(cfg, run_id, hb_dir)
    role = app.roles[0]
    runner = get_runner()
    try:
        run_cfg = _scheduler_cfg(runner, cfg)
        if cfg.dry_run:
            prelude, _, torchrun = role.args[1].partition(" && exec ")
            print(f"torchrun command (run on each of {role.num_replicas} node(s)):\n  {torchrun}")
            print(f"after the Inductor cache prelude:\n  {prelude}")
            print("scheduler request:")
            print(runner.dryrun(app, cfg.scheduler, cfg=run_cfg))
            return 0
        if hb_dir:
            os.makedirs(hb_dir, mode=0o700, exist_ok=True)
        return _run_and_watch(runner, app, cfg, run_cfg, run_id, hb_dir)
    finally:
        runner.close()
        if hb_dir and not cfg.log_dir:
            shutil.rmtree(hb_dir, ignore_errors=True)


def _run_and_watch(runner, app, cfg: LaunchConfig, run_cfg: dict, run_id: str, hb_dir: Optional[str]) -> int:
    """Start the app, stream its logs until it ends, report a failure; stop everything on a signal."""
    from torchx.schedulers.local_scheduler import SignalException
    from torchx.specs import AppState

    role = app.roles[0]
    handle = None
    out_lock = threading.Lock()
    tails: list[threading.Thread] = []
    try:
        handle = runner.run(app, cfg.scheduler, cfg=run_cfg)
        # The local scheduler installs its own SIGINT/SIGTERM handlers while scheduling; ours come after
        # so that a stop always goes through the cancel-and-reap path below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_stop)
        hang_note = f", hang timeout {cfg.hang_timeout:g} s" if cfg.hang_timeout else ""
        print(
            f"launch: {handle} ({role.num_replicas} node(s) x {cfg.nproc_per_node} ranks, {cfg.dist_backend}"
            f"{hang_note})",
            file=sys.stderr,
            flush=True,
        )
        for k in range(role.num_replicas):
            prefix = f"node{k} " if role.num_replicas > 1 else ""
            t = threading.Thread(target=_tail, args=(runner, handle, role.name, k, prefix, out_lock), daemon=True)
            t.start()
            tails.append(t)
        status = runner.status(handle)
        while status is not None and not status.is_terminal():
            time.sleep(0.2)
            status = runner.status(handle)
        for t in tails:
            t.join(timeout=10)
        verdict = read_verdict(hb_dir) if hb_dir else None
        if verdict is not None:
            with out_lock:
                report_hang(verdict, hb_dir if cfg.log_dir else None)
            return HANG_EXIT
        log_root = _local_log_root(status)
        restarts, last_pids = find_restarts(log_root) if log_root and cfg.max_restarts else ([], set())
        with out_lock:
            report_restarts(restarts, cfg.max_restarts)
        if status is not None and status.state == AppState.SUCCEEDED:
            if restarts:
                print(f"launch: job SUCCEEDED after {len(restarts)} restart(s)", file=sys.stderr)
            return 0
        failures = order_failures(find_failures(log_root), find_exits(log_root)) if log_root else []
        if restarts:  # the job's end is the last attempt's doing; earlier attempts are reported above
            failures = [f for f in failures if f.get("kind") != "exception" or f.get("pid") in last_pids]
        status_text = f"(state {status.state.name if status else 'UNKNOWN'})"
        with out_lock:
            report_failure(failures, status_text, log_root if cfg.log_dir else None)
        return 1
    except (_Stop, KeyboardInterrupt, SignalException) as stop:
        # SignalException: torchx's own handler, in place while runner.run() is still scheduling
        signum = getattr(stop, "signum", None) or getattr(stop, "sigval", None) or signal.SIGINT
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not abort the cleanup
        print(f"launch: got {signal.Signals(signum).name}; stopping every rank", file=sys.stderr, flush=True)
        if handle is not None:
            try:
                runner.cancel(handle)
            except Exception as exc:  # still reap below
                print(f"launch: cancel failed: {exc}", file=sys.stderr)
        return 128 + int(signum)
    finally:
        leftovers = reap(run_id) if cfg.scheduler.startswith("local") else 0
        if leftovers:
            print(f"launch: killed {leftovers} leftover process(es) of this run", file=sys.stderr)


def _raise_stop(signum: int, frame) -> None:
    raise _Stop(signum)
