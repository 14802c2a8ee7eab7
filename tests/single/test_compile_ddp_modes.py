"""compile_core.compile's ddp= modes on real DDP (world size 1, gloo), compared with eager DDP: how many pieces
'none' and 'split' make, 'in_graph' refusing parameters with sparse gradients by name (which 'split' trains),
and 'torch' handing the model to PyTorch's DDPOptimizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.ddp_helpers import mlp, run_against_eager, x256

pytestmark = pytest.mark.usefixtures("pg")


@pytest.mark.parametrize("mode,pieces", [("none", 1), ("split", 3)])
def test_ddp_modes(mode, pieces):
    _, report = run_against_eager(mlp, x256, backend="aot_eager", bucket_cap_mb=0.25, ddp=mode)
    assert sum(g["pieces"] for g in report["graphs"]) == pieces


def test_in_graph_refuses_sparse_gradients_by_name():
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 4, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, idx):
            return self.head(self.emb(idx))

    with pytest.raises(ValueError, match=r"\['emb.weight'\] get sparse gradients.*use ddp='split'"):
        compile_core.compile(DDP(Bag()), backend="aot_eager", ddp="in_graph")
    bag = Bag()
    compiled = compile_core.compile(DDP(bag), backend="aot_eager", ddp="split")
    compiled(torch.tensor([[1, 2, 3]])).sum().backward()  # DDP's reducer all-reduces the sparse gradient
    assert bag.emb.weight.grad.is_sparse


def test_torch_mode_uses_pytorchs_ddp_optimizer():
    # PyTorch's DDPOptimizer asserts on caps under its 1 MiB first bucket, so this uses 1 MiB layers.
    make = lambda: mlp(3, 512)  # noqa: E731
    x = lambda s: torch.randn(4, 512, generator=torch.Generator().manual_seed(s))  # noqa: E731
    _, report = run_against_eager(make, x, backend="aot_eager", ddp_kwargs={"bucket_cap_mb": 1}, ddp="torch")
    # DDPOptimizer calls the backend once per piece it cut
    assert len(report["graphs"]) >= 2
