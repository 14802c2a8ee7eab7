"""benchmarks/update_kernels.py: every way it runs the AdamW update computes torch's AdamW (the GPU figures
compare kernels only if they do the same work)."""

import pytest
import torch

from benchmarks import update_kernels


def _params():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (7, 300, 64, 5)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


@pytest.mark.parametrize("name", [v for v in update_kernels.VARIANTS if v != "foreach"])
def test_each_variant_updates_as_torch_adamw_foreach(name):
    reference, read_reference = update_kernels.variant("foreach", _params())
    update, read = update_kernels.variant(name, _params(), bucket_cap_mb=1e-3, backend="aot_eager")
    start = read().clone()
    for _ in range(3):
        reference()
        update()
    moved = (read_reference() - start).abs().max()
    assert moved > 1e-3  # the updates did something
    torch.testing.assert_close(read(), read_reference(), rtol=1e-5, atol=1e-6)


def test_buckets_follow_ddp_reverse_order_and_cap():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 4, 8)]  # 16, 16, 16, 32 bytes
    assert update_kernels._buckets(params, 32) == [[3], [2, 1], [0]]
