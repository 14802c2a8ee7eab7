"""compile_core.train_step split into many pieces, on 2 ranks, against an eager DDP training loop.

The headline path: split graph (bucket_cap_mb small enough for >= 3 pieces) + reducer alignment +
compiled optimizer, with SGD-momentum and AdamW, with and without gradient accumulation (the reducer
swap then happens inside `no_sync()` for accum_steps=3), with clipping and with autocast. Each scenario
runs 3 optimizer updates on rank-dependent data; the reference is a hand-written eager DDP loop in the
same process (no_sync for the first k-1 micro-batches, loss/k, clip_grad_norm_, step, zero_grad).
All scenarios run in one 2-rank launch (module-scoped fixture); each test asserts on one entry.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multi_gpu.ddp_compare import (
    BucketLog,
    assert_matches_eager,
    assert_same_compile_on_every_rank,
    ok,
    planned_buckets,
    run_scenarios,
    selected_scenarios,
    snapshot,
    update_rel_err,
)
from tests.multi_gpu.field_models import (
    FROZEN_UNTIL,
    Branchy,
    Headed,
    add_group_at_update_3,
    clear_optimizer_state_at_update_3,
    frozen_until_update_3,
    load_checkpoint_without_head_state_at_update_3,
    regression_data,
    unfreeze_at_update_3,
)
from tests.multi_gpu.models import step_data, step_model
from tests.multi_gpu.user_script import Script, assert_like_eager, run_against_eager
from tests.ranks import run_ranks, to_rank_device, wrap_ddp

# One launch for the whole module; the *_multirank.py name keeps its tests on one xdist worker.
pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(420)]

CAP_MB = 0.015  # just under one Linear(64, 64) (16,640 bytes): one hidden layer per piece, 4 pieces
UPDATES = 3
CLIP = 0.05  # below the gradient norms of this model: clipping really scales the update


make_model, make_data = step_model, step_data

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def _eager_loop(ddp: DDP, opt, data, *, accum: int, clip: float | None, autocast) -> tuple[list, list]:
    """The reference: eager DDP with the same accumulation, clipping and autocast."""
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accum == 0
        with ddp.no_sync() if not last else contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = F.mse_loss(ddp(x), y)
            (loss / accum).backward()
        losses.append(loss.item())
        if last:
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, norms


def _scenario(
    rank: int, *, opt: str, accum: int = 1, clip: float | None = None, autocast=None, ddp_kwargs: dict | None = None
) -> dict:
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(make_model())
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    ours, theirs = wrap_ddp(model, **(ddp_kwargs or {})), wrap_ddp(ref, **(ddp_kwargs or {}))
    log = BucketLog(model).attach(ours)
    step = compile_core.train_step(
        ours,
        OPTIMIZERS[opt](model.parameters()),
        F.mse_loss,
        backend="aot_eager",
        accum_steps=accum,
        clip_grad_norm=clip,
        autocast=autocast,
        bucket_cap_mb=CAP_MB,
    )
    data = to_rank_device(make_data(rank, accum * UPDATES))
    losses, norms, applied = [], [], []
    for x, y in data:
        log.new_step()
        losses.append(step(x, y).item())
        applied.append(step.applied)
        if step.applied and clip is not None:
            norms.append(step.last_grad_norm.item())
    ref_losses, ref_norms = _eager_loop(
        theirs, OPTIMIZERS[opt](ref.parameters()), data, accum=accum, clip=clip, autocast=autocast
    )
    out = {
        "params": snapshot(model),
        "ref": snapshot(ref),
        "initial": initial,
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "applied": applied,
        "reduced": log.steps,
        "report": step.report().to_dict(),
        "expected_reduced": sorted(n for n, _ in model.named_parameters()),
    }
    if autocast is not None:  # what the same loop gives in fp32: a lost autocast would end there
        fp32 = to_rank_device(make_model())
        fp32.load_state_dict(initial)
        _eager_loop(
            wrap_ddp(fp32, **(ddp_kwargs or {})),
            OPTIMIZERS[opt](fp32.parameters()),
            data,
            accum=accum,
            clip=clip,
            autocast=None,
        )
        out["fp32"] = snapshot(fp32)
    return out


def _unfreezing(rank: int, *, pattern: str, mode: str) -> dict:
    """The first layer, frozen when DDP and the optimizer are built, trains from update 3 on: `unfrozen` in
    place (it is in the optimizer from the start), or `group_added` as a new param group then."""
    if pattern == "unfrozen":
        hooks = {"before_step": unfreeze_at_update_3}
        make_opt = lambda m: OPTIMIZERS["adamw"](m.parameters())  # noqa: E731
    else:
        hooks = {"before_step_opt": add_group_at_update_3}
        make_opt = lambda m: OPTIMIZERS["adamw"]([p for p in m.parameters() if p.requires_grad])  # noqa: E731
    script = Script(make_model=frozen_until_update_3, data=regression_data, steps=4, make_opt=make_opt, **hooks)
    return run_against_eager(script, rank, how="train_step", ddp=mode, bucket_cap_mb=CAP_MB)


def _frozen_after_wrapping(rank: int, *, mode: str) -> dict:
    """The first layer, trainable when DDP is built and frozen right after (so DDP's reducer holds it), trains
    again from update 3 on; find_unused_parameters=True, as eager DDP needs for the frozen updates."""
    script = Script(
        make_model=Headed,
        data=regression_data,
        steps=4,
        make_opt=lambda m: OPTIMIZERS["adamw"](m.parameters()),
        setup=lambda ddp: ddp.module.body[0].requires_grad_(False),
        before_step=unfreeze_at_update_3,
        ddp_kwargs={"find_unused_parameters": True},
    )
    return run_against_eager(script, rank, how="train_step", ddp=mode, bucket_cap_mb=CAP_MB)


def _losing_state(rank: int, *, lose: Callable, mode: str) -> dict:
    """AdamW loses optimizer state before update 3 (`lose`: cleared, or a checkpoint without some loaded)."""
    make_opt = lambda m: OPTIMIZERS["adamw"](m.parameters())  # noqa: E731
    script = Script(make_model=Headed, data=regression_data, steps=4, make_opt=make_opt, before_step_opt=lose)
    return run_against_eager(script, rank, how="train_step", ddp=mode, bucket_cap_mb=CAP_MB)


SCENARIOS = {
    "sgd": lambda rank: _scenario(rank, opt="sgd"),
    "sgd_accum2_clip": lambda rank: _scenario(rank, opt="sgd", accum=2, clip=CLIP),
    "adamw_clip": lambda rank: _scenario(rank, opt="adamw", clip=CLIP),
    "adamw_accum2": lambda rank: _scenario(rank, opt="adamw", accum=2),
    # accum 3: the swap happens before micro-batch 3 (after the first synchronising backward), inside no_sync(),
    # with DDP's gradients as views into its buckets
    "adamw_accum3_bucket_view": lambda rank: _scenario(
        rank, opt="adamw", accum=3, ddp_kwargs={"gradient_as_bucket_view": True}
    ),
    "sgd_autocast_bf16": lambda rank: _scenario(rank, opt="sgd", autocast=torch.bfloat16),
    # `extra` never runs (find_unused_parameters=True): no gradient, no optimizer state, ever
    "adamw_parameter_never_used": lambda rank: run_against_eager(
        Script(
            make_model=Branchy,
            data=regression_data,
            make_opt=lambda m: OPTIMIZERS["adamw"](m.parameters()),
            ddp_kwargs={"find_unused_parameters": True},
        ),
        rank,
        how="train_step",
        bucket_cap_mb=CAP_MB,
    ),
    **{
        f"adamw_{pattern}_at_update_3_{mode}": functools.partial(_unfreezing, pattern=pattern, mode=mode)
        for pattern in ("unfrozen", "group_added")
        for mode in ("split", "in_graph")
    },
    **{
        f"adamw_frozen_after_wrapping_unfrozen_at_update_3_{mode}": functools.partial(_frozen_after_wrapping, mode=mode)
        for mode in ("split", "in_graph")
    },
    **{
        f"adamw_{name}_at_update_3_{mode}": functools.partial(_losing_state, lose=lose, mode=mode)
        for name, lose in (
            ("state_cleared", clear_optimizer_state_at_update_3),
            ("checkpoint_without_head_state", load_checkpoint_without_head_state_at_update_3),
        )
        for mode in ("split", "in_graph")
    },
}


def _all_scenarios(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    return run_scenarios(SCENARIOS, rank, names)


@pytest.fixture(scope="module")
def results(request):
    return run_ranks(_all_scenarios, selected_scenarios(request, SCENARIOS), world_size=2, timeout=400)


def _check_reductions(per_rank: list[dict], accum: int) -> None:
    """No all-reduce under no_sync; on every synchronising micro-batch each parameter exactly once; from
    the first synchronising micro-batch after the swap on (the swap comes at the first forward after the first
    synchronising backward: Note [Bucket alignment]), DDP's buckets are our pieces."""
    for rank, r in enumerate(per_rank):
        pieces = [sorted(b) for b in planned_buckets(r["report"])]
        assert r["applied"] == ([False] * (accum - 1) + [True]) * UPDATES
        for i, buckets in enumerate(r["reduced"]):
            if not r["applied"][i]:
                assert buckets == [], f"rank {rank} micro-batch {i}: all-reduce under no_sync: {buckets}"
                continue
            counts = collections.Counter(n for _, names in buckets for n in names)
            assert sorted(counts) == r["expected_reduced"] and set(counts.values()) == {1}, (
                f"rank {rank} micro-batch {i}: each parameter must be reduced once, got {dict(counts)}"
            )
            if (
                i >= accum
            ):  # aligned at the first forward after the first synchronising backward (micro-batch accum - 1)
                real = [sorted(names) for _, names in buckets]
                assert real == pieces, f"rank {rank} micro-batch {i}: DDP reduced {real}, pieces are {pieces}"


def _check_common(per_rank: list[dict], *, accum: int) -> None:
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=3)
    _check_reductions(per_rank, accum)
    for rank, r in enumerate(per_rank):
        assert r["report"]["updates"] == UPDATES
        assert r["report"]["optimizer"]["compiled"], (rank, r["report"]["optimizer"])


