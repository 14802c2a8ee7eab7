"""The splitter on its own: no process group; DDP's role is played by a config (or a fake module)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import compile_core
from ddp.bucketing import MiB
from ddp.splitter import DDPSplitter, SplitterConfig


def mlp(n: int = 4, width: int = 128) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def eager_piece(gm, example_inputs, name):
    return gm.forward, False


def split_and_run(model: nn.Module, cap_bytes: int, x: torch.Tensor):
    graphs = []
    config = SplitterConfig(
        bucket_cap_bytes=cap_bytes,
        first_bucket_cap_bytes=min(cap_bytes, MiB),
        param_names={id(p): n for n, p in model.named_parameters()},
    )
    fn = torch._dynamo.optimize(DDPSplitter(config, eager_piece, graphs.append))(lambda t: model(t))
    return fn(x), graphs


LAYER = 128 * 128 * 4 + 128 * 4


@pytest.mark.parametrize(
    "cap_bytes,pieces",
    [(100 * MiB, 1), (2 * LAYER, 2), (LAYER, 4), (1, 4)],
)
def test_piece_count_follows_the_cap(cap_bytes, pieces):
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 128)
    out, graphs = split_and_run(model, cap_bytes, x)
    assert [g.pieces for g in graphs] == [pieces]
    expected = ref(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


class FakeDDP:
    """Just enough of a DDP module for Dynamo's DDPOptimizer to split with, if it got the chance."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.bucket_bytes_cap = 1  # DDPOptimizer would cut after every parameter
        self.parameters_to_ignore: set[str] = set()


def test_pytorch_ddp_optimizer_does_not_wrap_our_backend():
    model = mlp()
    x = torch.randn(2, 128)
    with torch.no_grad():
        expected = model(x)
    compiled = compile_core.compile(model, backend="aot_eager")
    fake = FakeDDP(model)
    saved = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = fake  # as if DDP's forward were running around us
    try:
        out = compiled(x)
    finally:
        DistributedDataParallel._active_ddp_module = saved
    report = compiled.report()
    # Our backend saw the whole graph once; DDPOptimizer would have called it once per piece.
    assert [g.pieces for g in report.graphs] == [1]
    assert len(report.pairs) == 1
    torch.testing.assert_close(out, expected)


@pytest.mark.compat  # torch 2.11 compiled no graph of this nn.Sequential (our hook broke the graph in torch.nn code)
def test_non_ddp_model_compiles_whole_and_says_so():
    model = mlp(2)
    compiled = compile_core.compile(model, backend="aot_eager", bucket_cap_mb=0.01)
    compiled(torch.randn(2, 128))
    d = compiled.report().to_dict()
    assert [g["pieces"] for g in d["graphs"]] == [1]
    assert d["graph_breaks"] == []
    assert any("not a DDP model" in n for n in d["notes"])
