"""`train_step(ddp="in_graph", optimizer_in_backward=True)` on field scripts, against the eager script.

Each scenario replays a user's eager DDP loop (tests/multi_gpu/user_script.py: same DDP options, comm
hook, optimizer, param groups, schedule, accumulation, clipping) through `compile_core.train_step` on 2
ranks with rank-dependent data for 4 updates, and checks the parameters and optimizer state against
the same loop run eagerly, and where the update ran (inside the backward from update 2, or the normal
path with a reason). All scenarios run in one 2-rank launch (module-scoped fixture).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.field_models import (
    FROZEN_UNTIL,
    BlocksWithBreaks,
    Branchy,
    Halve,
    Headed,
    MaxNormEmbedding,
    Mixed,
    Regioned,
    SharedAfterNestedBreak,
    TiedAcrossBreak,
    add_group_at_update_3,
    aux_on_block_bias,
    aux_on_head_bias,
    bf16_by_hand,
    branch_from,
    branch_on_rank_0_first,
    clamp_grad_hooks,
    clear_optimizer_state_at_update_3,
    frozen_until_update_3,
    halve_hook,
    last_batch_smaller,
    load_checkpoint_without_head_state_at_update_3,
    regioned_first_block_frozen,
    regression_data,
    rewind_step_counts_at_update_3,
    unfreeze_at_update_3,
)
from tests.multi_gpu.user_script import Script, assert_like_eager, run_against_eager
from tests.ranks import run_ranks

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(480)]

CAP_MB = 0.015
UPDATES = 4


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05)


def sgd_big_steps(model):
    """Steps large against a bf16 ulp, so the update, not bf16 rounding, decides the comparison."""
    return torch.optim.SGD(model.parameters(), lr=0.5)


def sgd_momentum_foreach(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def adamw_fused(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def adam_fused(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)


def adamw_groups(model, **options):
    """The usual transformer recipe: weight decay on matrices, none on biases, and another lr (`options`: more
    AdamW arguments, `foreach=True`...)."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.95)},
        ],
        lr=1e-2,
        **options,
    )


class DecayFromUpdate3(torch.optim.lr_scheduler.LRScheduler):
    """A weight-decay warm-up written as a scheduler: no decay for two updates, then 0.1 (lr unchanged)."""

    def get_lr(self):
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.0 if self.last_epoch < 2 else 0.1
        return [group["lr"] for group in self.optimizer.param_groups]


def adamw_no_decay(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)


def frozen_body_start() -> Headed:
    """A model whose first body layer is frozen (fine-tuning): its parameters stay in the optimizer, never get
    a gradient, and neither torch nor the backward may update them."""
    model = Headed()
    for p in list(model.body.parameters())[:2]:
        p.requires_grad_(False)
    return model


def _script(**kwargs) -> Script:
    kwargs.setdefault("make_model", Headed)
    kwargs.setdefault("data", regression_data)
    kwargs.setdefault("steps", UPDATES)
    return Script(**kwargs)


def _step(rank: int, script: Script, **kwargs) -> dict:
    kwargs.setdefault("bucket_cap_mb", CAP_MB)
    return run_against_eager(script, rank, how="train_step", ddp="in_graph", optimizer_in_backward=True, **kwargs)


def _unclipped(rank: int, script: Script) -> dict:
    """The same script without clipping (eager only matters): to show clipping changed the update."""
    script.clip = None
    return run_against_eager(script, rank, how="compile", ddp="in_graph", bucket_cap_mb=CAP_MB)


