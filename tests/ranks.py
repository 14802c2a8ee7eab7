"""Run a function on N local ranks (gloo on CPU, nccl when enough GPUs are visible), with a timeout.

Under nccl each rank owns one GPU: the rank functions put their models and data there with
`to_rank_device` and wrap models with `wrap_ddp`; on gloo both are the CPU and change nothing.
Every rank's return value comes back to the test as CPU tensors; a failure names the rank and carries its traceback;
a hang fails after `timeout` seconds. Whatever happens, every rank is killed together with anything it
started: each rank leads a process group of its own, and the whole group is killed at the end.
"""

from __future__ import annotations

import atexit
import datetime
import io
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def backend_for(world_size: int) -> str:
    """nccl when every rank can have its own GPU, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


RANK_DEVICE_ENV = "DDP_COMPILE_TEST_DEVICE"
"""Set to "cuda" to put every gloo rank's model and data on a GPU (ranks share GPUs round-robin): with one
GPU, the 2-rank tests then run gloo over CUDA tensors. Unset or "cpu": gloo ranks stay on the CPU."""


def _forced_device() -> str | None:
    value = os.environ.get(RANK_DEVICE_ENV, "").strip().lower()
    if value in ("", "cpu"):
        return None
    if value != "cuda":
        raise ValueError(f"{RANK_DEVICE_ENV}={value!r}: use 'cuda' (gloo ranks on GPUs) or 'cpu'/unset")
    if not torch.cuda.is_available():
        raise ValueError(f"{RANK_DEVICE_ENV}=cuda but torch sees no GPU here: unset it")
    return value


def ranks_on_gpu(world_size: int) -> bool:
    """Whether `run_ranks(..., world_size=world_size)` puts the ranks' tensors on GPUs: nccl (a GPU per rank)
    or gloo with `DDP_COMPILE_TEST_DEVICE=cuda`."""
    return backend_for(world_size) == "nccl" or _forced_device() is not None


def rank_device(rank: int) -> torch.device:
    """The device a rank's model and data live on: its own GPU under nccl; under gloo the CPU, or a GPU
    shared round-robin when `DDP_COMPILE_TEST_DEVICE=cuda` (see `RANK_DEVICE_ENV`)."""
    if (dist.is_initialized() and dist.get_backend() == "nccl") or _forced_device():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def to_rank_device(obj: Any) -> Any:
    """`obj` on this rank's device (`rank_device`): a module (moved in place, returned), a tensor, or a
    tuple/list/dict of them; anything else (None, numbers, strings) as it is.

    Data are still drawn on the CPU from the same generators and only then moved, so a rank sees the
    same numbers under nccl as under gloo; on the CPU nothing is copied (`.to` returns the tensor).
    """
    return _to_device(obj, rank_device(dist.get_rank()))


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def wrap_ddp(module: torch.nn.Module, **ddp_kwargs: Any) -> DDP:
    """`DDP(module, **ddp_kwargs)` as a one-GPU-per-rank script writes it: a module on a GPU gets
    `device_ids=[that GPU]`; a CPU module gets none (DDP rejects device_ids for CPU modules)."""
    device = next(module.parameters()).device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    return DDP(module, **ddp_kwargs)


def _worker(
    rank: int, world_size: int, backend: str, port: int, pg_timeout: float, fn: Callable, args: tuple, queue
) -> None:
    # A process group of our own: the parent kills it whole (this rank and whatever it started).
    os.setpgid(0, 0)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # One compile thread: no Inductor worker pool competing with the other rank for 2 cores.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl" or _forced_device():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = datetime.timedelta(seconds=pg_timeout)
        # The parent holds the store's server (listening before any rank starts): a client only connects.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(rank, world_size, *args)
        # Serialized by value: tensors sent through the queue would live in this process's shared
        # memory, which is gone once the rank exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report every failure, whatever it is, with the rank that raised it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_SERVER_ENV_KEY = "PYTEST_CURRENT_TEST"  # changes with every test; the ranks never read it
_server_env: dict[str, str] | None = None
"""This process's environment when the fork server started (it and every rank it forks keep that one)."""


