"""``python -m launch`` command line -> a validated ``LaunchConfig``; every bad input is a ``UsageError``.

Bad input must be one line on stderr with exit code 2, before anything is scheduled: argparse's own
error path (usage + message) is replaced, and every value is checked on construction of ``LaunchConfig``
so that programmatic callers get the same errors. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
from typing import Mapping, Optional, Sequence

from launch.net import free_port

USAGE_EXIT = 2
_NNODES_RE = re.compile(r"^(\d+)(?::(\d+))?$")
_J_RE = re.compile(r"^(?:(\d+)(?::(\d+))?x)?(\d+)$")


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + error; we want one line
        raise UsageError(f"{message} (see python -m launch --help)")


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
    """Process-group backend handed to the script (DDP_COMPILE_DIST_BACKEND)."""
    scheduler: str = "local_cwd"
    """torchx scheduler name."""
    scheduler_cfg: str = ""
    """Scheduler run options, `key=value,key=value` (torchx `-cfg`)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for every rank."""
    max_retries: int = 0
    """Scheduler retries."""
    max_restarts: int = 0
    """torchrun restarts of the job after a rank fails or dies (the script resumes from its checkpoint)."""
    rdzv_endpoint: Optional[str] = None
    """HOST:PORT of the rendezvous when each host starts its own node (`python -m launch` on every host)."""
    rdzv_id: Optional[str] = None
    """Rendezvous id every node of a job started host by host shares (default: derived from the endpoint)."""
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
    hang_timeout: Optional[float] = None
    """Seconds every rank may go without a heartbeat before the job is stopped as hung; None: off."""
    hang_first_step_timeout: Optional[float] = None
    """Longer grace before a rank's second heartbeat and during compiles; default max(10 x hang_timeout, 600)."""
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
        _check_renamed_env(dict(self.env), "--env")
        if not 0 < self.rdzv_port < 65536:
            raise UsageError(f"--rdzv-port {self.rdzv_port}: expected a TCP port in 1..65535")
        if self.max_retries < 0:
            raise UsageError(f"--max-retries {self.max_retries}: must be >= 0")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts {self.max_restarts}: must be >= 0")
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(
                    f"--rdzv-endpoint {self.rdzv_endpoint!r}: expected HOST:PORT of the first node, "
                    "e.g. node0.example.com:29500"
                )
        if self.rdzv_id is not None and (
            self.rdzv_endpoint is None or not self.rdzv_id or not all(c.isalnum() or c in "-_." for c in self.rdzv_id)
        ):
            raise UsageError(
                f"--rdzv-id {self.rdzv_id!r}: letters, digits, '-', '_' or '.', and only with --rdzv-endpoint"
            )
        self._check_hang()

    def _check_hang(self) -> None:
        if self.hang_timeout is None:
            if self.hang_first_step_timeout is not None:
                raise UsageError(
                    f"--hang-first-step-timeout {self.hang_first_step_timeout:g} needs --hang-timeout "
                    "SECONDS (hang detection is off without it)"
                )
            return
        if not _finite_positive(self.hang_timeout):
            raise UsageError(f"--hang-timeout {self.hang_timeout:g}: expected a number of seconds > 0 (e.g. 300)")
        first = self.hang_first_step_timeout
        if first is not None and (not _finite_positive(first) or first < self.hang_timeout):
            raise UsageError(
                f"--hang-first-step-timeout {first:g}: expected seconds >= --hang-timeout "
                f"({self.hang_timeout:g}); it is the grace for start-up, the first step and compiles"
            )

    @property
    def j(self) -> str:
        return f"{self.nnodes}x{self.nproc_per_node}"

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def node_cache_dirs(self) -> bool:
        """Several nodes on this host: each gets its own Inductor cache dir, as separate hosts would."""
        return self.scheduler.startswith("local") and self.rdzv_endpoint is None and self.max_nodes > 1


def _finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


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


_TORCHRUN_ONLY: dict[tuple[str, ...], str] = {
    ("--master-addr", "--master_addr", "--master-port", "--master_port", "--node-rank", "--node_rank"): (
        "pass --rdzv-endpoint MASTER_ADDR:MASTER_PORT and --nnodes N on every host instead (the rendezvous gives "
        "each node its rank)"
    ),
    ("--rdzv-backend", "--rdzv_backend", "--rdzv-conf", "--rdzv_conf"): (
        "the rendezvous is torchx's c10d one; drop it (--rdzv-endpoint and --rdzv-id name it across hosts)"
    ),
    ("--redirects", "--tee", "-r", "-t"): "rank output is always kept per rank; --log-dir DIR keeps it after the run",
    ("--local-ranks-filter", "--local_ranks_filter"): "every rank's output is kept; --log-dir DIR keeps it",
    ("--no-python", "--no_python", "--run-path", "--run_path"): "SCRIPT is a .py path, or a module with -m",
    ("--start-method", "--start_method", "--monitor-interval", "--monitor_interval", "--role"): (
        "torchx's dist.ddp sets it; drop it"
    ),
}
"""torchrun options with no counterpart here, and what to do instead: refused by name, not as unknown."""