SCENARIOS = {
    "plain_sgd": lambda r: _step(r, _script(make_opt=sgd)),
    "sgd_momentum_foreach": lambda r: _step(r, _script(make_opt=sgd_momentum_foreach)),
    "adam_fused": lambda r: _step(r, _script(make_opt=adam_fused)),
    "adamw_param_groups": lambda r: _step(r, _script(make_opt=adamw_groups)),
    "aux_loss_sgd": lambda r: _step(r, _script(loss=aux_on_head_bias)),
    "aux_loss_adamw": lambda r: _step(r, _script(loss=aux_on_head_bias, make_opt=adamw)),
    "aux_loss_clip": lambda r: _step(r, _script(loss=aux_on_head_bias, make_opt=adamw, clip=0.05)),
    "branch_joins_at_update_3": lambda r: _step(
        r, _script(make_model=Branchy, before_step=branch_from(2), ddp_kwargs={"find_unused_parameters": True})
    ),
    "branch_on_rank_0_at_update_1": lambda r: _step(
        r,
        _script(
            make_model=Branchy,
            make_opt=adamw,
            before_step=branch_on_rank_0_first,
            ddp_kwargs={"find_unused_parameters": True},
        ),
    ),
    "static_graph": lambda r: _step(r, _script(make_opt=adamw, ddp_kwargs={"static_graph": True})),
    "process_subgroup": lambda r: _step(r, _script(make_opt=adamw, group=lambda: dist.new_group([0, 1]))),
    "frozen_parameters": lambda r: _step(r, _script(make_model=frozen_body_start, make_opt=adamw)),
    "ignored_parameters": lambda r: _step(r, _script(make_opt=adamw, ignore=("body.2.weight", "body.2.bias"))),
    "custom_comm_hook": lambda r: _step(r, _script(setup=lambda d: d.register_comm_hook(Halve(), halve_hook))),
    "fp16_compress_hook": lambda r: _step(
        r, _script(make_opt=adamw, setup=lambda d: d.register_comm_hook(None, default_hooks.fp16_compress_hook))
    ),
    "mixed_dtypes": lambda r: _step(r, _script(make_model=Mixed, make_opt=adamw)),
    "mixed_dtypes_fused": lambda r: _step(r, _script(make_model=Mixed, make_opt=adamw_fused)),
    "mixed_dtypes_clip": lambda r: _step(r, _script(make_model=Mixed, make_opt=sgd_big_steps, clip=0.5)),
    "mixed_dtypes_clip_unclipped": lambda r: _unclipped(r, _script(make_model=Mixed, make_opt=sgd_big_steps, clip=0.5)),
    "sgd_clip": lambda r: _step(r, _script(make_opt=sgd, clip=0.05)),
    "sgd_clip_unclipped": lambda r: _unclipped(r, _script(make_opt=sgd, clip=0.05)),
    "accumulation": lambda r: _step(r, _script(make_opt=adamw, accum=2)),
    "last_batch_smaller": lambda r: _step(r, _script(make_opt=adamw, data=last_batch_smaller)),
    "gradient_hooks_clamp": lambda r: _step(r, _script(make_opt=adamw, setup=clamp_grad_hooks)),
    "nested_compile_region_blocks": lambda r: _step(r, _script(make_model=Regioned, make_opt=adamw)),
    "regions_aux_loss_on_block_bias": lambda r: _step(
        r, _script(make_model=Regioned, loss=aux_on_block_bias, make_opt=adamw)
    ),
    "regions_param_groups": lambda r: _step(r, _script(make_model=Regioned, make_opt=adamw_groups)),
    "regions_static_graph": lambda r: _step(
        r, _script(make_model=Regioned, make_opt=adamw, ddp_kwargs={"static_graph": True})
    ),
    "regions_accumulation": lambda r: _step(r, _script(make_model=Regioned, make_opt=adamw, accum=2)),
    "regions_sgd_clip": lambda r: _step(r, _script(make_model=Regioned, make_opt=sgd, clip=0.05)),
    "regions_sgd_clip_unclipped": lambda r: _unclipped(r, _script(make_model=Regioned, make_opt=sgd, clip=0.05)),
    "regions_first_block_frozen": lambda r: _step(r, _script(make_model=regioned_first_block_frozen, make_opt=adamw)),
    "regions_ignored_block": lambda r: _step(
        r, _script(make_model=Regioned, make_opt=adamw, ignore=("blocks.2.fc.weight", "blocks.2.fc.bias"))
    ),
    "weight_decay_schedule_from_zero": lambda r: _step(
        r, _script(make_opt=adamw_no_decay, make_sched=DecayFromUpdate3)
    ),
    "forward_writes_a_parameter": lambda r: _step(r, _script(make_model=MaxNormEmbedding, make_opt=adamw)),
    "group_added_at_update_3": lambda r: _step(
        r,
        _script(
            make_model=frozen_until_update_3,
            before_step_opt=add_group_at_update_3,
            make_opt=lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9),
        ),
    ),
    "unfrozen_at_update_3": lambda r: _step(
        r, _script(make_model=frozen_until_update_3, before_step=unfreeze_at_update_3, make_opt=sgd_momentum_foreach)
    ),
    "state_cleared_at_update_3": lambda r: _step(
        r, _script(make_opt=adamw, before_step_opt=clear_optimizer_state_at_update_3)
    ),
    "checkpoint_without_head_state_at_update_3": lambda r: _step(
        r, _script(make_opt=adamw, before_step_opt=load_checkpoint_without_head_state_at_update_3)
    ),
    "step_counts_rewound_at_update_3": lambda r: _step(
        r, _script(make_opt=adamw, before_step_opt=rewind_step_counts_at_update_3)
    ),
    "tied_across_graph_break": lambda r: _step(r, _script(make_model=TiedAcrossBreak, make_opt=adamw)),
    "tied_across_graph_break_clip": lambda r: _step(r, _script(make_model=TiedAcrossBreak, make_opt=sgd, clip=0.05)),
    "shared_after_nested_break": lambda r: _step(r, _script(make_model=SharedAfterNestedBreak, make_opt=adamw)),
    "blocks_with_breaks": lambda r: _step(r, _script(make_model=BlocksWithBreaks, make_opt=adamw)),
    "reduce_dtype_bf16": lambda r: _step(
        r,
        _script(make_opt=adamw, eager_setup=lambda d: d.register_comm_hook(None, bf16_by_hand)),
        reduce_dtype=torch.bfloat16,
    ),
    "momentum_cleared_at_update_3": lambda r: _step(
        r, _script(make_opt=sgd_momentum_foreach, before_step_opt=clear_optimizer_state_at_update_3)
    ),
}


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, world_size=2, timeout=460)