def _check_clipping(per_rank: list[dict]) -> None:
    for _rank, r in enumerate(per_rank):
        assert len(r["ref_norms"]) == UPDATES and min(r["ref_norms"]) > CLIP, "the test must actually clip"
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]), rtol=1e-5, atol=1e-6)


def test_sgd_momentum_in_many_pieces_matches_eager_ddp(results):
    _check_common(ok(results, "sgd"), accum=1)


def test_sgd_accumulation_and_clipping_match_eager_ddp(results):
    per_rank = ok(results, "sgd_accum2_clip")
    _check_common(per_rank, accum=2)
    _check_clipping(per_rank)


def test_adamw_with_clipping_matches_eager_ddp(results):
    per_rank = ok(results, "adamw_clip")
    _check_common(per_rank, accum=1)
    _check_clipping(per_rank)


def test_adamw_accumulation_matches_eager_ddp(results):
    _check_common(ok(results, "adamw_accum2"), accum=2)


def test_reducer_swap_inside_no_sync_with_bucket_views_matches_eager_ddp(results):
    _check_common(ok(results, "adamw_accum3_bucket_view"), accum=3)


def test_autocast_bf16_in_many_pieces_matches_eager_autocast_not_fp32(results):
    per_rank = ok(results, "sgd_autocast_bf16")
    # Tight on the update: bf16 rounding reproduced, not approximated (seen: 3e-5 of the update). The fp32
    # run of the same loop ends > 1e-3 of the update away (seen: 6e-3; asserted, so the check can fail).
    assert_matches_eager(per_rank, update_rtol=1e-4)
    for r in per_rank:
        assert update_rel_err(r["fp32"], r["ref"], r["initial"]) > 1e-3, "autocast made no difference"
    assert_same_compile_on_every_rank(per_rank, min_pieces=3)
    _check_reductions(per_rank, accum=1)


