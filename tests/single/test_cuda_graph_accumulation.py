"""Accumulated gradients kept out of the CUDA graphs' memory pool (compile_core/step/accumulation.py).

Without a GPU here the CUDA graphs themselves do not run: these tests pin when the copy is made and that a train
step making it trains as eager DDP does; whether it keeps a CUDA-graphed step with accumulation running is
for the GPU probe (`python -m tests.multi_gpu.cudagraph_probe in_graph_accum in_backward_accum`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compile_core.step import train_step
from compile_core.step.accumulation import GradsOutOfGraphPool, accumulates_under_cuda_graphs
from compile_core.step.config import TrainStepConfig
from tests.single.train_step_helpers import (
    BACKEND,
    assert_params_close,
    batches,
    eager_ddp_run,
    fresh_dynamo,  # noqa: F401 (an autouse fixture)
    make_setup,
    process_group,  # noqa: F401 (an autouse fixture)
)


@pytest.mark.parametrize(
    "compile_kwargs, accum_steps, device, expected",
    [
        ({"mode": "reduce-overhead"}, 2, "cuda", True),
        ({"mode": "max-autotune"}, 4, "cuda", True),
        ({"options": {"triton.cudagraphs": True}}, 2, "cuda", True),
        ({"mode": "reduce-overhead"}, 1, "cuda", False),  # nothing accumulates
        ({"mode": "reduce-overhead"}, 2, "cpu", False),  # no CUDA graphs on the CPU
        ({"mode": "max-autotune-no-cudagraphs"}, 2, "cuda", False),
        ({}, 2, "cuda", False),
    ],
)
def test_the_copy_is_made_only_where_cuda_graphs_accumulate(compile_kwargs, accum_steps, device, expected):
    config = TrainStepConfig(backend="inductor", accum_steps=accum_steps, compile_kwargs=compile_kwargs)
    assert accumulates_under_cuda_graphs(config, device) is expected
    other_backend = TrainStepConfig(backend="aot_eager", accum_steps=accum_steps, compile_kwargs=compile_kwargs)
    assert not accumulates_under_cuda_graphs(other_backend, device)


def test_each_gradient_is_copied_once_per_update_and_added_into_afterwards():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    params[0].grad, params[1].grad = torch.ones(3), torch.full((3,), 2.0)  # the third has none
    from_graph = [p.grad for p in params]
    pool = GradsOutOfGraphPool()
    assert pool.after_accumulating_backward(params) == 2
    assert params[0].grad is not from_graph[0] and params[1].grad is not from_graph[1] and params[2].grad is None
    torch.testing.assert_close(params[1].grad, from_graph[1])
    copies = [p.grad for p in params]
    params[0].grad.add_(1.0)  # autograd adds the next micro-batch into the copy in place
    params[2].grad = torch.ones(3)  # a first gradient in a later micro-batch: that one is copied
    assert pool.after_accumulating_backward(params) == 1
    assert params[0].grad is copies[0] and params[1].grad is copies[1]
    pool.after_update()
    assert pool.after_accumulating_backward(params) == 3  # a new update: its gradients are copied again


@pytest.mark.parametrize("accum", [2, 3])
def test_a_step_that_copies_its_accumulated_gradients_trains_as_eager_ddp(monkeypatch, accum):
    """The copy runs on the CPU when the step is told it accumulates under CUDA graphs: the update is eager's."""
    import compile_core.step.train as train

    monkeypatch.setattr(train, "accumulates_under_cuda_graphs", lambda config, device_type: True)
    copies = []
    original = GradsOutOfGraphPool.after_accumulating_backward
    monkeypatch.setattr(
        GradsOutOfGraphPool, "after_accumulating_backward", lambda self, p: copies.append(original(self, p))
    )
    data = batches(2 * accum)
    model, opt, _ = make_setup("adamw")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, accum_steps=accum)
    for x, y in data:
        step(x, y)
    n = len(list(model.parameters()))
    assert copies == [n] + [0] * (accum - 2) + [n] + [0] * (accum - 2), copies
    ref, ref_opt, _ = make_setup("adamw")
    eager_ddp_run(ref, ref_opt, None, data, accum=accum)
    assert_params_close(model, ref)