def _iob(r: dict) -> dict:
    return r["report"]["optimizer_in_backward"]


def _assert_in_backward(per_rank: list[dict], *, kept: int = 0) -> None:
    """Updates 2.. ran inside the backward, and when each backward ended only `kept` parameters
    still held a gradient (the ones the normal step updates after it)."""
    for r in per_rank:
        iob = _iob(r)
        assert iob["active"] and iob["from_update"] == 2, iob
        assert iob["updates_in_backward"] == UPDATES - 1, iob
        assert iob["grads_kept_last_backward"] == kept, iob


@pytest.mark.parametrize(
    "name",
    [
        "plain_sgd",
        "sgd_momentum_foreach",
        "adam_fused",
        "adamw_param_groups",
        "static_graph",
        "process_subgroup",
        "frozen_parameters",
        "accumulation",
        "weight_decay_schedule_from_zero",
        "nested_compile_region_blocks",
        "regions_param_groups",
        "regions_static_graph",
        "regions_accumulation",
        "regions_first_block_frozen",
        "forward_writes_a_parameter",
    ],
)
def test_updates_inside_the_backward_like_the_eager_script(results, name):
    per_rank = ok(results, name)
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank)


def test_parameters_with_gradient_hooks_are_updated_by_the_normal_step_from_the_hooked_average(results):
    per_rank = ok(results, "gradient_hooks_clamp")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank, kept=4)  # the hooked ones, updated right after the backward
    assert per_rank[0]["report"]["in_graph"]["gradient_hooks"] == [
        "body.0.bias",
        "body.0.weight",
        "head.bias",
        "head.weight",
    ]


