"""`ddp="in_graph"` with `backend="inductor"` on field scripts, against the eager script.

The field suite (test_in_graph_field_multirank.py) runs on aot_eager. Through Inductor the bucket copy,
the cast to the wire dtype, the division by the world size and the cast back are fused into Inductor's
kernels, which feed each bucket's all-reduce: these scenarios check that compiled path against the user's
eager DDP loop, several patterns per script to keep the Inductor compiles few. 2 ranks, rank-dependent data, 3
SGD-momentum updates.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.field_models import aux_on_head_bias, bf16_by_hand
from tests.multi_gpu.test_in_graph_field_multirank import _in_graph, _script
from tests.multi_gpu.user_script import assert_like_eager
from tests.ranks import run_ranks

pytestmark = [pytest.mark.multi_gpu, pytest.mark.inductor, pytest.mark.timeout(600)]

IGNORED = ("body.2.weight", "body.2.bias")


def _fp16_hook(ddp) -> None:
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


SCENARIOS = {
    # DDP's fp16 hook with an auxiliary loss on head.bias (reduced after the backward, in fp16 as well) and
    # parameters DDP ignores (their gradients stay local)
    "fp16_hook_aux_loss_ignored": lambda r: _in_graph(
        r, _script(setup=_fp16_hook, loss=aux_on_head_bias, ignore=IGNORED), backend="inductor"
    ),
    # our reduce_dtype against the eager script's bf16 compression hook, with static_graph
    "reduce_dtype_bf16_static_graph": lambda r: _in_graph(
        r,
        _script(eager_setup=lambda d: d.register_comm_hook(None, bf16_by_hand), ddp_kwargs={"static_graph": True}),
        reduce_dtype=torch.bfloat16,
        backend="inductor",
    ),
    # no_sync accumulation: the synchronising graph takes the accumulated .grad (a graph input Inductor saves
    # for its backward) and reduces it with its own micro-batch
    "accumulation": lambda r: _in_graph(r, _script(accum=2), backend="inductor"),
    # the same under CUDA graphs' mode, which copies graph inputs at the forward: lending is off there (on this
    # CPU Inductor skips the capture, and the mode's choice is what is checked)
    "accumulation_cuda_graphs_mode": lambda r: _in_graph(
        r, _script(accum=2), backend="inductor", mode="reduce-overhead"
    ),
}


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, world_size=2, timeout=580)


def _assert_reduced_in_the_graph(report: dict, wire: str | None) -> None:
    in_graph = report["in_graph"]
    assert in_graph["reduce_dtype"] == wire, in_graph
    assert in_graph["reducer"] == "compiled backward", in_graph
    assert report["fallbacks"] == [], report["fallbacks"]


def test_fp16_hook_with_an_aux_loss_and_ignored_parameters_trains_like_eager_ddp(results):
    per_rank = ok(results, "fp16_hook_aux_loss_ignored")
    # Inductor's fused kernels round fp32 arithmetic differently from eager's; the fp16 wire adds nothing
    # beyond that (world size 2: the division is exact, and the sum is rounded once on both sides)
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-5, not_reduced=IGNORED)
    report = per_rank[0]["report"]
    _assert_reduced_in_the_graph(report, "torch.float16")
    assert report["in_graph"]["outside_graph"] == ["head.bias"], report["in_graph"]
    for name in IGNORED:
        assert not torch.equal(per_rank[0]["params"][name], per_rank[1]["params"][name]), name


def test_reduce_dtype_bf16_with_static_graph_trains_like_ddps_bf16_compression(results):
    per_rank = ok(results, "reduce_dtype_bf16_static_graph")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-5)
    _assert_reduced_in_the_graph(per_rank[0]["report"], "torch.bfloat16")


@pytest.mark.parametrize(
    "scenario, synchronising_variant, reduced_after",
    [("accumulation", "reduce_acc", False), ("accumulation_cuda_graphs_mode", "reduce", True)],
)
def test_no_sync_accumulation_trains_like_eager_ddp(results, scenario, synchronising_variant, reduced_after):
    per_rank = ok(results, scenario)
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-5)
    report = per_rank[0]["report"]
    _assert_reduced_in_the_graph(report, None)  # the gradients' own dtype on the wire
    assert sorted(g["variant"] for g in report["graphs"]) == ["local", synchronising_variant], report["graphs"]
    assert bool(report["in_graph"]["leftovers_last_step"]) == reduced_after, report["in_graph"]
