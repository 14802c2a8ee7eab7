"""The helpers that put a rank's models and data on its device (tests/ranks.py), without a GPU.

The multi-rank tests rely on them to run unchanged under nccl; here the "GPU" is the meta device (a
device other than the CPU that needs no hardware), so a value the helper fails to move shows up.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from tests import ranks


def test_to_rank_device_moves_modules_tensors_and_nested_containers(pg, monkeypatch):
    monkeypatch.setattr(ranks, "rank_device", lambda rank: torch.device("meta"))
    model = nn.Linear(2, 2)
    x, y = torch.randn(3, 2), torch.randn(3, 2)

    moved = ranks.to_rank_device(((x, None), [y], {"target": y, "steps": 3}))
    assert ranks.to_rank_device(model) is model  # moved in place, as nn.Module.to does
    assert {p.device.type for p in model.parameters()} == {"meta"}
    (mx, none), [my], extra = moved
    assert mx.device.type == my.device.type == extra["target"].device.type == "meta"
    assert none is None and extra["steps"] == 3
    assert type(moved) is tuple and type(moved[1]) is list


def test_to_rank_device_on_the_cpu_changes_nothing(pg):
    x = torch.randn(3, 2)
    batch = [(x,)]
    assert ranks.rank_device(0) == torch.device("cpu")  # a gloo group
    assert ranks.to_rank_device(batch)[0][0] is x  # the same tensor: no copy, the same numbers


def test_a_gloo_rank_goes_to_a_gpu_only_when_the_environment_asks_and_a_gpu_exists(pg, monkeypatch):
    monkeypatch.setenv(ranks.RANK_DEVICE_ENV, "cpu")
    assert ranks.rank_device(0) == torch.device("cpu")
    monkeypatch.setenv(ranks.RANK_DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="DDP_COMPILE_TEST_DEVICE='gpu'.*'cuda'"):
        ranks.rank_device(0)
    monkeypatch.setenv(ranks.RANK_DEVICE_ENV, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no GPU"):
        ranks.rank_device(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert ranks.rank_device(1) == torch.device("cuda", 0)  # two gloo ranks share the one GPU


def test_wrap_ddp_gives_a_gpu_module_its_device_ids_and_a_cpu_module_none(monkeypatch):
    calls = []
    monkeypatch.setattr(ranks, "DDP", lambda module, **kwargs: calls.append(kwargs))

    class OnGpu1(nn.Module):
        def parameters(self, recurse: bool = True):
            yield types.SimpleNamespace(device=torch.device("cuda", 1))

    ranks.wrap_ddp(OnGpu1(), bucket_cap_mb=1)
    ranks.wrap_ddp(nn.Linear(2, 2), bucket_cap_mb=1)
    assert calls == [{"bucket_cap_mb": 1, "device_ids": [1]}, {"bucket_cap_mb": 1}]