def test_a_smaller_last_batch_recompiles_dynamic_and_still_updates_in_the_backward(results):
    # The dynamic graph saves symbolic sizes for its backward, which AOTAutograd passes before the
    # saved tensors: the update must read the parameters and state it was planned for, not neighbours.
    per_rank = ok(results, "last_batch_smaller")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank)
    report = per_rank[0]["report"]
    assert len(report["graphs"]) >= 2, "the smaller batch compiled no second graph: nothing dynamic was tested"
    assert report["in_graph"]["fallbacks"] == [], report["in_graph"]["fallbacks"]
    assert report["fallbacks"] == [], report["fallbacks"]


@pytest.mark.parametrize("name", ["aux_loss_sgd", "aux_loss_adamw"])
def test_an_auxiliary_loss_parameter_is_updated_by_the_normal_step_in_the_same_step(results, name):
    per_rank = ok(results, name)
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank, kept=1)  # head.bias: reduced and updated after the backward
    assert per_rank[0]["report"]["in_graph"]["outside_graph"] == ["head.bias"]


def test_a_layer_called_on_both_sides_of_a_graph_break_is_updated_by_the_normal_step(results):
    """Tied weights across a graph break (an LM's embedding and head, T5 on Dynamo 2.11): the layer is an input
    of both graphs, so the later graph's backward, which compiles knowing the earlier graph ran, must not
    update it with its own share of the gradient; the earlier graph, which ends at the break, updates nothing."""
    per_rank = ok(results, "tied_across_graph_break")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank, kept=6)  # shared.* (both graphs) and body.* (the graph before the break)
    iob = _iob(per_rank[0])
    assert iob["not_updated_in_backward"] == ["shared.weight", "shared.bias"], iob
    assert per_rank[0]["report"]["in_graph"]["outside_graph"] == ["shared.bias", "shared.weight"]


def test_a_layer_shared_with_a_graph_after_a_nested_frame_is_left_to_the_normal_step(results):
    """`shared` is taken by the submodule frame's last graph and by the caller's graph after it. That submodule
    graph ends without a break and compiles before the caller's graph exists, so only the count of `shared`'s
    uses in update 1's eager autograd graph (two, against one in each graph) tells it that another graph's
    backward adds to the gradient; before, it updated `shared` with its own share and update 2 raised."""
    per_rank = ok(results, "shared_after_nested_break")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    iob = _iob(per_rank[0])
    assert iob["active"] and iob["updates_in_backward"] == UPDATES - 1, iob
    assert iob["not_updated_in_backward"] == ["shared.weight", "shared.bias"], iob
    assert per_rank[0]["report"]["in_graph"]["outside_graph"] == ["shared.bias", "shared.weight"]


def test_one_graph_run_for_several_blocks_updates_each_blocks_parameters_inside_the_backward(results):
    """A graph break in the loop over identical blocks: Dynamo skips the loop's frame and compiles each layer's
    own frame, one graph that then runs for every later layer of that shape, with that layer's parameters.
    Its backward would update them with the optimizer state of the layer it was compiled for (session 57:
    update 2 stopped with "received no gradient"). Each other layer's run gets the graph compiled with its own
    update (ddp/in_graph/dispatch.py), and every update after the first runs inside the backward (before: the
    update left the backward after update 2, and those frames, which never read the step's variant, ran
    uncompiled from then on)."""
    per_rank = ok(results, "blocks_with_breaks")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    if not per_rank[0]["report"]["graphs"]:  # torch 2.11's Dynamo compiles no frame of this model
        for r in per_rank:
            assert not _iob(r)["active"] and "no compiled graph ran" in _iob(r)["reason"], _iob(r)
        return
    _assert_in_backward(per_rank)
    for r in per_rank:
        assert _iob(r)["reason"] is None, _iob(r)
        graphs = [g for g in r["report"]["graphs"] if g["variant"].startswith("reduce_update")]
        updated = {n for g in graphs for b in g["buckets"] for n in b["params"]}
        assert {"blocks.1.fc1.weight", "blocks.2.fc2.bias"} <= updated, graphs


