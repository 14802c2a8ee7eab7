"""ZeroRedundancyOptimizer (ZeRO stage 1: each rank updates its shard of the parameters and broadcasts it; llm.c's
`zero_stage=1`) through each way of using compile_core, against the same eager DDP loop on 2 ranks with
rank-dependent data. Its step holds collectives of its own (the shards' broadcasts), which the compiled update
must leave in place on every rank."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.field_models import Headed, regression_data
from tests.multi_gpu.user_script import Script, assert_like_eager, run_against_eager
from tests.ranks import run_ranks

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(300)]

CAP_MB = 0.015


def zero_adamw(model):
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _script(**kw):
    return Script(make_model=Headed, data=regression_data, steps=4, make_opt=zero_adamw, **kw)


SCENARIOS = {
    "compile_split": lambda r: run_against_eager(_script(), r, how="compile", ddp="split", bucket_cap_mb=CAP_MB),
    "compile_in_graph": lambda r: run_against_eager(_script(), r, how="compile", ddp="in_graph", bucket_cap_mb=CAP_MB),
    "train_step_split": lambda r: run_against_eager(_script(accum=2), r, how="train_step", bucket_cap_mb=CAP_MB),
    "train_step_in_graph": lambda r: run_against_eager(
        _script(accum=2), r, how="train_step", ddp="in_graph", bucket_cap_mb=CAP_MB
    ),
    "train_step_in_backward": lambda r: run_against_eager(
        _script(), r, how="train_step", ddp="in_graph", optimizer_in_backward=True, bucket_cap_mb=CAP_MB
    ),
}


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, world_size=2, timeout=280)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_zero_redundancy_optimizer_trains_like_eager_ddp(results, name):
    per_rank = ok(results, name)
    # The compiled AdamW rounds differently from eager's (the same tolerance as the other compiled updates).
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)


def test_zero_redundancy_optimizer_keeps_its_update_after_the_backward_and_says_why(results):
    """The in-backward update knows SGD, Adam and AdamW per parameter; ZeRO's step (a shard, then broadcasts) is
    run as the optimizer's own step, and the report names the class."""
    report = ok(results, "train_step_in_backward")[0]["report"]["optimizer_in_backward"]
    assert report["requested"] and not report["active"], report
    assert "ZeroRedundancyOptimizer" in report["reason"], report
