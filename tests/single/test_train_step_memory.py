"""What a train step keeps alive while its backward runs: only what autograd saved. The model's output (a
language model's logits: 256 MiB for GPT-2 small at 8x256 tokens, the largest tensor of its step) is dead
once the loss is computed from it, as in the eager loop `loss_fn(model(x), y).backward()`; a step that
still holds it raises its memory peak, which sits at the start of the backward, by that much."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.train_step_helpers import BACKEND, batches, fresh_dynamo, process_group, tiny_model  # noqa: F401

MODES = {
    "split": {"ddp": "split"},
    "in_graph": {"ddp": "in_graph"},
    "in_backward": {"ddp": "in_graph", "optimizer_in_backward": True},  # update 1 eager, 2.. in the backward
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_models_output_is_dead_when_the_backward_begins(mode):
    alive_at_backward: list[bool] = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # MSE's backward saves the difference, never `output` itself: only the step could keep it alive
        ref = weakref.ref(output)
        loss = (output - target).square().mean()
        loss.register_hook(lambda grad: alive_at_backward.append(ref() is not None))
        return loss

    model = DDP(tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_core.train_step(model, opt, loss_fn, backend=BACKEND, **MODES[mode])
    for x, y in batches(3):
        step(x, y)
    assert alive_at_backward == [False, False, False]
