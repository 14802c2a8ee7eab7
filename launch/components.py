"""torchx component for DDP + torch.compile training jobs.

Why a component of our own rather than plain ``dist.ddp``: a compiled DDP job needs a few things the
builtin does not give it, and they must be identical on every scheduler (local, slurm, kubernetes), so
they live in the AppDef itself rather than in the local launcher:

* an Inductor cache dir (``TORCHINDUCTOR_CACHE_DIR``) shared by the ranks of a node, so that rank 1 reuses
  the kernels rank 0 just compiled. The cache holds compiled ``.so`` files that every rank loads: a
  group- or world-writable cache lets another user plant code that our ranks execute. The node-side
  prelude therefore creates it with mode 0700, refuses one owned by someone else or reached through a
  symlink, and empties and repairs one whose mode was too open (its contents cannot be trusted).
* ``TORCH_LOGS`` / ``TORCH_TRACE`` (tlparse) knobs, because compile problems are debugged per rank.
* the process-group backend (``DDP_COMPILE_DIST_BACKEND``: nccl on GPU hosts, gloo otherwise) handed to the
  script through the environment, with ``OMP_NUM_THREADS=1`` for CPU ranks so they do not oversubscribe.
* ``PATH`` pointing at the submitting interpreter's bin dir: torchx 0.7.0 runs ``torchrun`` by name.
* optionally (``record``, on by default) the script runs under ``launch.worker``, which wraps it in
  torchelastic's ``@record``: a failing rank leaves its exception in the torchelastic error file, so the
  job's failure report names the rank and its real exception instead of a bare ``ChildFailedError``.
* optionally (``hang_timeout``) hang detection: torchrun runs under ``python3 -m launch.watchdog`` on each
  node, which stops the job (exit 3) when every rank's heartbeats stop, naming the stuck rank with its
  Python stack (rules in launch/watchdog.py). The watchdog runs on the node because heartbeats are shared
  memory maps (microseconds per beat) and stacks are fetched with SIGUSR1: both need the rank's host.

* past one node: ``max_restarts`` (torchrun restarts the job after a rank dies; each attempt gets a fresh
  rendezvous store, see ``_job_env``), ``node_cache_dirs`` (several nodes on one host, each with its own
  cache dir, as separate hosts would have) and ``rdzv_endpoint``/``rdzv_id`` (nodes started one by one,
  ``python -m launch --rdzv-endpoint`` on each host).

Everything else (``-j``, rendezvous, retries, resources, mounts) is delegated to
``torchx.components.dist.ddp``. This file is also executed standalone by
``torchx run launch/components.py:trainer``: it must stay self-contained (absolute imports only) and
light (no torch import).
"""

import os
import shlex
import sys
from typing import Dict, List, Optional

import torchx
import torchx.specs as specs
from torchx.components import dist as torchx_dist
from torchx.components.structured_arg import StructuredNameArgument

# Environment variable through which the script learns the process-group backend to use.
BACKEND_ENV = "DDP_COMPILE_DIST_BACKEND"
# Earlier names of our variables -> their names now: set anywhere, the old name is an error naming the new one.
RENAMED_ENV = {"DDP_COMPILE_BACKEND": BACKEND_ENV}
# Default cache location, expanded by bash on each node (so the uid is the node's, not the submitter's).
DEFAULT_CACHE_DIR = "${TMPDIR:-/tmp}/ddp_compile_inductor_$(id -u)"
_BACKENDS = ("auto", "gloo", "nccl")
# Same value as launch.heartbeat.HEARTBEAT_DIR_ENV (a unit test checks): this file must stay self-contained.
HEARTBEAT_DIR_ENV = "DDP_LAUNCH_HEARTBEAT_DIR"


