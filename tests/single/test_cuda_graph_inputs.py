"""What CUDA graphs need from the graphs a train step hands Inductor, checked on the CPU.

Inductor captures a graph as a CUDA graph (`mode="reduce-overhead"`) only if it mutates no input outside its
static inputs and holds no op CUDA graphs cannot capture. Its static inputs are used where they live; every
other input is copied into the captured graph's own buffer at every replay. The list of static inputs is the
same whatever the device, so the CPU can check it: we read what Inductor is handed (`compile_fx_inner`'s
`static_input_idxs`) and what it found mutated (the compiled graph's `mutated_input_idxs`).

The case this guards: with `optimizer_in_backward=True` the optimizer state enters the forward as extra inputs
(saved for the backward, which updates it in place). As ordinary inputs, CUDA graphs would update copies, and
the optimizer state would never move.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.compile_fx as inductor_compile_fx
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.utils import get_first_incompatible_cudagraph_node
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.train_step_helpers import fresh_dynamo, process_group  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)

BATCH, TABLE = (5, 8), (4, 9)  # the input batch; AdamW's scalar table: a row per parameter, 9 scalars


def _graphs_inductor_sees(monkeypatch, **step_options) -> list[dict]:
    """Train 4 micro-batches of a 2-layer MLP (parameter shapes (16, 8), (16,), (4, 16), (4,)) and record, for each
    graph Inductor compiles: forward or backward, its input shapes, static inputs, mutated inputs and the
    first node CUDA graphs cannot capture."""
    seen: list[dict] = []
    real = inductor_compile_fx.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        compiled = real(gm, example_inputs, **kwargs)
        seen.append(
            {
                "backward": bool(kwargs.get("is_backward")),
                "shapes": [
                    tuple(getattr(n.meta.get("val"), "shape", ())) for n in gm.graph.find_nodes(op="placeholder")
                ],
                "static": set(kwargs.get("static_input_idxs", ())),
                "mutated": set(compiled.mutated_input_idxs),
                "incompatible": get_first_incompatible_cudagraph_node(gm),
            }
        )
        return compiled

    monkeypatch.setattr(inductor_compile_fx, "compile_fx_inner", spy)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"ddp": "in_graph", **step_options}
    step = compile_core.train_step(model, opt, F.mse_loss, backend="inductor", **options)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would not be compiled again
        for _ in range(4):
            step(torch.randn(*BATCH), torch.randn(5, 4))
    assert any(g["backward"] for g in seen) and any(not g["backward"] for g in seen), seen
    return seen


def _assert_capturable(graphs: list[dict]) -> None:
    for g in graphs:
        assert g["incompatible"] is None, g
        assert g["mutated"] <= g["static"], f"mutates inputs CUDA graphs would copy: {g['mutated'] - g['static']}"


@pytest.mark.parametrize(
    "options", [{}, {"clip_grad_norm": 1.0}, {"accum_steps": 2}], ids=["plain", "clip", "accumulation"]
)
def test_in_backward_optimizer_state_is_a_static_input_of_the_forward(monkeypatch, options):
    graphs = _graphs_inductor_sees(monkeypatch, optimizer_in_backward=True, **options)
    forward = [g for g in graphs if not g["backward"]][-1]
    state = {(16, 8), (16,), (4, 16), (4,)}  # the parameters' shapes: theirs and their exp_avg/exp_avg_sq
    accumulated = sorted(state) if options.get("accum_steps") else []  # the gradient of micro-batch 1, per parameter
    counts = [forward["shapes"].count(s) for s in sorted(state)]
    # each parameter and its 2 state tensors enter the forward (and its accumulated gradient)
    assert counts == [3 + bool(accumulated)] * 4, forward["shapes"]
    copied = sorted(forward["shapes"][i] for i in range(len(forward["shapes"])) if i not in forward["static"])
    # Copied at every replay: the batch, this update's scalar table (new each update) and the gradients carried
    # from micro-batch 1; with clipping nothing more: the 0-dim tensor receiving the total norm is written by
    # the backward, so it is static.
    assert copied == sorted([BATCH, TABLE, *accumulated]), forward["shapes"]
    _assert_capturable(graphs)


@pytest.mark.parametrize(
    "options",
    [{"ddp": "in_graph"}, {"ddp": "split"}, {"ddp": "in_graph", "accum_steps": 2}],
    ids=["in_graph", "split", "in_graph_accum"],
)
def test_train_step_graphs_are_capturable(monkeypatch, options):
    graphs = _graphs_inductor_sees(monkeypatch, **options)
    if options == {"ddp": "in_graph"}:  # one graph: only the batch is copied at each replay
        forward = [g for g in graphs if not g["backward"]][-1]
        assert [forward["shapes"][i] for i in range(len(forward["shapes"])) if i not in forward["static"]] == [BATCH]
    _assert_capturable(graphs)
