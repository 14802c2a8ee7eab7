"""`nn.SyncBatchNorm` (the vision scripts' `convert_sync_batchnorm`) through every mode that owns the reduction.

SyncBatchNorm all-gathers the batch statistics in its forward and all-reduces their gradients in its
backward: collectives of the model itself, beside the gradient buckets. Each scenario replays the eager
DDP loop (tests/multi_gpu/user_script.py) on 2 ranks with rank-dependent data and compares parameters
and running statistics with the eager script. torch refuses SyncBatchNorm on CPU tensors in training,
so these run only where the gloo ranks live on a GPU (`DDP_COMPILE_TEST_DEVICE=cuda`,
benchmarks/gpu_check.sh), never in CPU CI.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.field_models import OUT, regression_data
from tests.multi_gpu.models import WIDTH
from tests.multi_gpu.user_script import Script, assert_like_eager, run_against_eager
from tests.ranks import RANK_DEVICE_ENV, ranks_on_gpu, run_ranks

pytestmark = [
    pytest.mark.multi_gpu,
    pytest.mark.timeout(480),
    pytest.mark.skipif(
        not ranks_on_gpu(2),
        reason=f"SyncBatchNorm trains only on GPU tensors (torch raises for CPU input): needs 2 CUDA GPUs, or one "
        f"with {RANK_DEVICE_ENV}=cuda",
    ),
]


class ConvSyncBN(nn.Module):
    """conv (no bias: BatchNorm removes it) -> SyncBatchNorm -> relu, twice, and a linear head (the usual
    converted vision stem)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(8 * 16, OUT)

    def forward(self, x):
        return self.head(self.stem(x.reshape(x.shape[0], 4, 4, 4)).flatten(1))


def sync_bn_model() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(ConvSyncBN())


def _script(**kwargs) -> Script:
    return Script(make_model=sync_bn_model, data=regression_data, steps=3, **kwargs)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


assert WIDTH == 64, "ConvSyncBN reads each input row as a 4x4x4 image"

SCENARIOS = {
    "split": lambda r: run_against_eager(_script(), r, how="compile", ddp="split", bucket_cap_mb=0.001),
    "in_graph": lambda r: run_against_eager(_script(), r, how="compile", ddp="in_graph", bucket_cap_mb=0.001),
    "in_graph_inductor": lambda r: run_against_eager(
        _script(), r, how="compile", ddp="in_graph", backend="inductor", bucket_cap_mb=0.001
    ),
    "step_in_graph": lambda r: run_against_eager(
        _script(make_opt=_adamw), r, how="train_step", ddp="in_graph", bucket_cap_mb=0.001
    ),
    "step_in_backward": lambda r: run_against_eager(
        _script(make_opt=_adamw),
        r,
        how="train_step",
        ddp="in_graph",
        optimizer_in_backward=True,
        bucket_cap_mb=0.001,
    ),
}


def _all(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, world_size=2, timeout=460)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sync_batchnorm_trains_like_eager_ddp(results, name):
    """Parameters and the synced running statistics equal eager DDP's on both ranks."""
    per_rank = ok(results, name)
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-5, state=False)
    for key in ("stem.1.running_mean", "stem.4.running_var"):
        ours = [r["buffers"][key] for r in per_rank]
        torch.testing.assert_close(ours[0], ours[1], msg=f"{key} differs between ranks: not synced")
        torch.testing.assert_close(ours[0], per_rank[0]["ref_buffers"][key], rtol=1e-4, atol=1e-5)
