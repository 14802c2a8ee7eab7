"""A float that Dynamo made dynamic (stochastic depth's drop rate once a recompile saw another value; the
model of pytorch/pytorch#196227) in a split graph, and in graphs that differ only in that float.

Dynamo then passes the float as a 0-d tensor and reads it back with `.item()`; AOTAutograd turns that into
tensor math where it can and bakes the number in where an op needs a plain float (`bernoulli_(p)`). So:
  * a cut between the arithmetic on the float and its use must not make the float a piece output
    (Inductor takes none; the piece fell back to aot_eager);
  * two graphs alike but for that number must not share a compile, in-process or through AOTAutograd's
    cache (the second block ran with the first block's drop rate).
World size 1 (gloo), compared with eager DDP, both called under the same random seed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from aot.structure import reads_tensor_values
from ddp.splitter import DDPSplitter, SplitterConfig

pytestmark = pytest.mark.usefixtures("pg")


class DropPath(nn.Module):
    """Stochastic depth per sample (as torchvision's `StochasticDepth(p, mode="row")`)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        survival = 1.0 - self.p
        noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
        noise.bernoulli_(survival)
        if survival > 0.0:
            noise.div_(survival)
        return x * noise


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop_path = nn.Linear(32, 32), nn.Linear(32, 32), DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.fc1(x))
        return x + self.drop_path(self.fc2(x))


class DropPathModel(nn.Module):
    """Rising drop rates, one graph per block: the block frame compiled for 0.0 compiles again for 0.1 with
    the rate dynamic, and 0.2 fails that graph's guard on the rate (bernoulli_ needs a plain float)."""

    def __init__(self, rates: tuple[float, ...] = (0.0, 0.1, 0.2)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(p) for p in rates)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        return x


def _train_against_eager(backend: str, bucket_cap_mb: float, steps: int = 2) -> dict:
    torch.manual_seed(0)
    model = DropPathModel()
    ref = copy.deepcopy(model)
    ours = compile_core.compile(DDP(model, bucket_cap_mb=bucket_cap_mb), backend=backend)
    theirs = DDP(ref, bucket_cap_mb=bucket_cap_mb)
    for step in range(steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))  # 64 draws: rates 0.1 and 0.2 differ
        outs = []
        for m in (ours, theirs):
            torch.manual_seed(100 + step)  # the same drop masks, if the same rates are used
            out = m(x)
            out.square().mean().backward()
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6, msg=f"step {step} output")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step} grad {name}")
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    return ours.report().to_dict()


@pytest.mark.parametrize("bucket_cap_mb", [0.001, 100.0], ids=["split", "whole"])
def test_dynamic_drop_rates_train_as_eager(bucket_cap_mb):
    report = _train_against_eager("aot_eager", bucket_cap_mb)
    assert report["fallbacks"] == []
    if bucket_cap_mb < 1:
        assert all(g["pieces"] == 2 for g in report["graphs"]), report["graphs"]


@pytest.mark.inductor
@pytest.mark.parametrize("bucket_cap_mb", [0.001, 100.0], ids=["split", "whole"])
def test_dynamic_drop_rates_compile_with_inductor_and_train_as_eager(bucket_cap_mb, tmp_path, monkeypatch):
    # A fresh AOTAutograd cache: the wrong entry was the one this run saves for the first rate.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with torch._inductor.config.patch(fallback_random=True):  # Inductor draws as eager does
        report = _train_against_eager("inductor", bucket_cap_mb)
    assert report["fallbacks"] == []


def test_a_float_is_never_a_piece_output():
    model = DropPathModel()
    outputs: list[tuple[str, list[str]]] = []

    def record_outputs(gm, example_inputs, name):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        values = [a.meta.get("example_value") for a in out if isinstance(a, torch.fx.Node)]
        outputs.append((name, [type(v).__name__ for v in values]))
        return gm.forward, False

    config = SplitterConfig(
        bucket_cap_bytes=1, first_bucket_cap_bytes=1, param_names={id(p): n for n, p in model.named_parameters()}
    )
    fn = torch._dynamo.optimize(DDPSplitter(config, record_outputs))(lambda t: model(t))
    fn(torch.randn(8, 32))
    assert len(outputs) >= 4, outputs  # two pieces per block graph
    assert all(kinds == ["FakeTensor"] for _, kinds in outputs), outputs


def test_graphs_that_read_a_tensor_value_are_named():
    def graph(fn):
        captured = []
        torch.compile(fn, backend=lambda gm, inputs: captured.append(gm) or gm.forward, fullgraph=True)(torch.ones(3))
        return captured[0]

    assert not reads_tensor_values(graph(lambda x: x * 2))
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        assert reads_tensor_values(graph(lambda x: x * x.sum().item()))
