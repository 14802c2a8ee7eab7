"""Compile once per job, across nodes: two ranks that see each other only through the job's store (each
its own Inductor cache dir, its own LOCAL_RANK 0 and GROUP_RANK, as two hosts without a shared
filesystem would). Each distinct piece is compiled by one rank and shipped to the other; a piece that
bakes a rank-specific value is never shipped; a warm restart takes everything from its own node's cache."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ranks import run_ranks
from tests.single.ddp_helpers import Blocks, x64

pytestmark = [pytest.mark.multi_gpu, pytest.mark.inductor]


class RankScaledBlocks(Blocks):
    """Blocks whose head output is scaled by a Python float that differs per rank: Dynamo bakes it into
    the head piece's graph as a constant. A compile of that piece must never run on another rank."""

    def __init__(self, scale: float) -> None:
        super().__init__(n=2)
        self.scale = scale

    def forward(self, x):
        return super().forward(x) * self.scale


def as_node(rank: int, world_size: int, cache_root: str, steps: int):
    # What torchrun gives a rank on its own node of a 2-node x 1-rank job, and the node's own cache dir.
    os.environ.update(
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_root, f"node{rank}"),
    )
    from torch._dynamo.utils import counters

    import compile_core

    torch.manual_seed(0)
    scale = 1.0 + 0.5 * rank  # rank 0: 1.0, rank 1: 1.5
    model = RankScaledBlocks(scale)
    ref = copy.deepcopy(model)
    ours, theirs = DDP(model, bucket_cap_mb=0.01), DDP(ref, bucket_cap_mb=0.01)
    compiled = compile_core.compile(ours, backend="inductor")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        x = x64(step, rank)
        for net, o in ((compiled, opt), (theirs, ref_opt)):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    dist.barrier()
    return {
        "params": {n: p.detach() for n, p in model.named_parameters()},
        "ref": {n: p.detach() for n, p in ref.named_parameters()},
        "pieces": compiled.report().to_dict()["piece_compiles"],
        "counters": {k: dict(counters[k]) for k in ("aot_autograd", "inductor")},
    }


def _assert_eager_equal(results):
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.timeout(900)
def test_each_piece_compiled_by_one_rank_of_the_job_and_shipped_rank_specific_never(tmp_path):
    cold = run_ranks(as_node, str(tmp_path), 2, world_size=2, timeout=800)
    _assert_eager_equal(cold)  # rank 1 ran its own head (scale 1.5), not rank 0's (1.0)
    head = "graph_0.piece_5"  # the piece with the rank's scale baked in
    shared = ["graph_0.piece_0", "graph_0.piece_1", "graph_0.piece_2"]
    rows = [{x["name"]: x for x in r["pieces"]} for r in cold]
    for name in shared:  # one rank of the job compiled it; the other got it through the store
        sources = sorted(rows[rank][name]["source"] for rank in (0, 1))
        assert sources in (["compiled here", "from rank 1"], ["compiled here", "from rank 0"]), (name, sources)
        loader = 0 if rows[0][name]["source"].startswith("from rank") else 1
        row = rows[loader][name]
        assert row["cache"] == "aot cache hit" and row["received_bytes"] > 0, row  # shipped, not a shared dir
        assert row["waited_for"].startswith(f"rank {1 - loader} (pid ") and row["leader"] == "done", row
    for rank in (0, 1):
        assert [rows[rank][f"graph_0.piece_{i}"]["source"] for i in (3, 4)] == ["reused", "reused"]
        # The rank-specific piece: compiled by each rank for itself, nobody waited for or shipped it.
        assert rows[rank][head]["source"] == "compiled here", rows[rank][head]
        assert rows[rank][head].get("waited_for") is None and rows[rank][head]["key"] != rows[1 - rank][head]["key"]
    assert sum(r["counters"]["aot_autograd"].get("autograd_cache_miss", 0) for r in cold) == 3 + 2  # 3 shared + 2 heads
    # Nothing of node 0's file system came along in what runs: no entry installed on node 1 names node 0's
    # cache dir, except Inductor's debug repro script (`runnable_graph_str`, only ever written to TORCH_TRACE).
    node0 = os.path.join(str(tmp_path), "node0").encode()
    checked = 0
    for sub in ("aotautograd", "fxgraph"):
        for root, _, files in os.walk(os.path.join(str(tmp_path), "node1", sub)):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    data = f.read()
                if sub == "fxgraph" and node0 in data:
                    entry = pickle.loads(data)
                    entry.runnable_graph_str = ""
                    data = pickle.dumps(entry)
                assert node0 not in data, os.path.join(root, name)
                checked += 1
    assert checked >= 3 + 6  # the shipped pieces' AOT entries and their forward/backward FX entries

    # The job restarts on the same nodes: every piece from the node's own cache, no claim, no wait, no miss.
    warm = run_ranks(as_node, str(tmp_path), 2, world_size=2, timeout=600)
    _assert_eager_equal(warm)
    for rank, r in enumerate(warm):
        distinct = [x for x in r["pieces"] if x["source"] != "reused"]
        assert [x["source"] for x in distinct] == ["from the local cache"] * 4, (rank, distinct)
        assert not any(x.get("waited_for") for x in distinct), distinct
        assert not r["counters"]["aot_autograd"].get("autograd_cache_miss"), r["counters"]
