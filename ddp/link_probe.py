"""Time the all-reduce of a DDP model's process group, for `bucket_cap_mb="auto"`
(Note [Automatic bucket cap] in ddp/bucketing/auto_cap.py).

Every rank of the group must call `measure_all_reduce` at the same point (`compile_core.compile`
does, right after DDP's own constructor collectives); it issues 2 * (1 + repeats) all-reduces and
one more to agree on the slowest rank's timings.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp import torch_ddp
from ddp.bucketing.auto_cap import AutoCap, choose_cap, fit_link

PROBE_SIZES = (256 * 1024, 4 * 1024 * 1024)
"""Bytes of the two timed all-reduces (a small and a large bucket)."""


def measure_all_reduce(
    process_group: dist.ProcessGroup | None, device: torch.device, *, repeats: int = 5
) -> tuple[float, float]:
    """(latency s, bytes/s) of an all-reduce on `process_group`, the slowest rank's figures."""
    fastest = []
    for size in PROBE_SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            dist.all_reduce(buf, group=process_group)
            _sync(device)
            if i:  # the first call sets up the connection's buffers: not timed
                times.append(time.perf_counter() - start)
        fastest.append(min(times))  # the least disturbed call: other work on the host only adds time
    slowest = torch.tensor(fastest, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=process_group)
    t_small, t_large = (float(t) for t in slowest.cpu())
    return fit_link(PROBE_SIZES, (t_small, t_large))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def auto_bucket_cap(ddp: torch.nn.parallel.DistributedDataParallel) -> AutoCap:
    """The cap `bucket_cap_mb="auto"` picks for this DDP model (collective: every rank calls it)."""
    params, _ = torch_ddp.reducer_params(ddp)
    if not params:
        raise ValueError("bucket_cap_mb='auto': the DDP model reduces no parameters, so there is nothing to size")
    latency, bandwidth = measure_all_reduce(ddp.process_group, params[0].device)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    return choose_cap(latency_s=latency, bytes_per_s=bandwidth, grad_bytes=grad_bytes)