def _rank_context():
    """How the ranks start: forked from a server that imported torch once (`tests/rank_server.py`), or,
    where that would change what a rank sees, spawned afresh (importing torch again, ~4 s of CPU each).

    Spawned instead: when a GPU is visible (a forked rank must not inherit CUDA state), and when this
    process's environment differs from the one the server started with (a test set a variable for its
    ranks: a forked rank has the server's environment, and torch read its settings at the server's import).
    """
    global _server_env
    env = {k: v for k, v in os.environ.items() if k != _SERVER_ENV_KEY}
    if torch.cuda.is_available() or (_server_env is not None and env != _server_env):
        return mp.get_context("spawn")
    if _server_env is None:
        forkserver = mp.get_context("forkserver")
        forkserver.set_forkserver_preload(["tests.rank_server"])
        _server_env = env
    return mp.get_context("forkserver")


def stop_rank_server() -> None:
    """Stop the fork server, if this process started one (at the session's end: a run without xdist has it
    in the process that checks for leftovers). Python stops it only at exit, through a private method."""
    if _server_env is not None:
        import multiprocessing.forkserver

        multiprocessing.forkserver._forkserver._stop()


def _kill_rank(proc) -> None:
    """SIGKILL the rank's process group (the rank and its children); the rank itself if it has none yet."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # no such group: it never got to setpgid, or everything in it is gone already
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=10)


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 240.0,
    pg_timeout: float | None = None,
    backend: str | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results ordered by rank, every
    tensor in them on the CPU.

    `fn` must be a module-level function (it is pickled to spawned processes). `timeout` bounds the whole
    run; `pg_timeout` (default: `timeout`) bounds each collective. A rank whose peer died does not need
    it (gloo fails at once when the peer's connection closes); it ends a wait on a peer that is alive
    but stuck, which `timeout` ends anyway. `backend` (default: `backend_for(world_size)`) forces one, e.g.
    "gloo" for a test whose claim only holds on the CPU.
    """
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    backend = backend_for(world_size) if backend is None else backend
    ctx = _rank_context()
    queue = ctx.Queue()
    # The rendezvous store is served from here, bound to a port the OS picks: no window in which another
    # process could take the port between choosing it and listening on it (EADDRINUSE seen in CI).
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, backend, port, pg_timeout, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f}s "
                    f"(finished: {sorted(results)}); failures so far: {failures}"
                )
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead and not failures:
                    failures.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                if failures:
                    break
                continue
            if ok:
                # map_location: a rank's CUDA tensors arrive as CPU tensors; the test process compares
                # them with each other and with CPU data, and never touches a GPU itself.
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False, map_location="cpu")
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks will be stuck in a collective: stop now
    finally:
        # However we got here (done, failure, timeout, pytest-timeout's exception, Ctrl-C): give finished
        # ranks a moment to exit, then kill every rank's process group.
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5 if len(results) == world_size else 0.5)
        for p in procs:
            _kill_rank(p)
        queue.close()
        queue.join_thread()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results[r] for r in range(world_size)]


_single_rank_store: str | None = None


def remove_single_rank_store() -> None:
    """Destroy the world-size-1 group of `init_single_rank_group` and delete its file store."""
    global _single_rank_store
    if dist.is_initialized():
        dist.destroy_process_group()
    if _single_rank_store is not None:
        shutil.rmtree(_single_rank_store, ignore_errors=True)
        _single_rank_store = None


def init_single_rank_group() -> None:
    """A world-size-1 gloo group in this process (for single-process DDP tests); its file store goes at exit."""
    global _single_rank_store
    if dist.is_initialized():
        return
    _single_rank_store = tempfile.mkdtemp(prefix="ddp_compile_pg_")
    atexit.register(remove_single_rank_store)
    path = os.path.join(_single_rank_store, "store")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
