"""compile_core/regions.py: repeated blocks as nested compile regions (one process, no process group)."""

from __future__ import annotations

import pickle

import pytest
import torch

from compile_core.regions import apply_nested_regions, region_class, remove_nested_regions
from examples.gpt import GPT, Block, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=3, max_seq_len=16)


def _region_calls(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    calls: list[int] = []

    def count(gm, inputs):
        calls.append(sum("invoke_subgraph" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=count)(x)
    return calls[0], out


def test_repeated_blocks_become_one_region_called_per_layer_and_compute_the_same():
    torch.manual_seed(0)
    model = GPT(CFG)
    plain = GPT(CFG)
    plain.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    assert apply_nested_regions(model) == {"Block": 3}
    assert all(type(b) is region_class(Block) and isinstance(b, Block) for b in model.blocks)
    assert list(model.state_dict()) == keys  # names, checkpoints and optimizers see the same model
    x, _ = synthetic_batch(CFG, 2, 8, step=0)
    calls, out = _region_calls(model, x)
    assert calls == 3, calls  # one traced block, called per layer
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    assert _region_calls(plain, x)[0] == 0
    assert apply_nested_regions(model) == {}  # marking twice changes nothing
    remove_nested_regions(model)
    assert all(type(b) is Block for b in model.blocks)
    fresh = GPT(CFG)  # never compiled: Dynamo can leave references on a compiled module
    apply_nested_regions(fresh)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(fresh)  # why remove_nested_regions exists
    remove_nested_regions(fresh)
    pickle.dumps(fresh)  # whole-module pickling works again with the original class


def test_one_region_per_class_and_instances_with_their_own_forward_are_left_alone():
    torch.manual_seed(0)
    model = GPT(CFG)
    own = model.blocks[1]
    own.forward = lambda x: Block.forward(own, x)  # an instance-level forward: marking would drop it
    assert apply_nested_regions(model) == {"Block": 2}
    assert type(own) is Block and region_class(Block) is type(model.blocks[0]) is type(model.blocks[2])


def test_nested_regions_needs_in_graph_and_a_bool():
    from compile_core.config import CompileConfig

    with pytest.raises(ValueError, match="nested_regions=True needs ddp='in_graph'.*ddp='split'"):
        CompileConfig(ddp="split", nested_regions=True)
    with pytest.raises(TypeError, match="nested_regions='yes' must be True or False"):
        CompileConfig(ddp="in_graph", nested_regions="yes")
    assert CompileConfig(ddp="in_graph", nested_regions=True).nested_regions
