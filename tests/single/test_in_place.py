"""`compile_core.compile` hands back the object it was given, compiled in place (compile_core/in_place.py).

A script that used `torch.compile(ddp_model)` reads and writes attributes of the returned object, takes
`.module` for checkpoints and its model's own methods, checks `isinstance`, copies the model for an EMA or
an evaluation copy, and pickles it. Each test here is one of those uses (the 2-rank training through such a
script is tests/multi_gpu/test_real_script_multirank.py).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.ddp_helpers import mlp, x256

pytestmark = pytest.mark.usefixtures("pg")


class WithMethods(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def report(self) -> str:  # a user's method that happens to share our name
        return "the user's own report"


def x16(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("mode", ["split", "in_graph", "none", "torch"])
def test_the_ddp_object_comes_back_compiled_in_place(mode):
    ddp = DDP(WithMethods())
    compiled = compile_core.compile(ddp, backend="aot_eager", ddp=mode)
    assert compiled is ddp
    assert isinstance(compiled, DDP) and isinstance(compiled, compile_core.CompiledModel)
    assert type(compiled).__name__ == "DistributedDataParallel" and repr(compiled).startswith(
        "DistributedDataParallel("
    )
    raw = compiled.module
    assert type(raw) is WithMethods and raw.num_params() == 2 * (16 * 16 + 16)
    compiled.require_backward_grad_sync = False  # the write reaches DDP: it is DDP
    assert vars(ddp)["require_backward_grad_sync"] is False
    compiled.require_backward_grad_sync = True
    assert compiled.train(False) is compiled and not raw.training
    compiled.train()
    compiled(x16(0)).sum().backward()
    assert compiled.report().graphs and compiled.compile_state.report().to_dict()["ddp_mode"] == mode
    keys = list(DDP(WithMethods()).state_dict())
    assert list(compiled.state_dict()) == keys and list(raw.state_dict()) == [k[len("module.") :] for k in keys]
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in DDP(WithMethods()).named_parameters()]


def test_no_sync_and_join_are_ddps_own():
    ddp = DDP(mlp(2, 16))
    compiled = compile_core.compile(ddp, backend="aot_eager")
    with compiled.no_sync():
        assert ddp.require_backward_grad_sync is False
        compiled(x16(0)).sum().backward()
    assert ddp.require_backward_grad_sync is True
    with compiled.join():
        compiled(x16(1)).sum().backward()
    assert compiled.report().graphs


def _ours(module: nn.Module) -> list:
    """What of ours a module's hooks and compiled call hold (their classes come from our packages)."""
    found = [getattr(module, "_compiled_call_impl", None)]
    for sub in module.modules():
        found += [*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()]
    return [f for f in found if f is not None and type(f).__module__.split(".")[0] in ("compile_core", "ddp")]


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_a_copy_of_the_model_is_the_eager_model(mode):
    ddp = DDP(WithMethods())
    compiled = compile_core.compile(ddp, backend="aot_eager", bucket_cap_mb=0.001, ddp=mode)
    compiled(x16(0)).sum().backward()
    calls = compiled.compile_state._calls
    # An EMA or evaluation copy of the user's model: its forward is the eager module's, and it never runs
    # our hooks or touches the compiled model's state.
    ema = copy.deepcopy(compiled.module)
    assert type(ema) is WithMethods and getattr(ema, "_compiled_call_impl", None) is None and not _ours(ema)
    torch.testing.assert_close(ema(x16(1)), compiled.module(x16(1)))
    buf = io.BytesIO()
    torch.save(compiled.module, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is WithMethods and getattr(loaded, "_compiled_call_impl", None) is None and not _ours(loaded)
    torch.testing.assert_close(loaded(x16(2)), ema(x16(2)))
    assert compiled.compile_state._calls == calls  # the copies ran none of our hooks
    # The DDP object itself (`torch.save(model, path)` of the object the script got back): a copy is a plain
    # DDP object of the user's class.
    plain = copy.deepcopy(compiled)
    buf = io.BytesIO()
    torch.save(compiled, buf)
    buf.seek(0)
    unpickled = torch.load(buf, weights_only=False)
    for copied in (plain, unpickled):
        assert type(copied) is DDP and not isinstance(copied, compile_core.CompiledModel)
        assert not _ours(copied.module)
        torch.testing.assert_close(copied(x16(3)), compiled(x16(3)))


def test_a_plain_module_keeps_its_own_report_method():
    model = WithMethods()
    compiled = compile_core.compile(model, backend="aot_eager")
    assert compiled is model and type(model).__name__ == "WithMethods"
    compiled(x16(0))
    assert compiled.report() == "the user's own report"
    assert compiled.compile_state.report().graphs


def test_compiling_twice_or_handing_a_compiled_model_to_train_step_is_refused():
    ddp = DDP(mlp(1, 16))
    compile_core.compile(ddp, backend="aot_eager")
    with pytest.raises(ValueError, match="already compiled by compile_core.compile.*train_step"):
        compile_core.compile(ddp, backend="aot_eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="already compiled by compile_core.compile"):
        compile_core.train_step(ddp, opt, nn.functional.mse_loss, backend="aot_eager")


def test_train_step_compiles_the_model_it_is_given_in_place():
    ddp = DDP(mlp(2, 256))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = compile_core.train_step(ddp, opt, lambda out, y: (out - y).pow(2).mean(), backend="aot_eager")
    for i in range(2):
        step(x256(i), x256(i + 10))
    assert step.compiled_model is ddp and isinstance(ddp, compile_core.CompiledModel)
    assert ddp.report().graphs == step.report().model.graphs
