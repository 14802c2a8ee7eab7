"""Two gloo ranks: the in-graph bucket reduction as an exchange and a sum (ddp/in_graph/pair_exchange.py).

The ops themselves are checked against gloo's own all-reduce, bit for bit, in every wire dtype; then the
schedule Inductor gives them in a compiled backward, read from the profiler: each bucket leaves while the
backward still computes, and the waits come after its last gradient. Both ranks hold different data (on one
rank an exchange would pair with nobody).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ranks import run_ranks

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(300)]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _sums(rank: int, world_size: int) -> dict:
    from ddp.in_graph.pair_exchange import pair_exchange, use_pair_exchange

    wait = torch.ops._c10d_functional.wait_tensor.default

    out: dict = {"used": use_pair_exchange(dist.group.WORLD, "cpu")}
    sub = dist.new_group([0, 1])  # a group of its own name: the ops resolve it by name at run time
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(10 + rank)
        # several buckets in flight at once, of different sizes, one of them empty
        buckets = [(torch.randn(n, generator=g) * 3).to(dtype) for n in (4096, 1, 0, 70_000, 333)]
        for name, group in (("world", dist.group.WORLD), ("sub", sub)):
            received = [pair_exchange(b, group.group_name) for b in buckets]
            ours = [wait(r) for r in received]
            gloo = [b.clone() for b in buckets]
            for t in gloo:
                dist.all_reduce(t, group=group)
            out[(name, str(dtype))] = all(torch.equal(a, b) for a, b in zip(ours, gloo))
            out[(name, str(dtype), "changed")] = not torch.equal(ours[0], buckets[0])
    return out


def test_exchange_and_our_sum_is_gloos_all_reduce_to_the_bit_in_every_wire_dtype():
    per_rank = run_ranks(_sums, world_size=2, timeout=120)
    for rank, got in enumerate(per_rank):
        assert got["used"], "two gloo ranks on the CPU should use the exchange"
        for dtype in DTYPES:
            for name in ("world", "sub"):
                assert got[(name, str(dtype))], f"rank {rank} {name} {dtype}: exchange + sum differs from all_reduce"
                assert got[(name, str(dtype), "changed")], f"rank {rank} {name} {dtype}: nothing was received"


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, 256)]
    for _ in range(4):
        layers += [nn.GELU(), nn.Linear(256, 256)]
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(256, 8))


def _schedule(rank: int, world_size: int, optimizer_in_backward: bool) -> dict:
    import compile_core

    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = compile_core.train_step(
        model,
        opt,
        F.mse_loss,
        backend="inductor",
        ddp="in_graph",
        optimizer_in_backward=optimizer_in_backward,
        bucket_cap_mb=0.25,  # about one bucket per layer
    )
    g = torch.Generator().manual_seed(rank)
    batch = lambda: (torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g))  # noqa: E731
    for _ in range(3):
        step(*batch())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(*batch())
    events = sorted(
        (e.time_range.start, e.name)
        for e in prof.events()
        if e.name in ("ddp_compile::pair_exchange", "_c10d_functional::wait_tensor", "aten::mm", "aten::addmm")
    )
    return {
        "events": [name for _, name in events],
        "algorithm": step.report().to_dict()["in_graph"]["algorithm"],
    }


@pytest.mark.inductor
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer_in_backward", [False, True])
def test_inductor_issues_each_exchange_during_the_backward_and_waits_after_its_last_gradient(optimizer_in_backward):
    """The exchange is an extern op that allocates the received bucket, where the all-reduce it replaces
    wrote in place; Inductor may place such an op anywhere its inputs allow, and an earlier version of this
    path (a sum op after the wait) had the backward wait for the wire right after each exchange. The order
    must stay: exchange, more backward matmuls, then the waits."""
    per_rank = run_ranks(_schedule, optimizer_in_backward, world_size=2, timeout=540)
    for got in per_rank:
        assert got["algorithm"] == "pair_exchange", got["algorithm"]
        names = got["events"]
        exchanges = [i for i, n in enumerate(names) if n == "ddp_compile::pair_exchange"]
        sums = [i for i, n in enumerate(names) if n == "_c10d_functional::wait_tensor"]
        matmuls = [i for i, n in enumerate(names) if n == "aten::mm"]  # the backward's (the forward's are addmm)
        assert len(exchanges) >= 4 and len(sums) == len(exchanges), names
        # the first bucket is on the wire while the backward computes at least the next layer's gradients
        assert sum(1 for m in matmuls if exchanges[0] < m < sums[0]) >= 2, names
        # bucket k is waited for only once bucket k+1 is on the wire (the update pipeline's order)
        assert all(exchanges[k + 1] < sums[k] for k in range(len(sums) - 1)), names
        if not optimizer_in_backward:
            # without updates in the backward, every wait comes until every exchange and the last matmul
            assert min(sums) > max(matmuls + exchanges), names