def trainer(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    j: str = "1x2",
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    name: str = "/",
    image: str = torchx.IMAGE,
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    dist_backend: str = "auto",
    inductor_cache_dir: Optional[str] = None,
    torch_logs: Optional[str] = None,
    trace_dir: Optional[str] = None,
    record: bool = True,
    hang_timeout: Optional[float] = None,
    hang_first_step_timeout: Optional[float] = None,
    heartbeat_dir: Optional[str] = None,
    max_restarts: int = 0,
    node_cache_dirs: bool = False,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: Optional[str] = None,
    mounts: Optional[List[str]] = None,
    debug: bool = False,
) -> specs.AppDef:
    """
    DDP + torch.compile trainer: torchrun on every node, a private shared Inductor cache per node,
    compile logging knobs, and per-rank root-cause errors. Built on torchx's dist.ddp.

    Args:
        script_args: arguments passed to the script or module
        script: path of the training script (exactly one of script and m)
        m: python module to run instead of a script (e.g. examples.train_gpt)
        j: [{min_nnodes}:]{nnodes}x{nproc_per_node}, e.g. 1x2 or 1:4x8 (elastic)
        env: extra environment variables for every rank (e.g. FOO=1,BAR=2)
        max_retries: number of scheduler retries allowed
        rdzv_port: port on the rank-0 host for the c10d rendezvous store (multi-node only)
        name: job name: {experimentname}/{runname}, {experimentname}/, /{runname} or {runname}
        image: image (docker) or, for local schedulers, the working directory
        h: a registered named resource; takes precedence over cpu, gpu and memMB
        cpu: cpus per node
        gpu: gpus per node; with dist_backend=auto, gpu>0 selects nccl
        memMB: memory per node in MB
        dist_backend: process-group backend for the script (DDP_COMPILE_DIST_BACKEND): auto, gloo or nccl
        inductor_cache_dir: per-node Inductor cache dir (created 0700); default ${TMPDIR:-/tmp}/ddp_compile_inductor_$UID
        torch_logs: value for TORCH_LOGS on every rank (e.g. +dynamo,graph_breaks,recompiles)
        trace_dir: directory for TORCH_TRACE structured compile traces (read them with tlparse)
        record: run the script under launch.worker so a failing rank records its exception (needs this package on the nodes)
        hang_timeout: seconds without heartbeats from every rank before the job is stopped as hung (exit 3), naming the stuck rank and its stack; off by default (needs this package on the nodes)
        hang_first_step_timeout: grace before a rank's second heartbeat and during compiles; default max(10 x hang_timeout, 600)
        heartbeat_dir: directory for the ranks' heartbeat records and stack dumps (on the nodes); default a private temp dir per node
        max_restarts: torchrun restarts of the whole job after a rank fails or dies (every node re-rendezvouses; the script resumes from its checkpoint)
        node_cache_dirs: give each node its own Inductor cache dir, <inductor_cache_dir>/node<replica id> (several nodes on one host: as separate hosts would see it)
        rdzv_endpoint: HOST:PORT of the c10d rendezvous, for nodes started one by one on hosts of your own (then this AppDef is one node of the job); default the scheduler's rank-0 host
        rdzv_id: rendezvous id shared by every node of the job; default the app id (nodes started one by one must pass the same value)
        mounts: mounts for container schedulers (type=bind,src=/host,dst=/job[,readonly])
        debug: enable torchx's preset distributed debug environment variables
    """
    if dist_backend not in _BACKENDS:
        raise ValueError(
            f"dist_backend={dist_backend!r} is not one of {', '.join(_BACKENDS)}; "
            "use auto to pick nccl on GPU hosts and gloo otherwise"
        )
    if (script is None) == (m is None):
        raise ValueError(
            f"got script={script!r} and m={m!r}: pass exactly one (--script path/to/train.py or -m pkg.module)"
        )
    torchx_dist.parse_nnodes(j)  # raises a ValueError naming the bad -j before anything else is built
    check_renamed_env(env or {}, "env")
    check_renamed_env(os.environ, "the environment")
    _check_rdzv(max_restarts, rdzv_endpoint, rdzv_id)
    hang_timeout, hang_first_step_timeout = _check_hang(hang_timeout, hang_first_step_timeout, heartbeat_dir)
    backend = _resolve_backend(dist_backend, gpu=gpu, h=h)
    names = StructuredNameArgument.parse_from(name=name, m=m, script=script)

    if record:
        # torchrun runs `python -m launch.worker script|module TARGET ARGS...`
        entry_m: Optional[str] = "launch.worker"
        entry_script: Optional[str] = None
        args = ["script", script] if script is not None else ["module", m]
        args += list(script_args)
    else:
        entry_m, entry_script, args = m, script, list(script_args)

    app = torchx_dist.ddp(
        *args,
        script=entry_script,
        m=entry_m,
        image=image,
        name=f"{names.experiment_name}/{names.run_name}",
        h=h,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=j,
        env=_job_env(
            env,
            backend=backend,
            torch_logs=torch_logs,
            trace_dir=trace_dir,
            heartbeat_dir=heartbeat_dir,
            restarts=max_restarts > 0,
        ),
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        mounts=mounts,
        debug=debug,
    )
    role = app.roles[0]
    role.name = torchx_dist.get_role_name(script, m)  # the user's script, not launch.worker
    # dist.ddp's entrypoint is `bash -c "torchrun ..."`: run the cache prelude first, then exec torchrun
    # so that the scheduler's SIGTERM reaches torchrun (which forwards it to every rank).
    command = _torchrun_options(role.args[1], max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id)
    if rdzv_endpoint is not None:
        role.num_replicas = role.min_replicas = 1  # nodes started one by one: this AppDef is one of them
    if hang_timeout is not None:
        # torchrun becomes the watchdog's child; the watchdog forwards the scheduler's signals to it.
        first = "" if hang_first_step_timeout is None else f" --first-step-timeout {hang_first_step_timeout!r}"
        command = f"python3 -m launch.watchdog --hang-timeout {hang_timeout!r}{first} -- {command}"
    role.args = ["-c", f"{cache_prelude(inductor_cache_dir, per_node=node_cache_dirs)} && exec {command}"]
    return app


