"""The optimizer update inside compile_core.train_step (one process, DDP-wrapped models, compared with eager
DDP): compiled once per repeated block shape, parameters whose first gradient comes late or never, optimizers
with step hooks, the user's optimizer still usable afterwards, and the eager fallback (with its reason in the
report) for an optimizer Dynamo cannot trace or a backend that fails on the update."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, StepLR

from compile_core.step import train_step
from tests.single.train_step_helpers import (
    ATOL,
    BACKEND,
    OPTIMIZERS,
    RTOL,
    assert_params_close,
    batches,
    eager_ddp_run,
    fresh_dynamo,  # noqa: F401 (an autouse fixture)
    make_setup,
    process_group,  # noqa: F401 (an autouse fixture)
    tiny_model,
)


def _blocks_trained_like_eager(make_opt):
    """Four identical blocks trained 4 updates by train_step with `make_opt(params)`, checked against eager DDP;
    returns the step."""
    from tests.single.ddp_helpers import Blocks

    def setup():
        torch.manual_seed(0)
        model = DDP(Blocks(width=16))
        return model, make_opt(model.parameters())

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(4)]
    model, opt = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt = setup()
    eager_ddp_run(ref_model, ref_opt, None, data)
    assert_params_close(model, ref_model)
    return step


@pytest.mark.compat  # torch 2.11 (the GPU machines') has no isolate_recompiles: the blocks' caches kept apart there
def test_update_of_repeated_blocks_is_compiled_once_per_block_shape():
    step = _blocks_trained_like_eager(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
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


def test_sgd_without_momentum_leaves_the_optimizer_state_as_empty_as_eager():
    """torch's SGD keeps no state without momentum: `optimizer.state_dict()` after the compiled per-block update
    equals eager's, with no empty entry per parameter (`optimizer.state` is a defaultdict; reading it adds)."""
    step = _blocks_trained_like_eager(lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert step.report().to_dict()["optimizer"]["per_block"]
    assert step.optimizer.state_dict()["state"] == {}
    assert len(step.optimizer.state) == 0


def test_a_multi_tensor_update_is_compiled_whole_like_torch_compile_of_the_step():
    """foreach (torch's default on CUDA) SGD that says `fused=False` (else torch's fused step runs it): the whole
    step is one graph of multi-tensor ops, as torch.compile(optimizer.step) makes it, not one compiled call per
    block of single-tensor math."""
    step = _blocks_trained_like_eager(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True, fused=False))
    opt_report = step.report().to_dict()["optimizer"]
    assert opt_report["compiled"] and not opt_report["per_block"], opt_report
    assert "param group 0 has foreach=True" in opt_report["whole_step_reason"], opt_report
    # one graph of the whole step (SGD's momentum buffers, created at update 1, recompile it once at update 2,
    # as they do torch.compile(optimizer.step))
    assert all(r["name"].startswith("update.graph_") for r in opt_report["graph_compiles"]), opt_report
    assert [r for r in opt_report["recompiles"] if r["update"] > 2] == [], opt_report


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_a_foreach_adam_steps_as_torchs_fused_kernel_and_keeps_the_users_flags(opt_cls):
    """foreach Adam/AdamW (torch's default on CUDA): compiled whole, its step was the largest compile of a train
    step on a GPU; torch's fused kernel does the same update with nothing to compile. The groups say fused only
    while it steps: the live groups and the checkpoint keep the user's flags, and a second optimizer built
    from that checkpoint steps as torch's own foreach step."""
    seen = []

    def make_opt(ps):
        opt = opt_cls(ps, lr=1e-2, weight_decay=0.1, foreach=True)
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["fused"]))
        return opt

    step = _blocks_trained_like_eager(make_opt)
    opt_report = step.report().to_dict()["optimizer"]
    assert not opt_report["compiled"] and opt_report["graphs"] == 0 and not opt_report["per_block"], opt_report
    assert "param group 0 has foreach=True" in opt_report["as_is"] and "fused=True" in opt_report["as_is"]
    assert opt_report["fallback_error"] is None, opt_report
    assert seen == [True] * 4 + [None] * 4, seen  # ours, then the eager reference's own foreach steps
    opt = step.optimizer
    group = opt.param_groups[0]
    assert group["foreach"] is True and not group["fused"], group
    saved = opt.state_dict()
    assert saved["param_groups"][0]["foreach"] is True and not saved["param_groups"][0]["fused"]
    assert all(float(s["step"]) == 4.0 for s in saved["state"].values())


def test_a_foreach_sgd_steps_as_torchs_fused_kernel_and_keeps_the_users_flags():
    """foreach SGD with momentum (torch's default on CUDA): compiled whole, it compiled twice (update 1 creates the
    momentum buffers); torch's fused SGD does the same update with nothing to compile, and the user's flags stay."""
    seen = []

    def make_opt(ps):
        opt = torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=True)
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["fused"]))
        return opt

    step = _blocks_trained_like_eager(make_opt)
    opt_report = step.report().to_dict()["optimizer"]
    assert not opt_report["compiled"] and opt_report["graphs"] == 0, opt_report
    assert "param group 0 has foreach=True" in opt_report["as_is"] and "fused=True" in opt_report["as_is"]
    assert seen == [True] * 4 + [None] * 4, seen  # ours, then the eager reference's own foreach steps
    group = step.optimizer.param_groups[0]
    assert group["foreach"] is True and not group["fused"], group


