"""How a benchmark job's ranks start: forked from a server that imported torch once.

Note [Forked benchmark ranks]

Background. A rank started as a fresh interpreter imports torch, Dynamo and the worker before its first step:
about 4 s of CPU per rank on the 2-core development machine (`import torch` 2.2 s, Dynamo 1.7 s, the rest
0.5 s), and a smoke job is two such ranks that then train for 3-4 s. None of it is measured (the worker's
clocks start at the first step), all of it is waited for.

Algorithm. `RankServer` starts multiprocessing's fork server with `benchmarks.rank_preload` imported, and
every rank of the run is forked from it (`start`): the rank replaces its environment with the one the
runner made for it, leads a session of its own (the runner kills rank groups), writes to its log and
runs `benchmarks.worker.main`. A forked rank is as fresh as a spawned one where it matters: the server
compiles nothing, so Dynamo's and Inductor's in-memory caches are empty, and Inductor reads
TORCHINDUCTOR_CACHE_DIR from the environment at every lookup, so each job keeps its own cold or warm cache
directory. The server never initialises CUDA (a forked CUDA context is unusable): each forked rank checks.

What a fork cannot change: settings torch reads once, at import (OpenMP threads, Inductor's compile threads,
TORCH_LOGS, Dynamo's precompile cache path, which the benchmark's modes leave off). The server starts with
the first job's environment minus the per-rank variables (`PER_RANK_ENV`); a job whose environment differs
from it in anything else gets fresh interpreters, as do jobs on a shaped link (their ranks start inside
a network namespace), the GPU benchmark's side-by-side jobs (`benchmarks.gpu_phases`: not yet tried on a GPU),
and a run in a process whose fork server other code started (Python has one per process).

Debugging. `BENCH_FRESH_RANKS=1` starts every rank as a fresh interpreter, as before this existed. A forked
rank's log is its `rankN.log`, as a fresh one's; a failure in the preload fails the rank with its traceback.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import tempfile
from pathlib import Path

PER_RANK_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHINDUCTOR_CACHE_DIR"})
"""What differs between the ranks of one run; torch reads none of it at import (see the Note)."""
FRESH_RANKS_ENV = "BENCH_FRESH_RANKS"
"""Set to 1 to start every rank as a fresh interpreter."""


class ForkedRank:
    """A rank forked from the server, behind the part of `subprocess.Popen` the runner uses."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # negative for a signal, as Popen's

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"benchmark rank (pid {self.pid})", timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_RANK_ENV}


class RankServer:
    """The fork server of one benchmark run (a context manager). Started by the first rank it forks."""

    def __init__(self) -> None:
        self._env: dict[str, str] | None = None
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.forked = 0
        """Ranks forked so far (the rest of the run's ranks started fresh)."""
        self.fresh_why: str | None = None
        """Why the last rank `start` declined to fork started fresh instead (None while every rank forked)."""

    def __enter__(self) -> RankServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the server's scratch dir. The server itself ends with this process (Python stops it at exit)."""
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def start(self, spec_path: Path, *, env: dict[str, str], log_path: Path, cwd: Path) -> ForkedRank | None:
        """Fork a rank running `benchmarks.worker` on `spec_path`; None where a fork would see other import-time
        settings than `env` asks for (the caller starts a fresh interpreter instead)."""
        if os.environ.get(FRESH_RANKS_ENV) == "1":
            return self._fresh(f"{FRESH_RANKS_ENV}=1")
        ctx = multiprocessing.get_context("forkserver")
        wanted = _import_env(env)
        if self._env is None:
            if _fork_server_running():
                return self._fresh("this process already runs a multiprocessing fork server that other code started")
            self._start_server(ctx, wanted)
        if wanted != self._env:
            differ = sorted(k for k in wanted.keys() | self._env.keys() if wanted.get(k) != self._env.get(k))
            return self._fresh(f"the job's environment differs from the rank server's in {', '.join(differ)}")
        process = ctx.Process(target=_rank_main, args=(str(spec_path), env, str(log_path), str(cwd)))
        process.start()
        self.forked += 1
        return ForkedRank(process)

    def _fresh(self, why: str) -> None:
        self.fresh_why = why
        return None

    def _start_server(self, ctx, env: dict[str, str]) -> None:
        # The server inherits this process's environment when it starts: make it the ranks' for that moment.
        # Its TORCHINDUCTOR_CACHE_DIR is a scratch dir: Dynamo fixes one path from it at import (the Note).
        self._scratch = tempfile.TemporaryDirectory(prefix="bench-rank-server-")
        ctx.set_forkserver_preload(["benchmarks.rank_preload"])
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env, TORCHINDUCTOR_CACHE_DIR=self._scratch.name)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self._env = env


def _fork_server_running() -> bool:
    """Whether this process already runs multiprocessing's fork server (there is one per process): one that other
    code started (a test harness, an earlier run) has its own preload and environment, so this run's ranks start
    fresh. Read through a private attribute of multiprocessing.forkserver; should it move, assume one runs."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", "unknown") is not None


def _rank_main(spec_path: str, env: dict[str, str], log_path: str, cwd: str) -> None:
    os.setsid()  # the runner kills a rank's whole group
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from benchmarks import rank_preload

    if rank_preload.CUDA_INITIALISED:
        raise RuntimeError(
            f"the rank server initialised CUDA before forking this rank: run with {FRESH_RANKS_ENV}=1 and report it"
        )
    from benchmarks.worker import main

    main([spec_path])  # ends the process (os._exit) with the worker's exit code
