"""Run a function on N local ranks (gloo on CPU, nccl when enough GPUs are visible), with a timeout.

Every rank's return value comes back to the test; a failure names the rank and carries its traceback;
a hang fails after `timeout` seconds and kills every rank.
"""
from __future__ import annotations

import io
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(world_size: int) -> str:
    """nccl when every rank can have its own GPU, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = backend_for(world_size)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
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


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 240.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results ordered by rank.

    `fn` must be a module-level function (it is pickled to spawned processes).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
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
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks will be stuck in a collective: stop now
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def init_single_rank_group() -> None:
    """A world-size-1 gloo group in this process (for single-process DDP tests)."""
    if dist.is_initialized():
        return
    path = tempfile.mktemp(prefix="ddp_compile_pg_")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