def test_a_branch_one_rank_took_in_update_1_is_updated_inside_the_backward_on_every_rank(results):
    """Update 1 (eager) counted `extra`'s uses on rank 0 only; the ranks agree on the most uses any rank saw,
    so every rank's graph updates `extra` inside its backward and the ranks stay bit-identical."""
    per_rank = ok(results, "branch_on_rank_0_at_update_1")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    for r in per_rank:
        iob = _iob(r)
        assert iob["active"] and iob["not_updated_in_backward"] == [], iob


def test_clipping_across_a_graph_break_keeps_the_normal_path_with_eagers_optimizer_state(results):
    per_rank = ok(results, "tied_across_graph_break_clip")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)  # state included: SGD without momentum keeps none
    iob = _iob(per_rank[0])
    assert not iob["active"] and "2 compiled graph(s)" in iob["reason"], iob


def test_clipping_with_a_parameter_outside_the_graph_keeps_the_normal_path_and_says_why(results):
    per_rank = ok(results, "aux_loss_clip")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    iob = _iob(per_rank[0])
    assert not iob["active"] and "head.bias" in iob["reason"] and "clipping" in iob["reason"], iob


def test_a_branch_that_joins_at_update_3_is_updated_from_its_first_gradient(results):
    per_rank = ok(results, "branch_joins_at_update_3")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    assert _iob(per_rank[0])["active"], _iob(per_rank[0])
    moved = [
        n
        for n in per_rank[0]["params"]
        if n.startswith("extra.") and not torch.equal(per_rank[0]["params"][n], per_rank[0]["initial"][n])
    ]
    assert moved == ["extra.weight", "extra.bias"], moved


def test_an_auxiliary_loss_on_a_parameter_inside_a_region_is_updated_by_the_normal_step(results):
    per_rank = ok(results, "regions_aux_loss_on_block_bias")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank, kept=1)  # blocks.1.fc.bias: reduced and updated after the backward
    assert per_rank[0]["report"]["in_graph"]["outside_graph"] == ["blocks.1.fc.bias"]


def test_ignored_parameters_inside_a_region_are_updated_from_their_local_gradient(results):
    per_rank = ok(results, "regions_ignored_block")
    ignored = ("blocks.2.fc.weight", "blocks.2.fc.bias")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=ignored)
    _assert_in_backward(per_rank, kept=0)
    for name in ignored:
        assert not torch.equal(per_rank[0]["params"][name], per_rank[1]["params"][name]), name


def test_ignored_parameters_are_updated_from_their_local_gradient(results):
    per_rank = ok(results, "ignored_parameters")
    ignored = ("body.2.weight", "body.2.bias")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=ignored)
    _assert_in_backward(per_rank, kept=0)  # ignored params are not DDP's: their .grad is the optimizer's
    for name in ignored:
        assert not torch.equal(per_rank[0]["params"][name], per_rank[1]["params"][name]), name


def test_a_custom_comm_hook_keeps_the_normal_path_and_runs(results):
    per_rank = ok(results, "custom_comm_hook")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    iob = _iob(per_rank[0])
    assert not iob["active"] and "halve_hook" in iob["reason"], iob


def test_fp16_compression_with_the_update_in_the_backward(results):
    per_rank = ok(results, "fp16_compress_hook")
    # fp16 gradients put many near zero, where AdamW's normalisation magnifies a last-bit difference
    # of the compiled update to ~1e-4 of a step
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-5)
    _assert_in_backward(per_rank)


def test_mixed_fp32_and_bf16_parameters(results):
    per_rank = ok(results, "mixed_dtypes")
    # bf16 AdamW compiled vs eager: one bf16 ulp apart (as train_step without the update in the
    # backward: 1.4e-2 measured); a gradient not averaged over the ranks would be ~1
    assert_like_eager(per_rank, update_rtol=5e-2)
    _assert_in_backward(per_rank)


