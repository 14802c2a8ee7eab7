"""`aot` and `inductor` on their own: no DDP, no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from aot import GraphPair, aot_compile, nop_compiler
from inductor import InductorSettings, inductor_compile


def captured(module: nn.Module, x: torch.Tensor):
    """The graph Dynamo captures for module(x), and the inputs Dynamo would hand a backend."""
    seen = []

    def keep(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.optimize(keep)(lambda t: module(t))(x)
    return seen[0]


def test_aot_pairs_forward_with_backward_and_counts_saved_tensors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    gm, inputs = captured(model, x)
    pair = GraphPair(name="g")
    compiled = aot_compile(gm, inputs, fw_compiler=nop_compiler, bw_compiler=nop_compiler, pair=pair)
    out = compiled(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    expected = model(x)
    torch.testing.assert_close(out, expected)
    assert pair.forward is not None
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    # outside Dynamo's tracing context AOTAutograd may compile the backward lazily, at first use
    assert pair.backward is not None
    assert pair.num_saved > 0  # tanh's output (or its input) must be kept for the backward
    ref = torch.autograd.grad(expected.sum(), list(model.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
    assert "forward" in pair.describe() and pair.to_dict()["backward_ops"] > 0


@pytest.mark.inductor
def test_inductor_compiles_forward_and_backward_and_reports_each_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    gm, inputs = captured(model, x)
    graphs = []
    compiled = inductor_compile(gm, inputs, settings=InductorSettings(), on_graph=lambda g, bw: graphs.append(bw))
    out = compiled(*inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    assert graphs == [False, True]
    # the Inductor backward computes eager's gradients
    ref = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    for (name, _), g, r in zip(model.named_parameters(), grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "fastest"}, "mode='fastest'"),
        ({"options": {"not_an_option": 1}}, "not_an_option"),
        ({"options": [1]}, "dict"),
    ],
)
def test_inductor_settings_reject_bad_input(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        InductorSettings(**kwargs)


def test_mode_and_options_become_config_patches():
    patches = InductorSettings(mode="max-autotune-no-cudagraphs", options={"epilogue_fusion": False}).config_patches()
    assert patches["max_autotune"] is True and patches["epilogue_fusion"] is False


def test_modes_are_the_ones_this_torch_compile_takes():
    """`mode="lite"` (torch.compile's since 2.11) was refused by a list of four modes written down here."""
    assert InductorSettings(mode="lite").config_patches()["fallback_by_default"] is True


class _Partitioner:
    """Stands in for ddp/in_graph's partitioner: a uuid."""

    def __call__(self, joint, joint_inputs, *, base=None, **kwargs):  # never called: compile is stubbed
        raise AssertionError

    def uuid(self) -> str:
        return "test"


class _ExchangingPartitioner(_Partitioner):
    def inductor_requirements(self) -> dict:
        return {"allow_buffer_reuse": False}


def test_a_partitioners_inductor_requirements_overrule_the_users_options_with_a_warning(monkeypatch, caplog):
    import inductor.compilers as compilers

    seen = {}
    monkeypatch.setattr(compilers, "compile_fx_with", lambda gm, inputs, **kw: seen.update(kw["config_patches"]))
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    settings = InductorSettings(options={"allow_buffer_reuse": True})
    with caplog.at_level("WARNING", logger="inductor.compilers"):
        inductor_compile(gm, [torch.randn(1, 2)], settings=settings, partitioner=_ExchangingPartitioner())
    assert seen["allow_buffer_reuse"] is False
    assert any("allow_buffer_reuse=True is overruled" in r.getMessage() for r in caplog.records), caplog.text


def _region_gpt(layers: int):
    from examples.gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=256, d_model=64, n_heads=2, n_layers=layers, max_seq_len=32)
    torch.manual_seed(0)
    regions = GPT(cfg, regions=True)
    plain = GPT(cfg)
    plain.load_state_dict(regions.state_dict())
    return regions, plain, synthetic_batch(cfg, 2, 16, step=0)


def test_repeated_nested_regions_get_eagers_gradients_from_inductor():
    """torch 2.13's Inductor gets these gradients wrong with its buffer reuse on (65% off with 2 layers);
    `inductor_compile` turns reuse off for graphs that call a region twice or more."""
    from examples.gpt import lm_loss

    regions, plain, (x, y) = _region_gpt(2)
    compiled = torch.compile(
        regions, backend=lambda gm, inputs: inductor_compile(gm, inputs, settings=InductorSettings())
    )
    lm_loss(compiled(x), y).backward()
    lm_loss(plain(x), y).backward()
    for (name, p), q in zip(regions.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_buffer_reuse_is_off_for_repeated_regions_unless_the_user_set_it(monkeypatch, caplog):
    import inductor.compilers as compilers

    seen: list = []
    monkeypatch.setattr(compilers, "compile_fx_with", lambda gm, inputs, **kw: seen.append(kw["config_patches"]))
    regions, plain, (x, _) = _region_gpt(2)
    for module in (regions, plain):
        gm, inputs = captured(module, x)
        inductor_compile(gm, inputs, settings=InductorSettings())
    assert seen[0]["allow_buffer_reuse"] is False and "allow_buffer_reuse" not in seen[1]
    gm, inputs = captured(regions, x)
    with caplog.at_level("WARNING", logger="inductor"):
        inductor_compile(gm, inputs, settings=InductorSettings(options={"allow_buffer_reuse": True}))
    assert seen[2]["allow_buffer_reuse"] is True  # the user's own choice stands, with a warning naming it
    assert any("allow_buffer_reuse=True" in r.getMessage() for r in caplog.records if r.name.startswith("inductor"))
