"""`train_step` with a foreach AdamW or SGD (CUDA's default), whose update after the backward is torch's fused step
(compile_core/step/fused.py), on field scripts against the eager script.

Each scenario replays a user's eager DDP loop (tests/multi_gpu/user_script.py: same DDP options, comm hook,
optimizer with `foreach=True`, param groups, accumulation) through `compile_core.train_step` with
`ddp="split"` and `ddp="in_graph"` on 2 ranks with rank-dependent data, and checks the parameters and the
optimizer state against the same loop run eagerly (torch's own foreach step), and that the update ran as
torch's fused step. All scenarios run in one 2-rank launch (module-scoped fixture).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.field_models import (
    Branchy,
    Halve,
    Headed,
    SparseBag,
    aux_on_head_bias,
    branch_from,
    halve_hook,
    index_data,
    load_checkpoint_without_head_state_at_update_3,
    regression_data,
)
from tests.multi_gpu.test_in_backward_field_multirank import adamw_groups, frozen_body_start
from tests.multi_gpu.user_script import Script, assert_like_eager, run_against_eager

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(480)]

CAP_MB = 0.015
UPDATES = 4


def adamw_foreach(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)


def adamw_foreach_groups(model):
    return adamw_groups(model, foreach=True)


def sgd_foreach(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=True)


def sgd_momentum_foreach_no_decay(model):
    """(torch's SGD cannot add weight decay to a sparse gradient)"""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)


def sgd_nesterov_foreach(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, foreach=True)


def _script(**kwargs) -> Script:
    kwargs.setdefault("make_model", Headed)
    kwargs.setdefault("data", regression_data)
    kwargs.setdefault("steps", UPDATES)
    kwargs.setdefault("make_opt", adamw_foreach)
    return Script(**kwargs)


CASES = {
    "param_groups": lambda: _script(make_opt=adamw_foreach_groups),
    "aux_loss_on_head_bias": lambda: _script(loss=aux_on_head_bias),
    "frozen_parameters": lambda: _script(make_model=frozen_body_start),
    "branch_joins_at_update_3": lambda: _script(
        make_model=Branchy, before_step=branch_from(2), ddp_kwargs={"find_unused_parameters": True}
    ),
    "static_graph": lambda: _script(ddp_kwargs={"static_graph": True}),
    "no_sync_accumulation": lambda: _script(accum=2),
    "custom_comm_hook": lambda: _script(setup=lambda d: d.register_comm_hook(Halve(), halve_hook)),
    "process_subgroup": lambda: _script(group=lambda: dist.new_group([0, 1])),
    "checkpoint_without_head_state_at_update_3": lambda: _script(
        before_step_opt=load_checkpoint_without_head_state_at_update_3
    ),
    "sgd_momentum": lambda: _script(make_opt=sgd_foreach),
    "sgd_nesterov_accumulation": lambda: _script(make_opt=sgd_nesterov_foreach, accum=2),
}

SCENARIOS = {
    f"{name}_{mode}": (
        lambda r, make=make, mode=mode: run_against_eager(make(), r, how="train_step", ddp=mode, bucket_cap_mb=CAP_MB)
    )
    for name, make in CASES.items()
    for mode in ("split", "in_graph")
}


# ddp="in_graph" refuses sparse gradients (by name); ddp="split" leaves them to DDP's reducer
SCENARIOS["sparse_embedding_sgd_split"] = lambda r: run_against_eager(
    _script(make_model=SparseBag, data=index_data, make_opt=sgd_momentum_foreach_no_decay),
    r,
    how="train_step",
    ddp="split",
)


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    from tests.ranks import run_ranks

    return run_ranks(_all, world_size=2, timeout=460)


@pytest.mark.parametrize("mode", ["split", "in_graph"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_foreach_adamw_or_sgd_steps_fused_like_the_eager_foreach_script(results, case, mode):
    per_rank = ok(results, f"{case}_{mode}")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    for r in per_rank:
        opt = r["report"]["optimizer"]
        assert "fused=True" in (opt["as_is"] or "") and opt["graphs"] == 0, opt
        # the user's flags, as the script built them, after every update
        assert all(g["foreach"] is True and not g.get("fused") for g in r["param_groups"]), r["param_groups"]


def test_a_sparse_embedding_with_a_foreach_sgd_reduces_and_steps_like_eager(results):
    """DDP gives a sparse-gradient parameter a bucket of its own (a Reducer refuses it among others), so the
    aligned buckets do too; torch's fused SGD refuses sparse gradients, so that parameter's group takes the
    user's foreach step."""
    per_rank = ok(results, "sparse_embedding_sgd_split")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    for r in per_rank:
        alignment = r["report"]["alignment"]
        assert alignment["status"] == "aligned" and ["emb.weight"] in alignment["buckets"], alignment
        assert r["report"]["optimizer"]["graphs"] == 0, r["report"]["optimizer"]
