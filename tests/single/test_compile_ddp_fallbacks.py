"""compile_core.compile's fallbacks on real DDP (world size 1, gloo), compared with eager DDP: a failing Inductor
falls back to aot_eager piece by piece and says so in the report, and a graph with nested compile regions
whose compilers all fail falls back to eager and still trains like eager DDP."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.single.ddp_helpers import mlp, run_against_eager, x256

pytestmark = pytest.mark.usefixtures("pg")


def test_inductor_failure_falls_back_and_is_reported():
    compiled, report = run_against_eager(
        mlp, x256, backend="inductor", bucket_cap_mb=0.25, options={"_raise_error_for_testing": True}
    )
    assert len(report["fallbacks"]) == 3
    assert {(f["from"], f["to"]) for f in report["fallbacks"]} == {("inductor", "aot_eager")}
    assert all(f["piece"].startswith("graph_0.piece_") and f["error"] for f in report["fallbacks"])
    assert "fallbacks: 3" in str(compiled.report())


class _RegionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def _regioned() -> nn.Module:
    return nn.Sequential(*(_RegionBlock() for _ in range(3)), nn.Linear(32, 4))


@pytest.mark.parametrize("ddp_mode", ["split", "in_graph"])
def test_a_graph_with_nested_compile_regions_falls_back_to_eager_and_trains_like_eager(ddp_mode, monkeypatch):
    """Both compilers fail: the eager fallback runs the region bodies as plain calls. Run as Dynamo left it,
    the region op's own backward asserts a fake mode (torch 2.13's eager backend fails the same way)."""
    import compile_core.pieces

    def fail(*args, **kwargs):
        raise RuntimeError("aot_eager failed (injected)")

    monkeypatch.setattr(compile_core.pieces, "aot_compile", fail)
    x = lambda s: torch.randn(4, 32, generator=torch.Generator().manual_seed(s))  # noqa: E731
    _, report = run_against_eager(_regioned, x, backend="aot_eager", ddp=ddp_mode, bucket_cap_mb=0.005)
    assert {(f["from"], f["to"]) for f in report["fallbacks"]} == {("aot_eager", "eager")}, report["fallbacks"]
