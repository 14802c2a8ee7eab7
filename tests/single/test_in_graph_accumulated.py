"""ddp/in_graph/accumulated.py: how accumulated `.grad` reaches the synchronising graph, one process, no graph.

The 2-rank tests (tests/multi_gpu/test_in_graph_multirank.py, the Inductor field suite, the Lightning and HF
Trainer jobs) prove the training equals eager DDP's; these pin each case of the contract on its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from aot.torch_eager import version_of
from ddp.in_graph.accumulated import AccumulatedGradients


def _params(n: int = 2) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.ones(3)) for _ in range(n)]
    for i, p in enumerate(params):
        p.grad = torch.full((3,), float(i + 1))
    return params


def _after_no_sync(acc: AccumulatedGradients) -> None:
    assert acc.at_forward(sync=False) is False  # a no_sync micro-batch's forward takes nothing


def _lending(params: list[nn.Parameter]) -> AccumulatedGradients:
    """A user's loop after one no_sync micro-batch, at the synchronising forward (which takes the gradients)."""
    acc = AccumulatedGradients(params, lend=True)
    _after_no_sync(acc)
    assert acc.at_forward(sync=True) is True
    return acc


def test_a_user_loop_lends_grad_after_a_no_sync_forward_and_lets_go_when_the_backward_begins():
    params = _params()
    acc = AccumulatedGradients(params, lend=True)
    _after_no_sync(acc)
    held = [p.grad for p in params]
    assert acc.at_forward(sync=True) is True
    taken = [acc.take(p) for p in params]
    assert all(t is h for t, h in zip(taken, held)), "lent by reference, not copied"
    assert all(p.grad is h for p, h in zip(params, held)), "a user's .grad stays until the backward begins"
    acc.at_backward_start()
    assert all(p.grad is None for p in params), "autograd must not add this micro-batch to what the graph reduces"
    assert [t.tolist() for t in taken] == [[1.0] * 3, [2.0] * 3]


def test_an_in_place_write_after_the_forward_is_read_as_it_is_with_the_version_of_the_forward():
    (p,) = _params(1)
    acc = _lending([p])
    taken = acc.take(p)
    version = version_of(taken)
    p.grad.mul_(0.5)  # the loop rescales .grad between the forward and the backward
    acc.at_backward_start()
    assert p.grad is None
    assert taken.tolist() == [0.5] * 3 and version_of(taken) == version  # autograd accepts the saved input


def test_a_dropped_or_replaced_grad_is_zeroed_in_what_the_graph_took():
    dropped, replaced = _params()
    acc = _lending([dropped, replaced])
    took_dropped, took_replaced = acc.take(dropped), acc.take(replaced)
    dropped.grad = None  # zero_grad(set_to_none=True) after the forward
    replacement = torch.full((3,), 7.0)
    replaced.grad = replacement
    acc.at_backward_start()
    assert took_dropped.tolist() == [0.0] * 3 and took_replaced.tolist() == [0.0] * 3
    assert dropped.grad is None and replaced.grad is replacement  # the replacement is reduced after the backward


def test_nothing_is_lent_without_a_no_sync_forward_before_or_under_cuda_graphs():
    params = _params()
    acc = AccumulatedGradients(params, lend=True)
    assert acc.at_forward(sync=True) is False  # .grad left from the last step, zeroed after the forward (tutorial)
    with torch.no_grad():
        assert acc.at_forward(sync=False) is False  # evaluation is not an accumulating micro-batch
    assert acc.at_forward(sync=True) is False
    off = AccumulatedGradients(params, lend=False)
    _after_no_sync(off)
    assert off.at_forward(sync=True) is False
    assert all(p.grad is not None for p in params)


def test_a_zero_input_where_nothing_was_accumulated():
    params = _params()
    params[1].grad = None
    acc = _lending(params)
    assert acc.take(params[1]).tolist() == [0.0] * 3
    assert acc.take(params[0]).tolist() == [1.0] * 3
    assert acc.take(params[0]).tolist() == [0.0] * 3, "a second run of a graph in the same forward adds nothing"


def test_a_train_step_moves_grad_out_and_puts_back_what_no_graph_took():
    used, unused = _params()
    acc = AccumulatedGradients([used, unused], lend=True)
    acc.move_out = True
    assert acc.at_forward(sync=True) is True  # no no_sync forward needed: the step owns the loop
    assert used.grad is None and unused.grad is None
    assert acc.take(used).tolist() == [1.0] * 3
    used.grad = torch.full((3,), 5.0)  # what the backward produced
    unused.grad = torch.full((3,), 3.0)  # from outside the graph
    acc.at_backward_start()
    acc.at_backward_end()
    assert used.grad.tolist() == [5.0] * 3
    assert unused.grad.tolist() == [5.0] * 3  # 3 + the 2 it held before the forward


def test_a_forward_without_its_backward_leaves_grad_alone():
    params = _params()
    acc = _lending(params)
    held = acc.take(params[0])
    acc.abandon()
    assert params[0].grad is held and held.tolist() == [1.0] * 3
    assert acc.at_forward(sync=True) is True  # still after the no_sync micro-batch: the next forward takes it


def test_a_backward_that_fills_no_grad_gives_the_lent_gradient_back():
    """`torch.autograd.grad` runs the graph's backward (which read the lent tensor) but fills no `.grad`."""
    (p,) = _params(1)
    acc = _lending([p])
    held = acc.take(p)
    acc.at_backward_start()
    assert p.grad is None
    acc.at_backward_end()
    assert p.grad is held and held.tolist() == [1.0] * 3
