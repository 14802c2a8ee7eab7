"""Compile once on two ranks: identical pieces reused, each distinct piece compiled by one rank and
loaded by the other, a warm second job taking everything from the cache, a failing leader."""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch

from tests.ranks import run_ranks, to_rank_device, wrap_ddp
from tests.single.ddp_helpers import Blocks, x64

pytestmark = pytest.mark.multi_gpu


def train_blocks(rank: int, world_size: int, backend: str, cache_dir: str | None, fail_leader: bool = False):
    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before anything compiles in this process
    from torch._dynamo.utils import counters

    import compile_core

    if fail_leader:
        _make_rank0_a_failing_leader(rank)
    torch.manual_seed(0)
    # The failing-leader case uses one small graph: both ranks go for the same piece first.
    model = to_rank_device(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        if fail_leader
        else Blocks()
    )
    ref = copy.deepcopy(model)
    cap = 25 if fail_leader else 0.01
    ours, theirs = wrap_ddp(model, bucket_cap_mb=cap), wrap_ddp(ref, bucket_cap_mb=cap)
    compiled = compile_core.compile(ours, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        if fail_leader and rank == 1 and step == 0:
            time.sleep(4)  # after DDP's constructor (a collective): rank 0 claims the piece first
        x = to_rank_device(x64(step, rank))
        for net, o in ((compiled, opt), (theirs, ref_opt)):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    return {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "ref": {n: p.detach().cpu() for n, p in ref.named_parameters()},
        "report": compiled.report().to_dict(),
        "counters": {k: dict(counters[k]) for k in ("aot_autograd", "inductor")},
    }


def _make_rank0_a_failing_leader(rank: int) -> None:
    """Rank 0 claims the piece first and fails after a while; rank 1 arrives meanwhile and waits."""
    import compile_core.pieces as pieces

    if rank == 0:

        def failing(*args, **kwargs):
            time.sleep(8)
            raise RuntimeError("leader failed on purpose")

        pieces.inductor_compile = failing


def assert_equal_to_eager(results):
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")


def reused(report) -> list[str]:
    return sorted(r["name"] for r in report["piece_compiles"] if r["reused_from"])


# Blocks() with a 0.01 MiB cap: inp | each block cut in two at the same place | head; pieces 3..8 reuse 1 and 2.
REUSED = [f"graph_0.piece_{i}" for i in range(3, 9)]


@pytest.mark.timeout(300)
def test_reused_pieces_give_eager_ddp_results_aot_eager():
    results = run_ranks(train_blocks, "aot_eager", None, world_size=2, timeout=280)
    assert_equal_to_eager(results)
    for r in results:
        assert reused(r["report"]) == REUSED
        assert r["report"]["alignment"]["status"] == "aligned"


@pytest.mark.inductor
@pytest.mark.timeout(1200)
def test_inductor_ranks_share_compiles_and_a_warm_job_hits_every_cache(tmp_path):
    cache = str(tmp_path / "inductor_cache")
    cold = run_ranks(train_blocks, "inductor", cache, world_size=2, timeout=700)
    assert_equal_to_eager(cold)
    distinct = [r["name"] for r in cold[0]["report"]["piece_compiles"] if not r["reused_from"]]
    assert len(distinct) == 4 and all(reused(r["report"]) == REUSED for r in cold)
    # Each distinct piece was compiled by one rank and loaded from the cache by the other.
    for name in distinct:
        rows = [next(x for x in r["report"]["piece_compiles"] if x["name"] == name) for r in cold]
        states = sorted("hit" if x["cache"] == "aot cache hit" else "compiled" for x in rows)
        assert states == ["compiled", "hit"], (name, rows)
        assert all(x["cache"].startswith("aot cache") for x in rows), rows  # never bypassed

    warm = run_ranks(train_blocks, "inductor", cache, world_size=2, timeout=400)
    assert_equal_to_eager(warm)
    for rank, r in enumerate(warm):
        rows = [x for x in r["report"]["piece_compiles"] if not x["reused_from"]]
        assert [x["cache"] for x in rows] == ["aot cache hit"] * 4, (rank, rows)
        pairs = r["report"]["pairs"]
        assert [p["cache"] for p in pairs] == ["hit"] * 4 and all(p["backward_ops"] for p in pairs), pairs
        aot, fx = r["counters"]["aot_autograd"], r["counters"]["inductor"]
        # no AOT trace, no Inductor lowering, forward or backward
        assert (
            aot.get("autograd_cache_hit") == 4
            and not aot.get("autograd_cache_miss")
            and not aot.get("autograd_cache_bypass")
        ), aot
        assert not fx.get("fxgraph_cache_miss") and fx.get("fxgraph_cache_hit") == 8, fx


@pytest.mark.inductor
@pytest.mark.timeout(900)
def test_a_failing_leader_makes_the_other_rank_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_COMPILE_CLAIM_TIMEOUT_S", "120")
    results = run_ranks(train_blocks, "inductor", str(tmp_path / "cache"), True, world_size=2, timeout=800)
    assert_equal_to_eager(results)
    leader, follower = (r["report"] for r in results)
    # rank 0 fell back (its inductor "failed"); rank 1 waited for it, a bounded time, then compiled itself
    assert leader["fallbacks"] and all(f["to"] == "aot_eager" for f in leader["fallbacks"])
    waits = [x for x in follower["piece_compiles"] if x.get("waited_for")]
    assert waits, follower["piece_compiles"]
    assert all(x["waited_for"].startswith("rank 0 (pid ") for x in waits)
    assert any(x["leader"] == "failed: fell back to aot_eager" for x in waits)
    assert all(0 < x["waited_s"] < 120 for x in waits)
    assert follower["fallbacks"] == []  # it compiled with inductor itself
    assert [x["cache"].split(",")[0] for x in follower["piece_compiles"]] == ["aot cache miss"]
    assert any("fallbacks" in d["difference"] for d in follower["rank_differences"])  # and says rank 0 differs


def train_step_in_graph(rank: int, world_size: int, cache_dir: str) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before anything compiles in this process
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(Blocks())
    ref = copy.deepcopy(model)
    ours, theirs = wrap_ddp(model, bucket_cap_mb=0.01), wrap_ddp(ref, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    step = compile_core.train_step(ours, opt, lambda out, _: out.square().mean(), backend="inductor", ddp="in_graph")
    for i in range(3):
        x = to_rank_device(x64(i, rank))
        step(x, None)
        theirs(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    return {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "ref": {n: p.detach().cpu() for n, p in ref.named_parameters()},
        "update_compiles": step.report().to_dict()["optimizer"]["graph_compiles"],
    }


@pytest.mark.inductor
@pytest.mark.timeout(900)
def test_a_rank_waiting_for_the_one_graph_compiles_the_optimizer_update_meanwhile(tmp_path):
    """ddp="in_graph": one rank compiles the model's graph, the other waits for it and compiles the
    optimizer update (on stand-ins) in that time; update 1 then compiles nothing more on that rank, and
    every update is eager DDP's."""
    results = run_ranks(train_step_in_graph, str(tmp_path / "cache"), world_size=2, timeout=800)
    assert_equal_to_eager(results)
    ahead = [[r for r in res["update_compiles"] if r.get("ahead")] for res in results]
    waited = [rank for rank, rows in enumerate(ahead) if rows]
    assert len(waited) == 1, [res["update_compiles"] for res in results]
    rows = results[waited[0]]["update_compiles"]
    assert all(r["ahead"] for r in rows if not r["reused_from"]), rows  # nothing compiled again at update 1