def test_a_parameter_that_never_gets_a_gradient_leaves_the_optimizer_update_compiled(results):
    """torch's step skips a parameter without a gradient; the compiled update of its chunk must too,
    rather than sending the whole update to eager."""
    per_rank = ok(results, "adamw_parameter_never_used")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    for r in per_rank:
        optimizer = r["report"]["optimizer"]
        assert optimizer["compiled"] and optimizer["fallback_error"] is None, optimizer
        assert r["params"]["extra.weight"].equal(r["initial"]["extra.weight"])


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("split", marks=pytest.mark.scenarios("adamw_unfrozen_at_update_3_split")),
        pytest.param(
            "in_graph", marks=[pytest.mark.compat, pytest.mark.scenarios("adamw_unfrozen_at_update_3_in_graph")]
        ),
    ],
)
def test_a_layer_unfrozen_after_update_2_is_updated_as_torch_updates_it(results, mode):
    """Gradual unfreezing: a layer frozen when DDP and the optimizer were built trains from update 3 on;
    the compiled update used to leave it where it was, silently (it planned its chunks from the parameters
    that required grad at update 1). DDP never reduces it (it was frozen when DDP was built), in eager too."""
    per_rank = ok(results, f"adamw_unfrozen_at_update_3_{mode}")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=FROZEN_UNTIL)
    for r in per_rank:
        for name in FROZEN_UNTIL:
            assert not r["params"][name].equal(r["initial"][name]), f"{name} was never updated"


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(mode, marks=pytest.mark.scenarios(f"adamw_frozen_after_wrapping_unfrozen_at_update_3_{mode}"))
        for mode in ("split", "in_graph")
    ],
)
def test_a_layer_frozen_after_wrapping_and_unfrozen_later_is_reduced_as_ddp_reduces_it(results, mode):
    """DDP's reducer holds a layer that required grad when DDP was built, frozen or not since: once unfrozen its
    gradient is averaged. The reducer our split mode installs used to be built from the parameters requiring
    grad at the swap, leaving that layer out: each rank then trained it on its own gradient, silently."""
    per_rank = ok(results, f"adamw_frozen_after_wrapping_unfrozen_at_update_3_{mode}")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)  # every parameter identical on both ranks too
    for r in per_rank:
        for name in FROZEN_UNTIL:
            assert not r["params"][name].equal(r["initial"][name]), f"{name} was never updated"


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_a_param_group_added_after_update_2_is_updated_with_its_own_lr(results, mode):
    """`optimizer.add_param_group` (Lightning's BackboneFinetuning unfreezes so) at update 3: the compiled
    update built for the first group must step the new one too, with the new group's lr."""
    per_rank = ok(results, f"adamw_group_added_at_update_3_{mode}")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=FROZEN_UNTIL)
    for r in per_rank:
        assert len(r["param_groups"]) == 2 and r["param_groups"][1]["lr"] != r["param_groups"][0]["lr"]
        for name in FROZEN_UNTIL:
            assert not r["params"][name].equal(r["initial"][name]), f"{name} was never updated"


@pytest.mark.parametrize("mode", ["split", "in_graph"])
@pytest.mark.parametrize("name", ["state_cleared", "checkpoint_without_head_state"])
def test_optimizer_state_lost_before_update_3_is_recreated_as_torch_recreates_it(results, name, mode):
    """`optimizer.state.clear()`, or `load_state_dict` of a checkpoint without the head's state, before
    update 3: torch's step starts those parameters afresh; the compiled update read their old state
    (KeyError 'step') and must let torch's step create it first."""
    per_rank = ok(results, f"adamw_{name}_at_update_3_{mode}")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    for r in per_rank:
        optimizer = r["report"]["optimizer"]
        assert optimizer["compiled"] and optimizer["fallback_error"] is None, optimizer
