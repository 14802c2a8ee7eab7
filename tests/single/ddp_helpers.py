"""Shared by the single-process DDP tests: train compiled DDP and eager DDP side by side."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core


def mlp(n: int = 3, width: int = 256) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def run_against_eager(
    make_model,
    make_input,
    *,
    steps=2,
    ddp_kwargs=None,
    ignore=(),
    rtol=1e-4,
    atol=1e-5,
    observe=False,
    with_ref=False,
    **compile_kwargs,
):
    """Train `steps` SGD steps with compiled DDP and eager DDP from the same weights; compare everything.

    observe=True attaches `ddp.overlap.OverlapRecorder` before compiling, so the report's
    `observed_alignment` compares our pieces with the buckets DDP really reduced. with_ref=True also
    returns the eager DDP reference (a third value).
    """
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    if ignore:
        for m in (model, ref):
            DDP._set_params_and_buffers_to_ignore_for_model(m, list(ignore))
    ours = DDP(model, **(ddp_kwargs or {}))
    theirs = DDP(ref, **(ddp_kwargs or {}))
    if observe:
        from ddp.overlap import OverlapRecorder

        OverlapRecorder.attach(ours)
    compiled = compile_core.compile(ours, **compile_kwargs)
    for step in range(steps):
        x = make_input(step)
        args = x if isinstance(x, tuple) else (x,)
        out, expected = compiled(*args), theirs(*args)
        torch.testing.assert_close(out, expected, rtol=rtol, atol=atol, msg=f"step {step} output")
        out.float().square().mean().backward()
        expected.float().square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if p.grad is None and q.grad is None:
                continue
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=f"step {step} grad {name}")
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                if p.grad is not None:
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                p.grad, q.grad = None, None
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=f"buffer {name}")
    if with_ref:
        return compiled, compiled.report().to_dict(), theirs
    return compiled, compiled.report().to_dict()


def x256(step: int) -> torch.Tensor:
    return torch.randn(8, 256, generator=torch.Generator().manual_seed(step))


class Blocks(nn.Module):
    """An input layer, `n` identical residual blocks (a ModuleList, as in a transformer), a head."""

    def __init__(self, n: int = 4, width: int = 64, out: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(n)
        )
        # out=None: width x width, over a 0.01 MiB first bucket's cap: a bucket of its own
        self.head = nn.Linear(width, width if out is None else out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def x64(step: int, rank: int = 0) -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(step * 101 + rank))
