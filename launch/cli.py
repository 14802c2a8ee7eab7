"""``python -m launch``: run a DDP (+ torch.compile) script on N ranks through the torchx runner.

Why not just ``torchrun``: the same job must run locally, on slurm and on kubernetes, so it is expressed
once as a torchx AppDef (``launch.components.trainer``) and this CLI only picks sensible local defaults
(GPU count or 2 gloo ranks), streams the ranks' output, and turns a failure into one readable line that
names the failing rank and its exception. Three guarantees matter to users:

* bad input (missing script, ``--nproc-per-node 0``, malformed ``-j``, unknown scheduler) is a one-line
  error with exit code 2, before any process starts;
* a failing job exits non-zero and prints which rank failed first and its root-cause exception;
* Ctrl-C / SIGTERM stops every rank: the torchx app is cancelled (torchrun forwards SIGTERM to its ranks),
  then any process still carrying this run's marker in its environment is killed.

Nothing from the compile stack (compile_core, ddp, aot, inductor) and not even torch is imported here:
the launcher must start fast and must not depend on the code it launches.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from typing import Optional, Sequence

USAGE_EXIT = 2
# Environment marker carried by every process of one launch; used to find stragglers after a stop.
RUN_MARKER_ENV = "DDP_LAUNCH_RUN_ID"
_NNODES_RE = re.compile(r"^(\d+)(?::(\d+))?$")
_J_RE = re.compile(r"^(?:(\d+)(?::(\d+))?x)?(\d+)$")


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + error; we want one line
        raise UsageError(f"{message} (see python -m launch --help)")


class _Stop(Exception):
    """Raised in the main thread by our SIGINT/SIGTERM handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """A validated launch request (everything needed to build the AppDef and run it)."""

    target: str
    """Script path, or module name when `module` is set."""
    module: bool = False
    """Run `target` as `python -m target`."""
    script_args: tuple[str, ...] = ()
    """Arguments passed through to the script."""
    nnodes: str = "1"
    """Node count `N` or elastic range `MIN:MAX`."""
    nproc_per_node: int = 2
    """Ranks per node."""
    dist_backend: str = "gloo"
    """Process-group backend handed to the script (DDP_COMPILE_BACKEND)."""
    scheduler: str = "local_cwd"
    """torchx scheduler name."""
    scheduler_cfg: str = ""
    """Scheduler run options, `key=value,key=value` (torchx `-cfg`)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for every rank."""
    max_retries: int = 0
    """Scheduler retries."""
    rdzv_port: int = 29500
    """Rendezvous port on the rank-0 host (multi-node)."""
    log_dir: Optional[str] = None
    """Where the local scheduler keeps per-rank logs (kept after the run); temporary when unset."""
    inductor_cache_dir: Optional[str] = None
    """Per-node Inductor cache dir; default ${TMPDIR:-/tmp}/ddp_compile_inductor_$UID."""
    torch_logs: Optional[str] = None
    """TORCH_LOGS for every rank."""
    trace_dir: Optional[str] = None
    """TORCH_TRACE directory for every rank."""
    dry_run: bool = False
    """Print what would run; start nothing."""

    def __post_init__(self) -> None:
        if not self.module and not os.path.isfile(self.target):
            raise UsageError(f"script {self.target!r} does not exist; pass a path to a .py file (or -m MODULE)")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node {self.nproc_per_node}: must be >= 1 (or 'auto')")
        m = _NNODES_RE.match(self.nnodes)
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise UsageError(f"--nnodes {self.nnodes!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")
        if self.dist_backend not in ("gloo", "nccl"):
            raise UsageError(f"--dist-backend {self.dist_backend!r}: expected auto, gloo or nccl")
        if not 0 < self.rdzv_port < 65536:
            raise UsageError(f"--rdzv-port {self.rdzv_port}: expected a TCP port in 1..65535")
        if self.max_retries < 0:
            raise UsageError(f"--max-retries {self.max_retries}: must be >= 0")

    @property
    def j(self) -> str:
        return f"{self.nnodes}x{self.nproc_per_node}"