def check_renamed_env(env: Dict[str, str], where: str) -> None:
    """Raise ValueError when `env` sets a variable under a name it no longer has (`RENAMED_ENV`)."""
    for old, new in RENAMED_ENV.items():
        if old in env:
            raise ValueError(
                f"{old} was renamed to {new}; {old} is set in {where}: unset it. The launcher sets {new} for "
                "every rank from --dist-backend (python -m launch) or dist_backend= (this component): auto, gloo "
                "or nccl"
            )


def _check_rdzv(max_restarts: object, rdzv_endpoint: Optional[str], rdzv_id: Optional[str]) -> None:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r}: expected an integer >= 0 (e.g. 3)")
    if rdzv_endpoint is not None:
        host, sep, port = rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rdzv_endpoint={rdzv_endpoint!r}: expected HOST:PORT, e.g. node0.example.com:29500")
    if rdzv_id is not None and not all(c.isalnum() or c in "-_." for c in rdzv_id):
        raise ValueError(f"rdzv_id={rdzv_id!r}: use letters, digits, '-', '_' and '.'")


def _torchrun_options(command: str, *, max_restarts: int, rdzv_endpoint: Optional[str], rdzv_id: Optional[str]) -> str:
    """dist.ddp's torchrun command with our options: restarts, and an explicit rendezvous."""
    words = command.split(" ")  # dist.ddp joins plain words with spaces
    if words[0] != "torchrun":
        raise AssertionError(f"dist.ddp's command does not start with torchrun: {command[:80]!r}")
    for flag, value in (("--rdzv_endpoint", rdzv_endpoint), ("--rdzv_id", rdzv_id)):
        if value is not None:
            at = words.index(flag)
            words[at + 1] = shlex.quote(value)
    if max_restarts:
        words[1:1] = ["--max-restarts", str(max_restarts)]
    return " ".join(words)


def _seconds(name: str, value: object) -> Optional[float]:
    """None, or a finite number of seconds > 0. torchx 0.7.0 hands Optional[float] arguments over as the
    command line's strings, so numeric strings are accepted too."""
    if value is None:
        return None
    try:
        seconds = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
    except ValueError:
        seconds = None
    if seconds is None or not 0 < seconds < float("inf"):
        raise ValueError(f"{name}={value!r}: expected a number of seconds > 0 (e.g. 300)")
    return seconds


