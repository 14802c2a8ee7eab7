"""compile_core.train_step on one process (world-size-1 gloo group, DDP-wrapped models).

Every numerical check compares against EAGER DDP doing the same thing (same seeds, same batches),
never against another compiled run. Most tests use backend="aot_eager" on tiny models; one test
runs real Inductor codegen.
"""

from __future__ import annotations

import copy
import importlib
import io
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, OneCycleLR, StepLR

from compile_core.step import TrainStep, train_step
from tests.ranks import init_single_rank_group

BACKEND = "aot_eager"
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_single_rank_group()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test builds new models; old cache entries would only cost recompiles and memory.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}

SCHEDULERS = {
    "step": lambda opt: StepLR(opt, step_size=3, gamma=0.5),
    "cosine": lambda opt: CosineAnnealingLR(opt, T_max=20, eta_min=1e-4),
    "lambda": lambda opt: LambdaLR(opt, lambda i: 1.0 / (1.0 + i)),
    "onecycle": lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=40),
}


def make_setup(opt_name: str, sched_name: str | None = None, seed: int = 0):
    model = DDP(tiny_model(seed))
    opt = OPTIMIZERS[opt_name](model.parameters())
    sched = SCHEDULERS[sched_name](opt) if sched_name else None
    return model, opt, sched


def eager_ddp_run(model, opt, sched, data, *, accum=1, clip=None, autocast=None, loss_fn=F.mse_loss):
    """The reference: a hand-written eager DDP loop with the same accumulation/clip/autocast."""
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accum == 0
        ctx = model.no_sync() if not last else torch.enable_grad()
        with ctx:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model(x), y)
            (loss / accum).backward()
        losses.append(loss.detach())
        if last:
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    return losses, norms


def assert_params_close(compiled_model: nn.Module, eager_model: nn.Module, rtol=RTOL, atol=ATOL) -> None:
    names = [n for n, _ in eager_model.named_parameters()]
    for name, a, b in zip(names, compiled_model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_params_moved(model: nn.Module, seed: int = 0) -> None:
    """Guards against a vacuous comparison: training must have changed the parameters."""
    initial = tiny_model(seed)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), initial.parameters()))


# -- equality with eager DDP -------------------------------------------------------------------------
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


def test_update_of_repeated_blocks_is_compiled_once_per_block_shape():
    from tests.single.ddp_helpers import Blocks

    def setup():
        torch.manual_seed(0)
        model = DDP(Blocks(width=16))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(4)]
    model, opt = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt = setup()
    eager_ddp_run(ref_model, ref_opt, None, data)
    assert_params_close(model, ref_model)
    opt_report = step.report().to_dict()["optimizer"]
    assert opt_report["compiled"] and opt_report["per_block"] and opt_report["recompiles"] == [], opt_report
    chunks = {r["name"]: r for r in opt_report["graph_compiles"]}
    # one graph for the four identical blocks, one for the other parameters
    assert sorted(n for n, r in chunks.items() if r["reused_from"] is None) == [
        "update.group0.module.blocks.0",
        "update.group0.rest",
    ]
    assert (
        sorted(r["reused_from"] for r in chunks.values() if r["reused_from"]) == ["update.group0.module.blocks.0"] * 3
    )
    assert "per block" in str(step.report())


def _unused_setup(make, opt_name: str):
    """(module, DDP with find_unused_parameters=True, optimizer), the same for every call."""
    torch.manual_seed(0)
    module = make()
    model = DDP(module, find_unused_parameters=True)
    return module, model, OPTIMIZERS[opt_name](model.parameters())


