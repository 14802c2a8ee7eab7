"""compile_core.compile's argument checks: bad ddp modes, bucket caps, backends, modes and options, a ddp='torch'
call without a DDP model, and a model that is not an nn.Module are rejected with a clear error before any
compile work."""

from __future__ import annotations

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.ddp_helpers import mlp

pytestmark = pytest.mark.usefixtures("pg")


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"ddp": "fast"}, ValueError, "ddp='fast'"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb=0"),
        ({"bucket_cap_mb": -3}, ValueError, "bucket_cap_mb=-3"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb='25'"),
        ({"first_bucket_cap_mb": 0}, ValueError, "first_bucket_cap_mb=0"),
        ({"bucket_cap_mb": 1, "first_bucket_cap_mb": 2}, ValueError, "first_bucket_cap_mb=2"),
        ({"first_bucket_cap_mb": 30}, ValueError, "first_bucket_cap_mb=30"),  # DDP's cap is 25 MiB
        ({"backend": "inductr"}, ValueError, "backend='inductr'"),
        ({"backend": "aot_eager", "mode": "max-autotune"}, ValueError, "only apply to backend='inductor'"),
        ({"mode": "turbo"}, ValueError, "mode='turbo'"),
        # lite mode's backend left the gradients un-reduced on 2 ranks (a silent wrong average)
        ({"ddp": "in_graph", "mode": "lite"}, ValueError, "mode='lite'.*ddp='in_graph'"),
        (
            {"ddp": "in_graph", "options": {"fallback_by_default": True, "selective_decompose": True}},
            ValueError,
            "ddp='in_graph'.*selective_decompose",
        ),
        ({"options": {"no_such_option": 1}}, ValueError, "no_such_option"),
    ],
)
def test_bad_input_is_rejected_before_compiling(kwargs, exc, match):
    model = DDP(mlp(1))
    with pytest.raises(exc, match=match):
        compile_core.compile(model, **kwargs)
    assert getattr(model.module, "_compiled_call_impl", None) is None


def test_disable_returns_the_model_untouched_after_checking_the_arguments():
    # torch.compile's switch, which scripts pass as disable=not args.compile
    model = DDP(mlp(1))
    assert compile_core.compile(model, backend="aot_eager", disable=True) is model
    assert getattr(model.module, "_compiled_call_impl", None) is None and not hasattr(model, "report")
    with pytest.raises(ValueError, match="ddp='fast'"):
        compile_core.compile(model, ddp="fast", disable=True)
    with pytest.raises(TypeError, match="disable='yes'"):
        compile_core.compile(model, disable="yes")
    compiled = compile_core.compile(model, backend="aot_eager", disable=False)
    assert compiled is model and model.report() is not None


def test_torch_mode_needs_a_ddp_model():
    with pytest.raises(ValueError, match="ddp='torch'.*needs a DDP model"):
        compile_core.compile(mlp(1), ddp="torch")


def test_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        compile_core.compile(lambda x: x)


@pytest.mark.parametrize("wrap", [DDP, None], ids=["ddp", "plain"])
def test_module_compile_after_ours_is_refused_at_the_call_and_ours_keeps_running(wrap):
    """`model.compile()` after `compile_core.compile(model)` would replace our compiled call with torch's (without
    DDP: nothing of ours would run again) or run torch's compile of DDP's call around ours."""
    import torch

    model = compile_core.compile(wrap(mlp(1)) if wrap else mlp(1), backend="aot_eager")
    inner = model.module if wrap else model
    x = torch.randn(2, 256)
    model(x)
    graphs = len(model.report().graphs)
    with pytest.raises(ValueError, match="already compiled by compile_core.compile: remove the .*compile\\(\\) call"):
        model.compile(backend="eager")
    y = torch.randn(3, 256)  # a new batch size: our compiled call compiles again, torch's would not tell us
    torch.testing.assert_close(model(y), inner.forward(y))
    assert len(model.report().graphs) > graphs


def test_module_compile_of_the_module_inside_ddp_after_ours_is_refused_at_the_next_forward_and_undone():
    """`ddp.module.compile()` after ours: DDP's forward would call torch's compile of the module, not ours."""
    import torch

    model = compile_core.compile(DDP(mlp(1)), backend="aot_eager")
    x = torch.randn(2, 256)
    model(x)
    model.module.compile(backend="eager")
    with pytest.raises(ValueError, match="Sequential.*module.compile\\(\\) after compile_core.compile"):
        model(x)
    graphs = len(model.report().graphs)
    y = torch.randn(3, 256)  # a new batch size: our compiled call compiles again, torch's would not tell us
    torch.testing.assert_close(model(y), model.module.forward(y))
    assert len(model.report().graphs) > graphs


def test_a_module_compiled_before_ddp_wrapped_it_says_so_once_and_trains_like_eager(caplog):
    """`DDP(compile_core.compile(model))` (our call in the place of nanoGPT's `torch.compile(model)`): graphs compiled
    whole, DDP's all-reduces wait for the whole backward. Before, the report said "not a DDP model" and nothing
    else."""
    import copy

    import torch

    torch.manual_seed(0)
    module = mlp(2)
    ref = DDP(copy.deepcopy(module))
    model = DDP(compile_core.compile(module, backend="aot_eager"))
    with caplog.at_level("WARNING", logger="compile_core.api"):
        for _ in range(2):
            x = torch.randn(2, 256)
            torch.testing.assert_close(model(x), ref(x))
    notes = [n for n in module.report().notes if "runs inside DistributedDataParallel" in n]
    assert len(notes) == 1 and "compile_core.compile(DDP(model))" in notes[0], module.report().notes
    assert sum("runs inside DistributedDataParallel" in r.getMessage() for r in caplog.records) == 1
