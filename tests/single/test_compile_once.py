"""Compile once in one process: structural keys, identical pieces reused, layouts kept between pieces."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from aot.structure import structural_key, structural_lines
from ddp.bucketing import MiB
from ddp.splitter import DDPSplitter, SplitterConfig
from tests.single.ddp_helpers import Blocks, run_against_eager, x64

pytestmark = pytest.mark.usefixtures("pg")


def captured(fn, *inputs):
    seen = []

    def keep(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.optimize(keep)(fn)(*inputs)
    return seen[0]


def test_structural_key_ignores_names_and_sees_shapes_and_code():
    a, b, c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
    ka = structural_key(*captured(lambda x: torch.relu(a(x)), torch.randn(2, 8)))
    torch._dynamo.reset()
    kb = structural_key(*captured(lambda x: torch.relu(b(x)), torch.randn(2, 8)))
    torch._dynamo.reset()
    kc = structural_key(*captured(lambda x: torch.relu(c(x)), torch.randn(2, 8)))
    torch._dynamo.reset()
    kd = structural_key(*captured(lambda x: torch.tanh(a(x)), torch.randn(2, 8)))
    assert ka == kb  # other parameters, other node names: the same compiled code
    assert ka != kc and ka != kd  # another weight shape, another op
    gm, inputs = captured(lambda x: torch.relu(a(x)), torch.randn(2, 8))
    assert structural_key(gm, inputs, extra=("inductor",)) != structural_key(gm, inputs, extra=("aot_eager",))
    assert any("torch.relu" in line or "relu" in line for line in structural_lines(gm, inputs))


def test_identical_blocks_compile_once_and_match_eager_ddp():
    compiled, report = run_against_eager(Blocks, x64, backend="aot_eager", bucket_cap_mb=0.01)
    graph = report["graphs"][0]
    # inp | block 0 cut in two at the cap | ... | block 3 in two | head: every block cut at the same place
    assert graph["pieces"] == 10
    caps = graph["bucket_caps"]
    assert caps["aligned_to"] == ["blocks"] and caps["requested_bytes"] == int(0.01 * MiB)
    assert len(caps["planned_bytes"]) == 10
    rows = {r["name"]: r for r in report["piece_compiles"]}
    reused = sorted((n, r["reused_from"]) for n, r in rows.items() if r["reused_from"])
    assert reused == [(f"graph_0.piece_{i}", f"graph_0.piece_{1 + (i - 1) % 2}") for i in range(3, 9)]
    assert report["compile_once"] == {"pieces": 10, "reused": 6, "cache_hits": 0, "compiled": 4, "waited_s": 0.0}
    assert len(report["pairs"]) == 4  # one AOT compile per distinct piece
    text = str(compiled.report())
    assert "reused from graph_0.piece_1" in text and "at blocks.<i> boundaries" in text


def test_without_reuse_every_piece_compiles_and_cuts_follow_bytes():
    _, report = run_against_eager(Blocks, x64, backend="aot_eager", bucket_cap_mb=0.01, reuse_pieces=False)
    assert report["graphs"][0]["bucket_caps"]["aligned_to"] == []
    assert report["compile_once"]["reused"] == 0
    assert len(report["pairs"]) == report["graphs"][0]["pieces"]


def test_reuse_pieces_must_be_a_bool():
    import compile_core

    with pytest.raises(TypeError, match="reuse_pieces"):
        compile_core.compile(nn.Linear(2, 2), reuse_pieces="yes")


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_piece_whose_compiled_outputs_change_layout_is_copied_back():
    """A compiler may pick other output strides than eager; the next piece gets the eager ones."""
    torch.manual_seed(0)
    model = Chain()
    ref_out = model(torch.ones(8, 16))

    def column_major(gm, example_inputs, name):
        def run(*args):
            return tuple(o.t().contiguous().t() if o.dim() == 2 else o for o in gm(*args))

        return run, True  # as if AOTAutograd had compiled it

    seen_strides = []

    def checking(items):
        out = []
        for gm, inputs, name in items:
            seen_strides.append([tuple(t.stride()) for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 2])
            out.append(column_major(gm, inputs, name))
        return out

    graphs = []
    config = SplitterConfig(
        bucket_cap_bytes=1, first_bucket_cap_bytes=1, param_names={id(p): n for n, p in model.named_parameters()}
    )
    fn = torch._dynamo.optimize(DDPSplitter(config, column_major, graphs.append, compile_pieces=checking))(model)
    out = fn(torch.ones(8, 16))
    torch.testing.assert_close(out, ref_out)
    assert graphs[0].pieces == 2
    assert graphs[0].restrided[0] >= 1  # piece 0's output was copied into the row-major layout
    assert (16, 1) in seen_strides[1]  # piece 1 was compiled for the eager layout


def test_pytorch_ddp_optimizer_pieces_are_never_reused():
    """ddp='torch': DDPOptimizer runs each piece's callable once on fakes; a shared one would break."""

    def make():
        return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())])  # 1 MiB layers

    x = lambda step: torch.randn(4, 512, generator=torch.Generator().manual_seed(step))  # noqa: E731
    _, report = run_against_eager(make, x, backend="aot_eager", ddp="torch", ddp_kwargs={"bucket_cap_mb": 1})
    assert len(report["piece_compiles"]) == 4  # DDPOptimizer cut one piece per layer
    assert all(r["reused_from"] is None for r in report["piece_compiles"])


def test_rank0_shows_one_line_per_piece_and_a_summary(caplog):
    with caplog.at_level("INFO", logger="compile_core"):
        run_against_eager(Blocks, x64, backend="aot_eager", bucket_cap_mb=0.01)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("compile_core")]
    assert any(line.startswith("compile_core: graph_0.piece_1 compiled (no disk cache)") for line in lines), lines
    assert "compile_core: graph_0.piece_3 reused from graph_0.piece_1 (0.00 s)" in lines
    assert any(line.startswith("compile_core: graph_0: 10 pieces, 4 compiled or loaded") for line in lines), lines
    assert any(line.startswith("compile_core: model: call 1 compiled 1 graph(s) in") for line in lines), lines