class LateBranch(nn.Module):
    """Blocks plus a branch that joins only after the first updates (`late` has no gradient, hence
    no optimizer state, until then), and one that never joins."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.late = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.use_late = False

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x + self.late(x) if self.use_late else x


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_parameters_that_get_their_first_gradient_later_update_like_eager(opt_name):
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(5)]
    module, model, opt = _unused_setup(LateBranch, opt_name)
    ref_module, ref_model, ref_opt = _unused_setup(LateBranch, opt_name)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    for i, (x, y) in enumerate(data):
        module.use_late = ref_module.use_late = i >= 2
        step(x, y)
        eager_ddp_run(ref_model, ref_opt, None, [(x, y)])
    assert_params_close(model, ref_model)
    torch.manual_seed(0)
    assert not torch.equal(module.late.weight.detach(), LateBranch().late.weight), "the late branch never trained"
    # the optimizer state is eager's: created for `late` when it first had a gradient, none for `never`
    ours = {n: opt.state.get(p, {}) for n, p in module.named_parameters()}
    theirs = {n: ref_opt.state.get(p, {}) for n, p in ref_module.named_parameters()}
    assert {n for n, st in ours.items() if st} == {n for n, st in theirs.items() if st}
    assert not ours["never.weight"] and ours["late.weight"]
    for name, st in theirs.items():
        for key, value in st.items():
            torch.testing.assert_close(
                torch.as_tensor(ours[name][key]),
                torch.as_tensor(value),
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m: f"{name}.{key}: {m}",
            )
    assert step.report().to_dict()["optimizer"]["per_block"]


class WithPooler(nn.Module):
    """A pooler the loss never reaches (a classification head's pooler in token-level fine-tuning)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.pooler = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_a_parameter_that_never_gets_a_gradient_leaves_the_update_compiled(opt_name):
    data = batches(4)
    module, model, opt = _unused_setup(WithPooler, opt_name)
    _, ref_model, ref_opt = _unused_setup(WithPooler, opt_name)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    for x, y in data:
        step(x, y)
    eager_ddp_run(ref_model, ref_opt, None, data)
    assert_params_close(model, ref_model)
    report = step.report().to_dict()["optimizer"]
    assert report["compiled"] and report["fallback_error"] is None, report
    assert report["graphs"] >= 1 and not opt.state.get(module.pooler.weight)


def test_optimizer_with_step_hooks_keeps_the_whole_step():
    model, opt, _ = make_setup("sgd_momentum")
    calls = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(1))
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    for x, y in batches(3):
        step(x, y)
    opt_report = step.report().to_dict()["optimizer"]
    assert not opt_report["per_block"] and "step hook" in opt_report["whole_step_reason"]
    assert len(calls) == 3  # every update went through optimizer.step()


# -- LR schedulers: no optimizer recompiles after warm-up ---------------------------------------------
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


def test_foreach_adamw_with_scheduler_matches_eager_and_checkpoints_user_flags():
    """foreach=True refuses a tensor LR unless capturable=True: our compiled update sets it while it
    runs; the live groups and the checkpoint keep the user's flags and floats."""
    data = batches(6)

    def setup():
        model = DDP(tiny_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        return model, opt, CosineAnnealingLR(opt, T_max=6)

    model, opt, sched = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt, ref_sched = setup()
    eager_ddp_run(ref_model, ref_opt, ref_sched, data)

    assert_params_close(model, ref_model)
    opt_report = step.report().to_dict()["optimizer"]
    assert opt_report["compiled"] and [r for r in opt_report["recompiles"] if r["update"] > 2] == []
    assert opt.param_groups[0]["capturable"] is False and isinstance(opt.param_groups[0]["lr"], float)
    saved = opt.state_dict()["param_groups"][0]
    assert saved["capturable"] is False and saved["foreach"] is True and isinstance(saved["lr"], float)


# -- gradient accumulation ----------------------------------------------------------------------------
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


# -- clipping and autocast ----------------------------------------------------------------------------
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


def test_the_users_optimizer_and_scheduler_keep_working_after_train_step():
    """After compiled updates, the user's objects behave as in plain PyTorch: floats in param_groups,
    get_last_lr() floats, a direct optimizer.step(), a second optimizer over the same parameters."""
    model = DDP(tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sched = CosineAnnealingLR(opt, T_max=6)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in batches(3):
        step(x, y)
    group = opt.param_groups[0]
    assert isinstance(group["lr"], float) and group["capturable"] is False
    assert all(isinstance(b, float) for b in group["betas"])
    assert all(isinstance(v, float) for v in sched.get_last_lr())
    x, y = batches(1, seed=7)[0]
    F.mse_loss(model(x), y).backward()
    opt.step()  # foreach with a tensor lr and capturable=False would raise here
    second = torch.optim.AdamW(model.parameters(), lr=group["lr"], foreach=True)
    second.step()
    assert isinstance(opt.state_dict()["param_groups"][0]["lr"], float)


# -- checkpoint / resume ------------------------------------------------------------------------------
def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob: bytes):
    # A fresh copy per load: Optimizer.load_state_dict keeps the state tensors it is given, so two
    # optimizers loaded from one in-memory dict would share (and both update) exp_avg & co.
    return torch.load(io.BytesIO(blob), weights_only=True)


def test_checkpoint_loads_into_eager_and_resumes_identically():
    data = batches(6)
    model, opt, sched = make_setup("adamw", "cosine")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in data[:3]:
        step(x, y)
    blob = _save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    ckpt = _load(blob)

    # The checkpoint is in the user's format: plain floats, the user's flags, user's parameter names.
    for group in ckpt["opt"]["param_groups"]:
        assert isinstance(group["lr"], float) and all(isinstance(b, float) for b in group["betas"])
        assert group["betas"] == (0.9, 0.999) and group["capturable"] is False
    assert set(ckpt["model"]) == set(DDP(tiny_model()).state_dict())
    assert all(isinstance(v, float) for v in ckpt["sched"]["_last_lr"]), ckpt["sched"]
    assert all(isinstance(v, float) for v in sched.get_last_lr())

    resumed, resumed_opt, resumed_sched = make_setup("adamw", "cosine", seed=123)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_sched.load_state_dict(ckpt["sched"])
    eager_ddp_run(resumed, resumed_opt, resumed_sched, data[3:])

    ref_model, ref_opt, ref_sched = make_setup("adamw", "cosine")
    eager_ddp_run(ref_model, ref_opt, ref_sched, data)
    assert_params_close(resumed, ref_model)
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)

    # ... and back into a compiled step, which must pick up the loaded LR.
    again, again_opt, again_sched = make_setup("adamw", "cosine", seed=7)
    ckpt = _load(blob)
    again.load_state_dict(ckpt["model"])
    again_opt.load_state_dict(ckpt["opt"])
    again_sched.load_state_dict(ckpt["sched"])
    again_step = train_step(again, again_opt, F.mse_loss, backend=BACKEND, lr_scheduler=again_sched)
    for x, y in data[3:]:
        again_step(x, y)
    assert_params_close(again, ref_model)


