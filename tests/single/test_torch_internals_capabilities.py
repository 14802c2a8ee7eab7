"""Canaries of every home's capabilities() on a supported torch (no mode refused at compile time), and of
Dynamo's requires_grad guards (what a canary is: tests/single/torch_internals_helpers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from aot import torch_dynamo
from ddp import torch_ddp
from inductor import torch_inductor
from tests.single.torch_internals_helpers import canary

pytestmark = pytest.mark.usefixtures("pg")


# -- capabilities and the torch versions (compile-time refusals, python -m compile_core.doctor) -------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_every_home_finds_every_feature_on_a_supported_torch():
    """Covers torch 2.11.0, 2.13.0, 2.14.1: every feature the homes check for is there (some through our
    stand-ins on 2.11, which their text names), so no mode is refused at compile time."""
    from compile_core.config import BACKENDS, DDP_MODES

    for home, table in (
        ("ddp/torch_ddp.py", torch_ddp.capabilities()),
        ("aot/torch_dynamo.py", torch_dynamo.capabilities()),
        ("inductor/torch_inductor.py", torch_inductor.capabilities()),
    ):
        with canary(f"{home}:capabilities"):
            missing = {name: how for name, (ok, how) in table.items() if not ok}
            assert table and not missing, missing
            for mode in DDP_MODES:
                for backend in BACKENDS:
                    module = {"ddp": torch_ddp, "aot": torch_dynamo, "inductor": torch_inductor}[home.split("/")[0]]
                    assert module.blocker(mode, backend=backend, nested_regions=mode == "in_graph") is None


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11: Dynamo misses the unfreezing, we guard).
def test_a_parameter_unfrozen_after_the_first_compile_gets_its_gradient():
    """Covers torch 2.11.0 (Dynamo's guards miss the unfreezing: `compile_with_guard_hook` guards every
    parameter itself), 2.13.0 and 2.14.1 (Dynamo compiles again by itself)."""
    with canary("aot/torch_dynamo.py:guards_follow_requires_grad/compile_with_guard_hook"):
        guarded = torch_dynamo.guards_follow_requires_grad()
        assert guarded in (True, False)

        def frozen_first() -> nn.Sequential:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
            model[0].requires_grad_(False)
            return model

        def unfrozen_grad(compile_fn) -> bool:
            model = frozen_first()
            run = compile_fn(model)
            x = torch.randn(3, 4)
            run(x).sum().backward()
            model[0].requires_grad_(True)
            run(x).sum().backward()
            return model[0].weight.grad is not None

        torch._dynamo.reset()
        ours = lambda m: torch_dynamo.compile_with_guard_hook(m, "aot_eager", on_guard_fail=lambda r, w: None)  # noqa: E731
        assert unfrozen_grad(ours), "the unfrozen layer got no gradient through compile_with_guard_hook"
        torch._dynamo.reset()
        # what torch does alone: on 2.11 the graph traced with the layer frozen keeps running
        assert unfrozen_grad(lambda m: torch.compile(m, backend="aot_eager")) is guarded
