"""compile_core.train_step's argument checks and report (one process, DDP-wrapped model): bad arguments, an
optimizer or scheduler over other parameters and a non-scalar loss are rejected with messages naming the
value, before any compile work where possible; the report is JSON-ready and readable."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR

from compile_core.step import train_step
from tests.single.train_step_helpers import (
    BACKEND,
    batches,
    fresh_dynamo,  # noqa: F401 (an autouse fixture)
    make_setup,
    process_group,  # noqa: F401 (an autouse fixture)
    tiny_model,
)


def test_report_is_json_ready_and_readable():
    model, opt, sched = make_setup("sgd_momentum", "step")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in batches(3):
        step(x, y)
    report = step.report()
    d = json.loads(json.dumps(report.to_dict()))
    for key in ("graphs", "graph_breaks", "recompiles", "fallbacks", "compile_seconds", "optimizer", "parts"):
        assert key in d, key
    assert set(d["parts"]) == {"model", "optimizer"}
    assert d["compile_seconds"] >= d["optimizer"]["compile_seconds"] > 0
    assert all(r["part"] in ("model", "optimizer") and r["reason"] for r in d["recompiles"])
    text = str(report)
    assert "optimizer" in text and "SGD" in text and "compile s" in text


@pytest.fixture
def no_compile(monkeypatch):
    import compile_core.api

    def must_not_compile(*args, **kwargs):
        raise AssertionError("compile_core.compile was called before the arguments were validated")

    monkeypatch.setattr(compile_core.api, "compile", must_not_compile)


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (dict(loss_fn="mse"), TypeError, r"loss_fn='mse' is not callable"),
        (dict(accum_steps=0), ValueError, r"accum_steps=0: must be >= 1"),
        (dict(accum_steps=2.0), TypeError, r"accum_steps=2.0"),
        (dict(clip_grad_norm=0.0), ValueError, r"clip_grad_norm=0.0: must be a finite number > 0"),
        (dict(clip_grad_norm=-1), ValueError, r"clip_grad_norm=-1"),
        (dict(clip_grad_norm=math.inf), ValueError, r"clip_grad_norm=inf"),
        (dict(autocast=torch.int8), ValueError, r"autocast=torch.int8"),
        (dict(ddp="sometimes"), ValueError, r"ddp='sometimes'"),
        (dict(autocast=torch.float16), ValueError, r"autocast=torch.float16 needs loss scaling.*GradScaler"),
        (dict(grad_scaler="yes"), TypeError, r"grad_scaler=str: expected a torch.amp.GradScaler"),
    ],
)
def test_bad_arguments_are_rejected(no_compile, kwargs, error, pattern):
    model, opt, _ = make_setup("sgd_momentum")
    loss_fn = kwargs.pop("loss_fn", F.mse_loss)
    with pytest.raises(error, match=pattern):
        train_step(model, opt, loss_fn, backend=BACKEND, **kwargs)


def test_optimizer_over_other_parameters_is_rejected(no_compile):
    model = DDP(tiny_model())
    other = torch.optim.SGD(tiny_model(1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the model.*model\.parameters\(\)"):
        train_step(model, other, F.mse_loss, backend=BACKEND)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        train_step(model, "adam", F.mse_loss, backend=BACKEND)
    two = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())]
    with pytest.raises(TypeError, match=r"optimizer=\[SGD, AdamW\]: train_step steps one.*compile_core\.compile"):
        train_step(model, two, F.mse_loss, backend=BACKEND)
    sched = StepLR(other, step_size=1)
    own = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr_scheduler=StepLR does not drive this optimizer"):
        train_step(model, own, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(own)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau steps on a metric.*scheduler\.step\(metric\) yourself"):
        train_step(model, own, F.mse_loss, backend=BACKEND, lr_scheduler=plateau)


def test_an_optimizer_that_steps_through_a_closure_is_rejected_with_the_way_out(no_compile):
    """LBFGS evaluates the model several times per update through `step(closure)`; until session 63 train_step
    accepted it and the first step failed inside the update with "step() missing 1 required positional argument"."""
    model = DDP(tiny_model())
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer=LBFGS: its step\(closure\).*compile_core\.compile\(ddp_model\)"):
        train_step(model, lbfgs, F.mse_loss, backend=BACKEND)


@pytest.mark.parametrize("ddp", ["split", "none", "in_graph_powersgd"])
def test_accumulation_over_a_static_graph_ddp_reducer_is_rejected_with_the_way_out(no_compile, ddp):
    """Every update starts with a no_sync() micro-batch, and DDP's static graph must synchronise first: until
    session 64 the first step failed inside torch ('expect_autograd_hooks_ INTERNAL ASSERT FAILED')."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    model = DDP(tiny_model(), static_graph=True)
    mode = ddp
    if ddp == "in_graph_powersgd":
        mode = "in_graph"
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fix = "DDP's reducer stays idle" if mode != "in_graph" else "a comm hook the graph compiles"
    with pytest.raises(ValueError, match=rf"accum_steps=2 with DDP static_graph=True .*no_sync\(\).*{fix}"):
        train_step(model, opt, F.mse_loss, backend=BACKEND, ddp=mode, accum_steps=2)


def test_non_scalar_loss_is_rejected():
    model, opt, _ = make_setup("sgd_momentum")
    step = train_step(model, opt, lambda out, y: (out - y) ** 2, backend=BACKEND)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match=r"loss_fn returned \(6, 4\): expected a scalar"):
        step(x, y)