# -- an optimizer Dynamo cannot compile ---------------------------------------------------------------
class OpaqueSGD(torch.optim.SGD):
    """SGD whose step Dynamo must not trace (as with optimizers that call compiler.disable)."""

    @torch.compiler.disable
    def step(self, closure=None):
        return super().step(closure)


def test_untraceable_optimizer_runs_eagerly_and_says_so():
    data = batches(3)
    model = DDP(tiny_model())
    opt = OpaqueSGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = StepLR(opt, step_size=1, gamma=0.5)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in data:
        step(x, y)

    ref_model, ref_opt, _ = make_setup("sgd_momentum")
    eager_ddp_run(ref_model, ref_opt, StepLR(ref_opt, step_size=1, gamma=0.5), data)
    assert_params_close(model, ref_model)

    d = step.report().to_dict()
    assert d["optimizer"]["compiled"] is False, d["optimizer"]
    assert "captured no graph" in d["optimizer"]["fallback_error"]
    assert "disable" in d["optimizer"]["fallback_error"], d["optimizer"]["fallback_error"]
    assert any(f["piece"] == "optimizer.step" and f["to"] == "eager" for f in d["fallbacks"])
    assert isinstance(opt.param_groups[0]["lr"], float), "the eager fallback gives the user's floats back"
    assert "EAGER" in str(step.report())


def test_backend_failure_on_the_update_falls_back_with_the_error(monkeypatch):
    def refusing_backend(gm, example_inputs):
        raise RuntimeError("this backend refuses optimizer graphs")

    # The update looks its backend up by name (whole or per block); the model's backend stays aot_eager.
    for name in ("compile_core.step.update", "compile_core.step.chunked_update"):
        monkeypatch.setattr(importlib.import_module(name), "lookup_backend", lambda backend: refusing_backend)
    data = batches(3)
    model, opt, sched = make_setup("adamw", "step")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt, ref_sched = make_setup("adamw", "step")
    eager_ddp_run(ref_model, ref_opt, ref_sched, data)
    assert_params_close(model, ref_model)
    opt_report = step.report().to_dict()["optimizer"]
    assert opt_report["compiled"] is False
    assert "refuses optimizer graphs" in opt_report["fallback_error"], opt_report


# -- the report ---------------------------------------------------------------------------------------
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


# -- bad input: rejected before any compile work ------------------------------------------------------
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
    sched = StepLR(other, step_size=1)
    own = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr_scheduler=StepLR does not drive this optimizer"):
        train_step(model, own, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(own)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau steps on a metric.*scheduler\.step\(metric\) yourself"):
        train_step(model, own, F.mse_loss, backend=BACKEND, lr_scheduler=plateau)


def test_non_scalar_loss_is_rejected():
    model, opt, _ = make_setup("sgd_momentum")
    step = train_step(model, opt, lambda out, y: (out - y) ** 2, backend=BACKEND)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match=r"loss_fn returned \(6, 4\): expected a scalar"):
        step(x, y)


# -- real Inductor ------------------------------------------------------------------------------------
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