def test_bf16_parameters_of_a_fused_optimizer_round_as_its_kernel_does(results):
    """The user's step is torch's fused kernel (`fused=True`), which rounds a bf16 parameter once per update;
    the update inside the backward calls that kernel for the bf16 layer too, so the parameters match eager's
    as closely as fp32 ones do (with the per-op update graph for it, the fp32 layer before it ended 2.7e-4 from eager
    after 4 updates, 18% of a weight)."""
    per_rank = ok(results, "mixed_dtypes_fused")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank)
    for r in per_rank:
        assert _iob(r)["fused_kernel_groups"] == [0], _iob(r)


@pytest.mark.parametrize("name", ["sgd_clip", "mixed_dtypes_clip", "regions_sgd_clip"])
def test_clipping_takes_the_global_norm_inside_the_backward_and_changes_the_update(results, name):
    per_rank = ok(results, name)
    unclipped = ok(results, f"{name}_unclipped")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank)
    for r, u in zip(per_rank, unclipped):
        differs = [n for n in r["params"] if (r["params"][n] - u["ref"][n]).abs().max() > 1e-3]
        assert differs, "clipping changed nothing: the test would not see a wrong norm"


def test_a_layer_unfrozen_after_update_2_is_updated_from_its_local_gradient(results):
    """Gradual unfreezing: DDP was built with the layer frozen, so it never reduces it (eager neither); from
    its first gradient it is updated like the eager script."""
    per_rank = ok(results, "unfrozen_at_update_3")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=FROZEN_UNTIL)
    for r in per_rank:
        assert _iob(r)["active"], _iob(r)
        for name in FROZEN_UNTIL:
            assert not r["params"][name].equal(r["initial"][name]), f"{name} was never updated"


def test_a_param_group_added_after_update_2_is_updated_with_its_own_lr(results):
    """`optimizer.add_param_group` at update 3 (a backbone unfrozen by a fine-tuning callback): the new
    group's parameters are stepped like the eager script, the others keep updating inside the backward."""
    per_rank = ok(results, "group_added_at_update_3")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=FROZEN_UNTIL)
    for r in per_rank:
        assert _iob(r)["active"] and _iob(r)["updates_in_backward"] == UPDATES - 1, _iob(r)
        for name in FROZEN_UNTIL:
            assert not r["params"][name].equal(r["initial"][name]), f"{name} was never updated"


def test_step_counts_written_in_place_at_update_3_are_read_again(results):
    """The script zeroes its Adam step counts in place before update 3 (the same tensors): the backward's
    update reads them afresh (their versions moved, so the counts the host advanced itself no longer stand)
    and corrects its bias from step 1 again, as torch's step does; every update stays inside the backward."""
    per_rank = ok(results, "step_counts_rewound_at_update_3")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank)


@pytest.mark.parametrize(
    "name",
    ["state_cleared_at_update_3", "checkpoint_without_head_state_at_update_3", "momentum_cleared_at_update_3"],
)
def test_optimizer_state_lost_at_update_3_is_recreated_as_torch_recreates_it(results, name):
    """The script clears the optimizer state, or loads a checkpoint without some of it, before update 3:
    the compiled backward read that state (it raised KeyError), so update 3 reduces only and torch's
    step starts those parameters afresh; update 4 is inside the backward again."""
    per_rank = ok(results, name)
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    for r in per_rank:
        iob = _iob(r)
        assert iob["active"] and iob["restarted_after_lost_state"] == [3], iob
        assert iob["updates_in_backward"] == UPDATES - 2, iob


def test_a_16_bit_wire_asked_by_reduce_dtype_holds_from_update_1(results):
    """`reduce_dtype=torch.bfloat16` against eager DDP with DDP's bf16 compression (its steps, by hand): update 1
    is compiled (the backward that only reduces) instead of run as eager DDP, whose reducer would have averaged it
    in fp32. Before: 1.2e-2 of the update away from the eager script (AdamW, 3 updates, Headed, accumulation 1)."""
    per_rank = ok(results, "reduce_dtype_bf16")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_in_backward(per_rank)
