"""Shared by the single-process train_step tests (tests/single/test_train_step_*.py): the world-size-1 process
group and Dynamo reset fixtures, a tiny model with its batches, optimizer and scheduler recipes, the eager DDP
reference loop and the parameter comparisons. A test module uses the fixtures by importing them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, OneCycleLR, StepLR

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
