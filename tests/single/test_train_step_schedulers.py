"""LR schedulers driven by compile_core.train_step (one process, DDP-wrapped models, compared with eager DDP):
the learning rate changes without recompiling the optimizer update after warm-up, the recompile counter does
see a real recompile with its reason, and foreach Adamax/AdamW with a scheduler keep the user's flags and floats in
the live param groups and the checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR

from compile_core.step import train_step
from tests.single.train_step_helpers import (
    BACKEND,
    assert_params_close,
    batches,
    eager_ddp_run,
    fresh_dynamo,  # noqa: F401 (an autouse fixture)
    make_setup,
    process_group,  # noqa: F401 (an autouse fixture)
    tiny_model,
)


@pytest.mark.parametrize(
    "opt_name,sched_name",
    [
        ("sgd_momentum", "step"),
        ("adamw", "cosine"),
        ("adam", "lambda"),
        ("adamw", "onecycle"),
        ("sgd_momentum", "onecycle"),
    ],
)
def test_scheduler_changes_lr_without_optimizer_recompiles(opt_name, sched_name):
    n = 20
    data = batches(n)
    model, opt, sched = make_setup(opt_name, sched_name)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    lrs = []
    for x, y in data:
        step(x, y)
        lrs.append(float(opt.param_groups[0]["lr"]))

    ref_model, ref_opt, ref_sched = make_setup(opt_name, sched_name)
    eager_ddp_run(ref_model, ref_opt, ref_sched, data)

    assert len(set(lrs)) > 2, f"the scheduler should have changed the LR: {lrs}"
    assert_params_close(model, ref_model)
    assert lrs[-1] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-9)
    opt_report = step.report().to_dict()["optimizer"]
    assert opt_report["compiled"], opt_report
    late = [r for r in opt_report["recompiles"] if r["update"] > 2]
    assert late == [], f"optimizer recompiled after warm-up: {late}"
    # SGD creates its momentum buffers in the first update, so one warm-up recompile at update 2.
    assert len(opt_report["recompiles"]) <= 1, opt_report["recompiles"]


def test_recompile_counter_sees_real_recompiles():
    """The counter is not a constant: a flag flipped mid-run must show up with its reason."""
    model, opt, _ = make_setup("adamw")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    for i, (x, y) in enumerate(batches(6)):
        if i == 3:
            opt.param_groups[0]["maximize"] = True  # a new code path: Dynamo must recompile
        step(x, y)
    recompiles = step.report().to_dict()["optimizer"]["recompiles"]
    assert any(r["update"] == 4 and "maximize" in r["reason"] for r in recompiles), recompiles


@pytest.mark.parametrize("opt_cls", [torch.optim.Adamax, torch.optim.AdamW])
def test_foreach_adam_kind_with_scheduler_matches_eager_and_checkpoints_user_flags(opt_cls):
    """foreach=True refuses a tensor LR unless capturable=True: our compiled update (Adamax) sets it while
    it runs; AdamW runs as torch's fused step (fused=True while it steps, compile_core/step/fused.py). Either
    way the live groups and the checkpoint keep the user's flags and floats."""
    data = batches(6)

    def setup():
        model = DDP(tiny_model())
        opt = opt_cls(model.parameters(), lr=1e-2, foreach=True)
        return model, opt, CosineAnnealingLR(opt, T_max=6)

    model, opt, sched = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt, ref_sched = setup()
    eager_ddp_run(ref_model, ref_opt, ref_sched, data)

    assert_params_close(model, ref_model)
    opt_report = step.report().to_dict()["optimizer"]
    if opt_cls is torch.optim.AdamW:
        assert not opt_report["compiled"] and "fused=True" in opt_report["as_is"], opt_report
    else:
        assert opt_report["compiled"] and [r for r in opt_report["recompiles"] if r["update"] > 2] == []
    assert opt.param_groups[0]["capturable"] is False and isinstance(opt.param_groups[0]["lr"], float)
    assert not opt.param_groups[0].get("fused")
    saved = opt.state_dict()["param_groups"][0]
    assert saved["capturable"] is False and saved["foreach"] is True and isinstance(saved["lr"], float)
    assert not saved.get("fused")


def test_a_compiled_update_counts_as_the_optimizers_step_for_the_scheduler():
    """SGD without momentum has no state to create, so its update is compiled from update 1 and
    `optimizer.step()` never runs: torch's scheduler, at its first step, warned that the user's loop stepped
    it before the optimizer, which the loop did not."""
    import warnings

    torch.manual_seed(0)
    model = DDP(tiny_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(3):
            step(x, y)
    assert not [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert sched.get_last_lr() == [0.1 * 0.5**3]