def _check_hang(
    hang_timeout: object, first_step: object, heartbeat_dir: Optional[str]
) -> "tuple[Optional[float], Optional[float]]":
    """The validated (hang_timeout, hang_first_step_timeout) as floats."""
    if hang_timeout is None:
        if first_step is not None or heartbeat_dir is not None:
            raise ValueError(
                "hang_first_step_timeout and heartbeat_dir need hang_timeout (hang detection is off "
                "without it); pass --hang_timeout SECONDS"
            )
        return None, None
    timeout = _seconds("hang_timeout", hang_timeout)
    first = _seconds("hang_first_step_timeout", first_step)
    if first is not None and first < timeout:
        raise ValueError(f"hang_first_step_timeout={first_step!r}: expected seconds >= hang_timeout ({timeout:g})")
    return timeout, first


def _resolve_backend(dist_backend: str, *, gpu: int, h: Optional[str]) -> str:
    if dist_backend != "auto":
        return dist_backend
    gpus = specs.resource(h=h).gpu if h else gpu
    return "nccl" if gpus > 0 else "gloo"


def _job_env(
    user_env: Optional[Dict[str, str]],
    *,
    backend: str,
    torch_logs: Optional[str],
    trace_dir: Optional[str],
    heartbeat_dir: Optional[str],
    restarts: bool = False,
) -> Dict[str, str]:
    env: Dict[str, str] = {
        BACKEND_ENV: backend,
        # torchx 0.7.0 invokes `torchrun` by name; make it the one next to this interpreter.
        "PATH": _path_with(os.path.dirname(sys.executable)),
    }
    if backend == "gloo":
        env["OMP_NUM_THREADS"] = "1"  # CPU ranks share the host's cores: one thread each
    if restarts:
        # torchrun shares its rendezvous store with the ranks; a restarted rank then reads the keys the
        # previous attempt's ranks left there (gloo/nccl addresses) and hangs or fails at init (pytorch
        # issue 135712). Opting out gives every attempt a fresh store, hosted by its rank 0.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if torch_logs:
        env["TORCH_LOGS"] = torch_logs
    if trace_dir:
        env["TORCH_TRACE"] = trace_dir
    if heartbeat_dir:
        env[HEARTBEAT_DIR_ENV] = heartbeat_dir
    env.update(user_env or {})  # the user's explicit values win
    return env


def _path_with(bin_dir: str) -> str:
    """PATH with `bin_dir` first and no duplicate entries."""
    entries = [bin_dir] + os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def cache_prelude(cache_dir: Optional[str], per_node: bool = False) -> str:
    """Bash snippet run on each node before torchrun: make the Inductor cache private, then export it.

    Refuses (exit 2) a dir that is a symlink or owned by another user; a dir we own whose mode lets
    group/others write is emptied (a planted .so must never be loaded) and set back to 0700.
    `per_node`: the node's own dir below it, `node<replica id>` (torchx fills in the replica id).
    """
    d = DEFAULT_CACHE_DIR if cache_dir is None else shlex.quote(cache_dir.rstrip("/") or "/")
    if per_node:
        d = f"{d}/node{specs.macros.replica_id}"
    refuse = (
        'echo "launch: error: Inductor cache dir $d is a symlink or not owned by $(id -un);'
        ' pass another inductor_cache_dir" >&2; exit 2'
    )
    repair = 'echo "launch: warning: Inductor cache dir $d was group/world-writable; emptied it and set mode 0700" >&2'
    return (
        f'd={d}; mkdir -p -m 700 -- "$d" || exit 2; '
        f'if [ -L "$d" ] || [ ! -O "$d" ]; then {refuse}; fi; '
        'if [ -n "$(find "$d" -maxdepth 0 \\( -perm -0002 -o -perm -0020 \\) -print)" ]; then '
        f'chmod 700 -- "$d" && find "$d" -mindepth 1 -delete && {repair} || exit 2; fi; '
        'chmod 700 -- "$d" && export TORCHINDUCTOR_CACHE_DIR="$d"'
    )