def visible_gpus() -> int:
    """GPUs this host would give to ranks, without importing torch (the launcher must start fast)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids = [x for x in cvd.split(",") if x.strip()]
        # CUDA stops enumerating at the first invalid id (e.g. -1), as the runtime does
        count = 0
        for x in ids:
            if x.strip().startswith("-"):
                break
            count += 1
        return count
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def _build_parser() -> _Parser:
    p = _Parser(
        prog="python -m launch",
        description="Run a DDP training script on N ranks via torchx (torchrun on each node).",
    )
    p.add_argument("--nnodes", default=None, help="nodes: N or MIN:MAX (elastic); default 1")
    p.add_argument("--nproc-per-node", default=None, help="ranks per node, or 'auto' (default): GPUs, else 2 on CPU")
    p.add_argument("-j", dest="j", default=None, help="torchx style [MIN:]NNODESxNPROC, instead of --nnodes/--nproc-per-node")
    p.add_argument("--dist-backend", default="auto", help="auto (nccl with GPUs, else gloo), gloo or nccl")
    p.add_argument("--scheduler", "-s", default="local_cwd", help="torchx scheduler (default local_cwd)")
    p.add_argument("--scheduler-cfg", "--cfg", default="", help="scheduler options key=value,key=value")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and scheduler request; run nothing")
    p.add_argument("--log-dir", default=None, help="keep per-rank logs here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every rank (repeatable)")
    p.add_argument("--max-retries", type=int, default=0)
    p.add_argument("--rdzv-port", type=int, default=None, help="rendezvous port for multi-node (default: a free port locally, 29500 remote)")
    p.add_argument("--inductor-cache-dir", default=None,
                   help="per-node Inductor cache, forced to mode 0700 (default: $TORCHINDUCTOR_CACHE_DIR locally, "
                        "else ${TMPDIR:-/tmp}/ddp_compile_inductor_$UID)")
    p.add_argument("--torch-logs", default=None, help="TORCH_LOGS for every rank, e.g. graph_breaks,recompiles")
    p.add_argument("--trace-dir", default=None, help="TORCH_TRACE dir (tlparse) for every rank")
    p.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    return p


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def _known_schedulers() -> list[str]:
    from torchx.schedulers import get_scheduler_factories

    return sorted(get_scheduler_factories())


def parse_args(argv: Sequence[str]) -> LaunchConfig:
    """Command line -> validated LaunchConfig; raises UsageError on any bad input."""
    ns = _build_parser().parse_args(list(argv))
    if ns.j is not None and (ns.nnodes is not None or ns.nproc_per_node is not None):
        raise UsageError("-j replaces --nnodes/--nproc-per-node; pass one or the other")
    nnodes, nproc = ns.nnodes or "1", ns.nproc_per_node or "auto"
    if ns.j is not None:
        m = _J_RE.match(ns.j)
        if not m:
            raise UsageError(f"-j {ns.j!r}: expected NPROC, NNODESxNPROC or MIN:MAXxNPROC (e.g. 1x2, 1:4x8)")
        lo, hi, nproc = m.group(1), m.group(2), m.group(3)
        nnodes = f"{lo}:{hi}" if hi else (lo or "1")
    gpus = visible_gpus()
    if nproc == "auto":
        nproc_n = gpus if gpus > 0 else 2
    else:
        try:
            nproc_n = int(nproc)
        except ValueError:
            raise UsageError(f"--nproc-per-node {nproc!r}: expected a positive integer or 'auto'") from None
    backend = ns.dist_backend
    if backend == "auto":
        backend = "nccl" if gpus >= nproc_n else "gloo"
    schedulers = _known_schedulers()
    if ns.scheduler not in schedulers:
        raise UsageError(f"--scheduler {ns.scheduler!r} is unknown; choose one of {', '.join(schedulers)}")
    local = ns.scheduler.startswith("local")
    rdzv_port = ns.rdzv_port if ns.rdzv_port is not None else (_free_port() if local else 29500)
    return LaunchConfig(
        target=ns.script,
        module=ns.module,
        script_args=tuple(ns.script_args),
        nnodes=nnodes,
        nproc_per_node=nproc_n,
        dist_backend=backend,
        scheduler=ns.scheduler,
        scheduler_cfg=ns.scheduler_cfg,
        env=_parse_env(ns.env),
        max_retries=ns.max_retries,
        rdzv_port=rdzv_port,
        log_dir=ns.log_dir,
        # locally, an Inductor cache the user already chose is kept (still forced private by the prelude)
        inductor_cache_dir=ns.inductor_cache_dir or (os.environ.get("TORCHINDUCTOR_CACHE_DIR") if local else None),
        torch_logs=ns.torch_logs,
        trace_dir=ns.trace_dir,
        dry_run=ns.dry_run,
    )


def build_app(cfg: LaunchConfig, run_id: str):
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


def find_failures(log_root: str) -> list[dict]:
    """Per-rank failure records under a local log dir, earliest (= root cause) first."""
    from launch.worker import FAILURE_FILE

    failures = []
    for path in glob.glob(os.path.join(log_root, "**", FAILURE_FILE), recursive=True):
        try:
            with open(path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue
        info["path"] = path
        failures.append(info)
    if not failures:  # scripts launched without launch.worker but decorated with @record themselves
        for path in glob.glob(os.path.join(log_root, "**", "attempt_*", "*", "error.json"), recursive=True):
            try:
                with open(path) as f:
                    msg = json.load(f)["message"]
                local_rank = int(os.path.basename(os.path.dirname(path)))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(msg, str):  # the error file's message is a dict or, for some writers, a string
                msg = {"message": msg, "extraInfo": {}}
            failures.append({
                "rank": local_rank, "local_rank": local_rank, "host": "?", "time": os.path.getmtime(path),
                "exception": msg.get("message", "?"),
                "traceback": msg.get("extraInfo", {}).get("py_callstack", ""), "path": path,
            })
    return sorted(failures, key=lambda f: f.get("time", 0.0))


def report_failure(failures: list[dict], status_text: str, log_dir: Optional[str]) -> None:
    """Print which rank failed first and its exception (stderr), then the other failing ranks."""
    err = sys.stderr
    if not failures:
        print(f"launch: job FAILED; no rank recorded an exception (a rank may have been killed). {status_text}", file=err)
        return
    first = failures[0]
    print(f"launch: job FAILED: rank {first['rank']} (local rank {first['local_rank']} on {first['host']}) "
          f"raised {first['exception']}", file=err)
    print(f"launch: rank {first['rank']} traceback:", file=err)
    for line in first.get("traceback", "").rstrip().splitlines():
        print(f"  [rank{first['rank']}] {line}", file=err)
    for other in failures[1:]:
        print(f"launch: rank {other['rank']} also failed (later): {other['exception']}", file=err)
    if log_dir:
        print(f"launch: per-rank logs under {log_dir}", file=err)


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
    return url[len("file://"):] if url.startswith("file://") else None


def run(cfg: LaunchConfig) -> int:
    """Run the job to completion; return the process exit code."""
    from torchx.runner import get_runner

    run_id = uuid.uuid4().hex
    app = build_app(cfg, run_id)
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
        return _run_and_watch(runner, app, cfg, run_cfg, run_id)
    finally:
        runner.close()


def _run_and_watch(runner, app, cfg: LaunchConfig, run_cfg: dict, run_id: str) -> int:
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
        print(f"launch: {handle} ({role.num_replicas} node(s) x {cfg.nproc_per_node} ranks, {cfg.dist_backend})",
              file=sys.stderr, flush=True)
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
        if status is not None and status.state == AppState.SUCCEEDED:
            return 0
        log_root = _local_log_root(status)
        failures = find_failures(log_root) if log_root else []
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
