"""`optimizer_in_backward=True` with `backend="inductor"` on field scripts, against the eager script.

The field suite (test_in_backward_field_multirank.py) runs on aot_eager. With Inductor each parameter's
update is lowered and fused with the backward's kernels: these scenarios put the field patterns through
that path, several patterns per script to keep the Inductor compiles few. 2 ranks, rank-dependent data,
4 updates, checked against the same loop run eagerly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.field_models import ConvStem, Mixed, Regioned, ResidualAcrossBreak, aux_on_head_bias
from tests.multi_gpu.test_in_backward_field_multirank import (
    UPDATES,
    _script,
    _step,
    adamw,
    adamw_groups,
    frozen_body_start,
    sgd_momentum_foreach,
)
from tests.multi_gpu.user_script import assert_like_eager
from tests.ranks import run_ranks

pytestmark = [pytest.mark.multi_gpu, pytest.mark.inductor, pytest.mark.timeout(600)]

IGNORED = ("body.2.weight", "body.2.bias")


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _inductor(rank: int, script) -> dict:
    """The scenario through Inductor, with the warnings compile_core logged meanwhile."""
    handler = _Warnings()
    logger = logging.getLogger("compile_core")
    logger.addHandler(handler)
    try:
        result = _step(rank, script, backend="inductor")
    finally:
        logger.removeHandler(handler)
    result["warnings"] = handler.messages
    return result


SCENARIOS = {
    # fine-tuning recipe: a frozen first layer, two param groups (decay / no decay, another lr and betas),
    # an auxiliary loss on head.bias (updated by the normal step), parameters DDP ignores (local gradients)
    "frozen_groups_aux_loss_ignored": lambda r: _inductor(
        r,
        _script(make_model=frozen_body_start, make_opt=adamw_groups, loss=aux_on_head_bias, ignore=IGNORED),
    ),
    "regions_param_groups": lambda r: _inductor(r, _script(make_model=Regioned, make_opt=adamw_groups)),
    "sgd_momentum_clip": lambda r: _inductor(r, _script(make_opt=sgd_momentum_foreach, clip=0.05)),
    # a bf16 layer between fp32 ones, AdamW as the user builds it (not fused=True)
    "mixed_dtypes_adamw": lambda r: _inductor(r, _script(make_model=Mixed, make_opt=adamw)),
    "conv_stem": lambda r: _inductor(r, _script(make_model=ConvStem, make_opt=adamw)),
    "residual_across_break": lambda r: _inductor(
        r, _script(make_model=ResidualAcrossBreak, make_opt=sgd_momentum_foreach)
    ),
}


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, world_size=2, timeout=580)


def _assert_updated_inside_by_inductors_kernel(per_rank: list[dict], *, kept: int) -> None:
    for r in per_rank:
        iob = r["report"]["optimizer_in_backward"]
        assert iob["active"] and iob["from_update"] == 2, iob
        assert iob["updates_in_backward"] == UPDATES - 1, iob
        assert iob["grads_kept_last_backward"] == kept, iob
        assert r["report"]["fallbacks"] == [], r["report"]["fallbacks"]
        assert not [m for m in r["warnings"] if "through Dynamo instead" in m], r["warnings"]


def test_a_fine_tuning_script_with_frozen_layers_groups_an_aux_loss_and_ignored_parameters(results):
    per_rank = ok(results, "frozen_groups_aux_loss_ignored")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6, not_reduced=IGNORED)
    _assert_updated_inside_by_inductors_kernel(per_rank, kept=1)  # head.bias: after the backward
    assert per_rank[0]["report"]["in_graph"]["outside_graph"] == ["head.bias"]
    for name in IGNORED:
        assert not torch.equal(per_rank[0]["params"][name], per_rank[1]["params"][name]), name


def test_nested_compile_regions_with_param_groups(results):
    per_rank = ok(results, "regions_param_groups")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_updated_inside_by_inductors_kernel(per_rank, kept=0)


def test_sgd_momentum_with_clipping(results):
    per_rank = ok(results, "sgd_momentum_clip")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_updated_inside_by_inductors_kernel(per_rank, kept=0)


def test_bf16_parameters_take_torchs_fused_kernel_under_inductor(results):
    """Inductor would compile the bf16 layer's update graph into a kernel that rounds once per update, as
    torch's fused kernel does: the kernel updates it, and nothing of the update is compiled. Eager's step rounds
    per op, a bf16 ulp apart at each update (as on aot_eager's update graph: test_mixed_fp32_and_bf16_parameters).
    Measured: the parameters end 1.602e-2 of the update from eager's with the kernel, and the same to all digits
    with Inductor's compile of the update graph."""
    per_rank = ok(results, "mixed_dtypes_adamw")
    assert_like_eager(per_rank, update_rtol=5e-2)
    _assert_updated_inside_by_inductors_kernel(per_rank, kept=0)
    for r in per_rank:
        iob = r["report"]["optimizer_in_backward"]
        assert iob["fused_kernel_groups"] == [0] and iob["update_graph_groups"] == [], iob


def test_the_gradient_a_graph_returns_for_its_input_is_taken_before_the_weights_it_reads_are_updated(results):
    """The graph after the break returns its input's gradient, `g @ fc1.weight` (through a transpose), which
    nothing else in that backward needs; Inductor scheduled it after the fused kernel had updated `fc1.weight`,
    and the first block trained on that gradient (failed before: `first.fc1.weight` off eager's). The update
    is placed, and pinned, after every read of its parameters, views followed."""
    per_rank = ok(results, "residual_across_break")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_updated_inside_by_inductors_kernel(per_rank, kept=4)  # first.*: its graph ends at the break


def test_a_convolution_weight_is_updated_itself_not_a_channels_last_copy(results):
    """Inductor's layout optimization handed the backward a channels-last copy of `conv.weight`; the update
    inside the backward wrote the copy and the weight itself missed every update from update 2 on (failed before:
    `conv.weight` off eager's). Graphs with updates inside the backward compile without it."""
    per_rank = ok(results, "conv_stem")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-6)
    _assert_updated_inside_by_inductors_kernel(per_rank, kept=0)
