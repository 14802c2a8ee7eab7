"""`ddp_compile::pair_exchange`: the all-reduce of a two-rank gloo group as an exchange and our own sum.

Note [Two ranks: exchange the bucket, sum it ourselves]
-------------------------------------------------------
Background: gloo's all-reduce runs its whole algorithm on its worker threads: it copies the bucket into
its own buffers, runs a ring (reduce-scatter, then all-gather) and sums with its own element loop, which
converts one element at a time in 16-bit dtypes. With two ranks on 2 CPU cores, that CPU time is taken
from the ranks' compute. Measured here (scratch script; 2 gloo ranks, loopback, 55 MB of fp32 gradients
in 4 MiB buckets all in flight, process CPU time per rank, medians of 5, two runs):
  fp32: all-reduce 43-46 ms of CPU; a send and a receive of each whole bucket 30-38 ms, the sum 8 ms;
  fp16: all-reduce 40-48 ms; exchange 16-17 ms, sum 6 ms;
  bf16: all-reduce 24-31 ms; exchange 17-21 ms, sum 7 ms.
With two ranks the exchange puts as many bytes on the wire as the ring (each rank sends one bucket's
worth), and `theirs + ours` is the sum gloo computes: IEEE addition is commutative, so both ranks get
the same bits, and a 16-bit sum is rounded once, as gloo's (add in fp32, round to nearest even).

Algorithm: `pair_exchange(bucket, group_name)` posts a send of `bucket` to the other rank of the group
and a receive of the other rank's bucket into a new tensor, and returns that tensor at once, registered
(as a functional collective's result is) for `_c10d_functional.wait_tensor`. gloo's transport thread
moves the bytes between the tensors and the socket; no worker thread of gloo's runs. The wait, where the
all-reduce's wait would be, waits for both transfers and adds our bucket into the received one in place
(torch's add: vectorised, in the wire dtype). So the received tensor is the reduced bucket, as the
functional all-reduce's result is, and the graph is the all-reduce graph with one op swapped (Inductor
keeps its schedule: each exchange right after its bucket, the waits where they were).

A summing thread of ours instead (sum as soon as a bucket lands, while the backward computes) was tried
and dropped: on the 5 Gbit/s link with DDP's fp16 hook (comm workload, one run each) it gave 419 / 369 ms
for the in-graph / in-backward steps where this gave 378 / 324, and gloo's all-reduce 409 / 358: a third thread
on two busy cores costs what it hides.

Notes: both ranks issue their exchanges in the same order (the same graph), and gloo delivers the
messages of one pair and tag in order, so bucket k pairs with bucket k. The graph's own last use of our
bucket is the exchange: the wait holds it until the send is done and the sum has read it, so the graph
must not hand its memory to another buffer meanwhile (`allow_buffer_reuse=False` for these graphs,
over the user's options: `InGraphPartitioner.inductor_requirements`). The op reads the group at run
time (its rank decides the peer), so every rank compiles the same graph and Inductor's cache serves one
rank's compile to the other. An error in a transfer (a rank died, the group's timeout) is raised by the
wait. Memory: until its wait, a bucket holds two buffers (ours and theirs) where the all-reduce held one
(gloo's own scratch buffers are not torch tensors, and no profiler counts them). Used only for a group
of exactly two ranks on gloo with CPU tensors (`use_pair_exchange`); any other group keeps
`_c10d_functional.all_reduce`.

Debugging: `TORCH_LOGS=output_code` shows `ddp_compile.pair_exchange` where an all_reduce would be;
`report()["in_graph"]["algorithm"]` names the algorithm a model uses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp import torch_ddp

TAG = 0x6464  # our own gloo tag: a user's own send/recv (tag 0 by default) never pairs with ours


@torch.library.custom_op("ddp_compile::pair_exchange", mutates_args=())
def pair_exchange(bucket: torch.Tensor, group_name: str) -> torch.Tensor:
    group = torch_ddp.resolve_group(group_name)
    theirs = torch.empty_like(bucket, memory_format=torch.contiguous_format)
    if theirs.numel() == 0:
        return theirs
    peer = 1 - group.rank()
    ours = bucket.contiguous()
    works = [group.send([ours], peer, TAG), group.recv([theirs], peer, TAG)]

    def wait_and_sum() -> None:
        for work in works:
            work.wait()
        theirs.add_(ours)  # torch's add, in the wire dtype: the bits gloo's sum gives

    torch_ddp.register_pending(theirs, wait_and_sum)
    return theirs


@pair_exchange.register_fake
def _pair_exchange_fake(bucket: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(bucket, memory_format=torch.contiguous_format)


PAIR_EXCHANGE = torch.ops.ddp_compile.pair_exchange.default


def use_pair_exchange(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether the in-graph all-reduce over `group` of `device_type` tensors runs as an exchange and a
    sum: two gloo ranks and CPU tensors (nccl reduces on the device; gloo stages CUDA tensors)."""
    return group.size() == 2 and device_type == "cpu" and dist.get_backend(group) == dist.Backend.GLOO