class _TorchrunOnly(argparse.Action):
    def __init__(self, *args, fix: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fix = fix

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise UsageError(f"{option_string} is torchrun's and python -m launch has no such option: {self.fix}")


def _build_parser() -> _Parser:
    p = _Parser(
        prog="python -m launch",
        description="Run a DDP training script on N ranks via torchx (torchrun on each node).",
    )
    p.add_argument("--nnodes", default=None, help="nodes: N or MIN:MAX (elastic); default 1")
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        default=None,
        help="ranks per node, or 'auto' (default): GPUs, else 2 on CPU",
    )
    p.add_argument(
        "-j", dest="j", default=None, help="torchx style [MIN:]NNODESxNPROC, instead of --nnodes/--nproc-per-node"
    )
    p.add_argument(
        "--dist-backend",
        default="auto",
        help="auto (nccl with GPUs, else gloo), gloo or nccl; the script reads it from DDP_COMPILE_DIST_BACKEND",
    )
    p.add_argument("--scheduler", "-s", default="local_cwd", help="torchx scheduler (default local_cwd)")
    p.add_argument("--scheduler-cfg", "--cfg", default="", help="scheduler options key=value,key=value")
    p.add_argument(
        "--dry-run", action="store_true", help="print the torchrun command and scheduler request; run nothing"
    )
    p.add_argument("--log-dir", "--log_dir", default=None, help="keep per-rank logs here")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra env for every rank (repeatable)"
    )
    p.add_argument("--max-retries", type=int, default=0, help="scheduler retries of the whole app")
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        metavar="K",
        help="torchrun restarts the job up to K times after a rank fails or dies (resume from a checkpoint)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST:PORT",
        help="run only this host's node of an --nnodes N job whose rendezvous is at HOST:PORT "
        "(the same command on every host)",
    )
    p.add_argument(
        "--rdzv-id", "--rdzv_id", default=None, help="rendezvous id shared by the hosts (default from the endpoint)"
    )
    p.add_argument(
        "--rdzv-port",
        type=int,
        default=None,
        help="rendezvous port for multi-node (default: a free port locally, 29500 remote)",
    )
    p.add_argument(
        "--inductor-cache-dir",
        default=None,
        help="per-node Inductor cache, forced to mode 0700 (default: $TORCHINDUCTOR_CACHE_DIR locally, "
        "else ${TMPDIR:-/tmp}/ddp_compile_inductor_$UID)",
    )
    p.add_argument("--torch-logs", default=None, help="TORCH_LOGS for every rank, e.g. graph_breaks,recompiles")
    p.add_argument("--trace-dir", default=None, help="TORCH_TRACE dir (tlparse) for every rank")
    p.add_argument(
        "--hang-timeout",
        default=None,
        metavar="SECONDS",
        help="stop the job (exit 3) and name the stuck rank with its stack when no rank has sent a "
        "heartbeat for this long (off by default; see docs/launch.md)",
    )
    p.add_argument(
        "--hang-first-step-timeout",
        default=None,
        metavar="SECONDS",
        help="grace before a rank's second heartbeat and during compiles (default max(10 x hang timeout, 600))",
    )
    p.add_argument("-m", "--module", dest="module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's single-node flag: one node, rendezvous on a free local port (what runs without it too)",
    )
    for flags, fix in _TORCHRUN_ONLY.items():
        p.add_argument(*flags, nargs="?", action=_TorchrunOnly, fix=fix, help=argparse.SUPPRESS)
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    return p


def _parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {item!r}: expected KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def _seconds(flag: str, text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected a number of seconds > 0 (e.g. 300)") from None


def _known_schedulers() -> list[str]:
    from torchx.schedulers import get_scheduler_factories

    return sorted(get_scheduler_factories())


def _check_renamed_env(env: Mapping[str, str], where: str) -> None:
    from launch.components import check_renamed_env  # imports torchx: not at module import

    try:
        check_renamed_env(dict(env), where)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def parse_args(argv: Sequence[str]) -> LaunchConfig:
    """Command line -> validated LaunchConfig; raises UsageError on any bad input."""
    ns = _build_parser().parse_args(list(argv))
    _check_renamed_env(os.environ, "the environment")
    if ns.standalone and (ns.rdzv_endpoint is not None or ns.nnodes not in (None, "1") or ns.j is not None):
        raise UsageError(
            "--standalone is a single node with a local rendezvous: drop --nnodes/-j/--rdzv-endpoint, or drop "
            "--standalone for a job over several nodes"
        )
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
    hang_timeout = _seconds("--hang-timeout", ns.hang_timeout)
    hang_first = _seconds("--hang-first-step-timeout", ns.hang_first_step_timeout)
    schedulers = _known_schedulers()
    if ns.scheduler not in schedulers:
        raise UsageError(f"--scheduler {ns.scheduler!r} is unknown; choose one of {', '.join(schedulers)}")
    local = ns.scheduler.startswith("local")
    rdzv_port = ns.rdzv_port if ns.rdzv_port is not None else (free_port() if local else 29500)
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
        max_restarts=ns.max_restarts,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        rdzv_port=rdzv_port,
        log_dir=ns.log_dir,
        # locally, an Inductor cache the user already chose is kept (still forced private by the prelude)
        inductor_cache_dir=ns.inductor_cache_dir or (os.environ.get("TORCHINDUCTOR_CACHE_DIR") if local else None),
        torch_logs=ns.torch_logs,
        trace_dir=ns.trace_dir,
        hang_timeout=hang_timeout,
        hang_first_step_timeout=hang_first,
        dry_run=ns.dry_run,
    )
