"""compile_core.train_step on one process (world-size-1 gloo group, DDP-wrapped models) trains like eager DDP:
plain steps, targets passed by keyword or as None, model inputs passed as keywords, gradient accumulation (with
DDP's all-reduce count), gradient clipping, bf16 autocast, fp16 autocast with a GradScaler, and one run through
real Inductor codegen. Every check compares against eager DDP doing the same thing with the same seeds and batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from compile_core.step import TrainStep, train_step
from tests.single.train_step_helpers import (
    ATOL,
    BACKEND,
    RTOL,
    assert_params_close,
    assert_params_moved,
    batches,
    eager_ddp_run,
    fresh_dynamo,  # noqa: F401 (an autouse fixture)
    make_setup,
    process_group,  # noqa: F401 (an autouse fixture)
)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_five_steps_match_eager_ddp(opt_name):
    data = batches(5)
    model, opt, _ = make_setup(opt_name)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    losses = [step(x, y) for x, y in data]

    ref_model, ref_opt, _ = make_setup(opt_name)
    ref_losses, _ = eager_ddp_run(ref_model, ref_opt, None, data)

    assert_params_moved(model)
    assert_params_close(model, ref_model)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)
    assert all(loss.dim() == 0 and not loss.requires_grad for loss in losses)
    assert all(p.grad is None for p in model.parameters()), "zero_grad(set_to_none=True) after each update"
    d = step.report().to_dict()
    assert d["optimizer"]["compiled"] and d["optimizer"]["graphs"] >= 1
    assert d["updates"] == 5 and d["micro_batches"] == 5


def test_target_by_keyword_and_extra_inputs():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x, z):
            return self.a(x) + self.b(z)

    torch.manual_seed(0)
    model = DDP(TwoInputs())
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    x, z, y = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 4)
    step(x, z, y)
    step(x, z, target=y)
    for _ in range(2):
        F.mse_loss(ref(x, z), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_close(model, ref)
    with pytest.raises(TypeError, match="target"):
        step(x)


def test_target_none_by_keyword_for_a_loss_that_needs_no_target():
    """A model that computes its own loss (Hugging Face with labels): `step(x, target=None)`."""

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, labels):
            return {"loss": F.mse_loss(self.fc(x), labels)}

    torch.manual_seed(0)
    model = DDP(WithLoss())
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    seen = []

    def loss_fn(out, target):
        seen.append(target)
        return out["loss"]

    step = train_step(model, opt, loss_fn, backend=BACKEND)
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    for _ in range(2):
        step(x, y, target=None)
        ref(x, y)["loss"].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert seen == [None, None]
    assert_params_close(model, ref)


def test_keyword_inputs_go_to_the_model_as_keywords():
    """A Hugging Face batch is a dict the model takes as keywords (`model(**batch)`, labels among them):
    `step(**batch, target=None)`. Until session 65 a keyword input was a TypeError of the step itself."""

    class KeywordModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.gate = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, input_ids, attention_mask=None, labels=None):
            out = self.fc(input_ids)
            if attention_mask is not None:
                out = out * torch.sigmoid(self.gate(attention_mask))
            return {"loss": F.mse_loss(out, labels), "logits": out}

    torch.manual_seed(0)
    model = DDP(KeywordModel())
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1)
    step = train_step(model, opt, lambda out, target: out["loss"], backend=BACKEND)
    data = [dict(input_ids=x, attention_mask=x.flip(0), labels=y) for x, y in batches(3)]
    losses = [step(**batch, target=None) for batch in data[:2]]
    losses.append(step(data[2]["input_ids"], labels=data[2]["labels"], target=None))  # positional and keywords
    for i, batch in enumerate(data):
        kwargs = batch if i < 2 else {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        ref_losses = ref(**kwargs)["loss"]
        ref_losses.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(losses[i], ref_losses.detach(), rtol=RTOL, atol=ATOL)
    assert_params_moved(model)
    assert_params_close(model, ref)
    with pytest.raises(TypeError, match=r"target=None"):
        step(**data[0])  # no target: the step cannot tell the loss needs none


class AllReduceCount:
    """State for `counting_allreduce`: how many bucket all-reduces DDP launched."""

    def __init__(self) -> None:
        self.calls = 0


def counting_allreduce(state: AllReduceCount, bucket):
    """A DDP comm hook: count, then do the default all-reduce (average over the default group)."""
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


@pytest.mark.parametrize("accum", [2, 3])
def test_accumulation_matches_eager_ddp(accum):
    data = batches(2 * accum)
    model, opt, sched = make_setup("adamw", "cosine")
    hook = AllReduceCount()
    model.register_comm_hook(hook, counting_allreduce)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, accum_steps=accum, lr_scheduler=sched)
    applied = []
    losses = []
    for x, y in data:
        losses.append(step(x, y))
        applied.append(step.applied)

    ref_model, ref_opt, ref_sched = make_setup("adamw", "cosine")
    ref_hook = AllReduceCount()
    ref_model.register_comm_hook(ref_hook, counting_allreduce)
    ref_losses, _ = eager_ddp_run(ref_model, ref_opt, ref_sched, data, accum=accum)

    assert applied == ([False] * (accum - 1) + [True]) * 2
    assert step.updates == 2 and step.pending_micro_batches == 0
    assert_params_close(model, ref_model)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)
    # no_sync on the first k-1 micro-batches: all-reduces happen once per update, as in eager.
    assert ref_hook.calls > 0
    assert hook.calls == ref_hook.calls, (hook.calls, ref_hook.calls)


def test_clip_grad_norm_matches_eager_ddp():
    clip = 0.05
    data = batches(4)
    model, opt, _ = make_setup("sgd_momentum")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, clip_grad_norm=clip, accum_steps=2)
    norms = []
    for x, y in data:
        step(x, y)
        if step.applied:
            norms.append(step.last_grad_norm)

    ref_model, ref_opt, _ = make_setup("sgd_momentum")
    _, ref_norms = eager_ddp_run(ref_model, ref_opt, None, data, accum=2, clip=clip)

    assert all(n > clip for n in ref_norms), "the test must actually clip"
    torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=RTOL, atol=ATOL)
    assert_params_close(model, ref_model)


def test_autocast_bfloat16_matches_eager_ddp():
    data = batches(3)
    model, opt, _ = make_setup("adamw")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, autocast=torch.bfloat16)
    losses = [step(x, y) for x, y in data]

    ref_model, ref_opt, _ = make_setup("adamw")
    ref_losses, _ = eager_ddp_run(ref_model, ref_opt, None, data, autocast=torch.bfloat16)
    fp32_model, fp32_opt, _ = make_setup("adamw")
    fp32_losses, _ = eager_ddp_run(fp32_model, fp32_opt, None, data)

    assert losses[0].dtype == ref_losses[0].dtype
    # bf16 rounding is reproduced, not just approximated: closer to eager bf16 than to fp32.
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-3, atol=1e-4)
    assert not torch.allclose(torch.stack(ref_losses), torch.stack(fp32_losses), rtol=1e-4, atol=1e-6)
    assert_params_close(model, ref_model, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_fp16_autocast_with_a_grad_scaler_matches_the_eager_amp_recipe(opt_name):
    """fp16 autocast needs loss scaling: train_step runs torch's recipe (scale, unscale for the clip,
    scaler.step, scaler.update), as the eager loop does."""
    data = batches(4)
    model, opt, _ = make_setup(opt_name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = train_step(
        model, opt, F.mse_loss, backend=BACKEND, autocast=torch.float16, grad_scaler=scaler, clip_grad_norm=0.5
    )
    for x, y in data:
        step(x, y)
    ref_model, ref_opt, _ = make_setup(opt_name)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(ref_model(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad(set_to_none=True)
    assert_params_moved(model)
    assert_params_close(model, ref_model, rtol=1e-3, atol=1e-4)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert "GradScaler" in step.report().to_dict()["optimizer"]["fallback_error"]


@pytest.mark.inductor
@pytest.mark.timeout(300)
def test_inductor_adamw_cosine_matches_eager_ddp():
    data = batches(4)
    model, opt, sched = make_setup("adamw", "cosine")
    step = train_step(model, opt, F.mse_loss, backend="inductor", lr_scheduler=sched, clip_grad_norm=1.0)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt, ref_sched = make_setup("adamw", "cosine")
    eager_ddp_run(ref_model, ref_opt, ref_sched, data, clip=1.0)
    assert_params_close(model, ref_model)
    d = step.report().to_dict()
    assert d["optimizer"]["compiled"] and d["optimizer"]["recompiles"] == [], d["optimizer"]
    assert isinstance(step, TrainStep)