def test_a_foreach_sgd_group_with_a_sparse_gradient_takes_torchs_foreach_step():
    """torch's fused SGD refuses sparse gradients (an `nn.Embedding(sparse=True)`, which ddp='split' reduces):
    that group takes the user's own foreach step, like eager."""
    from tests.multi_gpu.field_models import SparseBag, index_data

    seen = []

    def setup():
        torch.manual_seed(0)
        model = DDP(SparseBag())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
        opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["fused"]))
        return model, opt

    data = [(x, y) for (x,), y in index_data(0, 3, torch.device("cpu"))]
    model, opt = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, ddp="split")
    for x, y in data:
        step(x, y)
    assert model.module.emb.weight.grad is None  # zero_grad after the update; the gradients were sparse
    ref_model, ref_opt = setup()
    eager_ddp_run(ref_model, ref_opt, None, data)
    assert_params_close(model, ref_model)
    assert seen[:3] == [None] * 3, seen  # the user's flags while it stepped: torch's foreach step


def test_a_foreach_adamw_with_fused_false_stays_compiled():
    """`fused=False` said outright (torch's default is None) is the user's choice: the step is compiled whole."""
    step = _blocks_trained_like_eager(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True, fused=False))
    opt_report = step.report().to_dict()["optimizer"]
    assert opt_report["compiled"] and opt_report["as_is"] is None, opt_report
    assert "param group 0 has foreach=True" in opt_report["whole_step_reason"], opt_report


def test_a_foreach_adamw_over_a_strided_view_parameter_stays_compiled():
    """A parameter that is a strided view (not dense in any memory format): torch's CUDA fused kernel refuses a
    gradient or state that does not share its strides, so the step stays compiled whole."""
    from compile_core.step.fused import fused_instead

    dense = nn.Parameter(torch.zeros(4, 4))
    strided = nn.Parameter(torch.zeros(4, 8)[:, ::2])
    channels_last = nn.Parameter(torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last))
    assert fused_instead(torch.optim.AdamW([dense, channels_last], foreach=True)) is not None
    assert fused_instead(torch.optim.AdamW([dense, strided], foreach=True)) is None
    assert fused_instead(torch.optim.SGD([dense], foreach=True)) is not None
    assert fused_instead(torch.optim.RMSprop([dense], foreach=True)) is None  # only SGD, Adam and AdamW
    assert fused_instead(torch.optim.AdamW([dense], foreach=False)) is None  # the per-parameter loop


def test_a_group_switched_to_the_per_parameter_loop_mid_run_steps_its_own_way():
    """The user sets `foreach=False` on the group after update 2: from then on torch's own per-parameter step
    runs it (no fused step behind the user's back), and training still matches eager DDP doing the same."""
    from tests.single.ddp_helpers import Blocks

    seen = []

    def setup(record):
        torch.manual_seed(0)
        model = DDP(Blocks(width=16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        if record:
            opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["fused"]))
        return model, opt

    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(4)]
    model, opt = setup(True)
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    ref_model, ref_opt = setup(False)
    for i, (x, y) in enumerate(data):
        if i == 2:
            opt.param_groups[0]["foreach"] = ref_opt.param_groups[0]["foreach"] = False
        step(x, y)
        eager_ddp_run(ref_model, ref_opt, None, [(x, y)])
    assert_params_close(model, ref_model)
    assert seen == [True, True, None, None], seen


def test_a_foreach_adam_steps_fused_after_a_state_with_host_step_counts_is_loaded():
    """A checkpoint of a plain foreach run keeps its step counts as it made them (on the host, in the default
    dtype: float64 here, as under `torch.set_default_dtype(torch.float64)`); loaded mid-run, the fused step
    puts each count where its kernel reads it (the parameter's device, float32: on a GPU a host count would
    not do) and goes on as eager DDP does."""
    from tests.single.ddp_helpers import Blocks

    def setup():
        torch.manual_seed(0)
        model = DDP(Blocks(width=16))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)

    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(6)]
    ref_model, ref_opt = setup()
    eager_ddp_run(ref_model, ref_opt, None, data[:3])
    saved = copy.deepcopy(ref_opt.state_dict())  # state_dict() holds the live state tensors
    saved["state"] = {k: {**v, "step": v["step"].double()} for k, v in saved["state"].items()}
    checkpoint = {k: v.clone() for k, v in ref_model.state_dict().items()}, saved
    eager_ddp_run(ref_model, ref_opt, None, data[3:])

    model, opt = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND)
    step(*data[0])  # the state the checkpoint replaces
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    assert all(s["step"].dtype == torch.float64 and float(s["step"]) == 3.0 for s in opt.state.values())
    for x, y in data[3:]:
        step(x, y)
    assert_params_close(model, ref_model)
    counts = [s["step"] for s in opt.state.values()]
    assert all(c.dtype == torch.float32 and float(c) == 6.0 for c in counts), counts


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad])
def test_a_fused_optimizer_keeps_torchs_fused_step_and_says_so(opt_cls):
    """fused=True: torch's fused kernel is already one launch per device and dtype, and Dynamo does not trace
    it; the update is that step, not per-block compiled math (a kernel per parameter), and the report says so."""
    kwargs = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {"weight_decay": 0.1}

    def setup():
        torch.manual_seed(0)
        model = DDP(tiny_model())
        return model, opt_cls(model.parameters(), lr=1e-2, fused=True, **kwargs)

    data = batches(4)
    model, opt = setup()
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, clip_grad_norm=0.5)
    for x, y in data:
        step(x, y)
    ref_model, ref_opt = setup()
    eager_ddp_run(ref_model, ref_opt, None, data, clip=0.5)
    assert_params_close(model, ref_model)
    report = step.report().to_dict()
    opt_report = report["optimizer"]
    assert "fused=True" in (opt_report["as_is"] or ""), opt_report
    assert not opt_report["compiled"] and opt_report["fallback_error"] is None and not opt_report["per_block"]
    assert opt_report["graphs"] == 0 and report["fallbacks"] == [], report["fallbacks"]
    assert "torch's own step (fused=True" in str(step.report())


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
