"""compile_core.compile on real DDP (world size 1, gloo), compared with eager DDP."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.ddp_helpers import mlp, run_against_eager, x256

pytestmark = pytest.mark.usefixtures("pg")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_mlp_splits_into_three_pieces_and_matches_eager(backend, tmp_path, monkeypatch):
    # A cache of our own: a graph loaded from someone else's cache would not show its sizes.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compiled, report = run_against_eager(mlp, x256, backend=backend, bucket_cap_mb=0.25)
    assert json.loads(json.dumps(report)) == report  # JSON-ready
    table = str(compiled.report())
    assert "3 piece(s)" in table and "4.weight, 4.bias" in table and "0.251 MiB" in table
    assert [g["pieces"] for g in report["graphs"]] == [3]
    assert [b["params"] for b in report["graphs"][0]["buckets"]] == [
        ["4.weight", "4.bias"],
        ["2.weight", "2.bias"],
        ["0.weight", "0.bias"],
    ]
    assert all(b["bytes"] == 256 * 257 * 4 for b in report["graphs"][0]["buckets"])
    # (that DDP really reduces these buckets: test_report_confirms_pieces_against_the_buckets_ddp_really_reduced)
    assert report["fallbacks"] == []
    # every piece got its backward graph from AOTAutograd (none alike: the first takes an input
    # without grad, the last has no ReLU)
    assert len(report["pairs"]) == 3 and all(p["backward_ops"] for p in report["pairs"])


def test_model_under_the_cap_is_one_piece():
    _, report = run_against_eager(mlp, x256, backend="aot_eager")
    assert [g["pieces"] for g in report["graphs"]] == [1]


def test_caps_come_from_the_ddp_object():
    _, report = run_against_eager(mlp, x256, backend="aot_eager", ddp_kwargs={"bucket_cap_mb": 0.25})
    assert [g["pieces"] for g in report["graphs"]] == [3]


def test_ignored_parameters_are_not_bucketed():
    _, report = run_against_eager(mlp, x256, backend="aot_eager", bucket_cap_mb=0.25, ignore=("2.weight", "2.bias"))
    names = [p for b in report["graphs"][0]["buckets"] for p in b["params"]]
    assert sorted(names) == ["0.bias", "0.weight", "4.bias", "4.weight"]


def test_first_bucket_cap():
    make = lambda: mlp(4)  # noqa: E731
    _, report = run_against_eager(make, x256, backend="aot_eager", bucket_cap_mb=1.0, first_bucket_cap_mb=0.1)
    buckets = report["graphs"][0]["buckets"]
    assert buckets[0]["params"] == ["6.weight", "6.bias"]
    assert len(buckets) == 2


def test_tiny_cap():
    _, report = run_against_eager(mlp, x256, backend="aot_eager", bucket_cap_mb=0.001)
    assert [g["pieces"] for g in report["graphs"]] == [3]


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_checkpointed_blocks():
    x = lambda s: torch.randn(4, 64, generator=torch.Generator().manual_seed(s))  # noqa: E731
    _, report = run_against_eager(Checkpointed, x, backend="aot_eager", bucket_cap_mb=0.001)
    assert [g["pieces"] for g in report["graphs"]] == [3]


class SeqModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mix = nn.Linear(32, 32)
        self.out = nn.Linear(32, 50)

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx)))
        h = h - h.mean(dim=1, keepdim=True)  # a reduction over the (symbolic) sequence length
        return self.out(h)


def growing(s: int) -> torch.Tensor:
    return torch.randint(0, 50, (2, [6, 9, 13, 17][s]), generator=torch.Generator().manual_seed(s))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_growing_sequence_length_without_recompiles(backend):
    _, report = run_against_eager(SeqModel, growing, steps=4, backend=backend, bucket_cap_mb=0.001, dynamic=True)
    assert report["recompiles"] == []
    assert report["fallbacks"] == []
    assert [g["pieces"] for g in report["graphs"]] == [3]


def test_a_size_change_without_dynamic_is_a_reported_recompile():
    _, report = run_against_eager(SeqModel, growing, steps=3, backend="aot_eager", bucket_cap_mb=0.001)
    # automatic dynamic shapes: the first new length recompiles once (size guard), later ones do not
    assert len(report["recompiles"]) == 1
    assert "size mismatch" in report["recompiles"][0]["reason"]
    assert [g["pieces"] for g in report["graphs"]] == [3, 3]
    assert report["notes"] == []  # the recompiled graph has the same pieces: still DDP's buckets


def test_batchnorm_buffers_over_two_steps():
    make = lambda: nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256))  # noqa: E731
    _, report = run_against_eager(make, x256, steps=2, backend="aot_eager", bucket_cap_mb=0.1)
    assert report["graphs"][0]["pieces"] == 2


def test_sequential_at_the_top_really_compiles():
    _, report = run_against_eager(mlp, x256, backend="aot_eager", bucket_cap_mb=0.25)
    assert len(report["graphs"]) == 1 and len(report["pairs"]) == 3


def test_fullgraph_with_a_ddp_model():
    _, report = run_against_eager(mlp, x256, backend="aot_eager", fullgraph=True, bucket_cap_mb=0.25)
    assert report["graph_breaks"] == []


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent branch: Dynamo must break the graph here
            h = h * 2
        return self.b(h)


def test_data_dependent_graph_break_is_reported_with_reason_and_place():
    x = lambda s: torch.randn(4, 16, generator=torch.Generator().manual_seed(s))  # noqa: E731
    _, report = run_against_eager(DataDependent, x, backend="aot_eager", bucket_cap_mb=0.001, observe=True)
    assert len(report["graph_breaks"]) >= 1
    brk = report["graph_breaks"][0]
    assert "test_compile_ddp.py:" in brk["where"]
    assert brk["reason"]
    # both sides of the break are compiled; the buckets DDP really reduced are the pieces of both graphs
    assert len(report["graphs"]) >= 2
    observed = report["observed_alignment"]
    assert observed["ok"], observed["text"]
    assert sorted(p for b in observed["buckets"] for p in b["params"]) == ["a.bias", "a.weight", "b.bias", "b.weight"]


def test_fullgraph_turns_the_graph_break_into_an_error():
    model = DDP(DataDependent())
    compiled = compile_core.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="(?i)data.dependent|graph break|Unsupported"):
        compiled(torch.randn(4, 16))


def test_state_dict_has_the_models_keys_and_eager_ddps_trained_values():
    compiled, _, ref = run_against_eager(mlp, x256, steps=2, backend="aot_eager", bucket_cap_mb=0.25, with_ref=True)
    ours, theirs = compiled.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs) and all("_orig_mod" not in k for k in ours)
    for key in theirs:  # after 2 training steps: the values eager DDP reached, not just the keys
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)
    # a state dict loaded through the compiled model is what the compiled graphs then compute with
    torch.manual_seed(1)
    other = DDP(mlp())
    compiled.load_state_dict(other.state_dict())
    x = x256(7)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), other(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,pieces", [("none", 1), ("split", 3)])
def test_ddp_modes(mode, pieces):
    _, report = run_against_eager(mlp, x256, backend="aot_eager", bucket_cap_mb=0.25, ddp=mode)
    assert sum(g["pieces"] for g in report["graphs"]) == pieces


def test_in_graph_refuses_sparse_gradients_by_name():
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 4, sparse=True)
            self.head = nn.Linear(4, 2)

        def forward(self, idx):
            return self.head(self.emb(idx))

    with pytest.raises(ValueError, match=r"\['emb.weight'\] get sparse gradients.*use ddp='split'"):
        compile_core.compile(DDP(Bag()), backend="aot_eager", ddp="in_graph")
    bag = Bag()
    compiled = compile_core.compile(DDP(bag), backend="aot_eager", ddp="split")
    compiled(torch.tensor([[1, 2, 3]])).sum().backward()  # DDP's reducer all-reduces the sparse gradient
    assert bag.emb.weight.grad.is_sparse


def test_torch_mode_uses_pytorchs_ddp_optimizer():
    # PyTorch's DDPOptimizer asserts on caps under its 1 MiB first bucket, so this uses 1 MiB layers.
    make = lambda: mlp(3, 512)  # noqa: E731
    x = lambda s: torch.randn(4, 512, generator=torch.Generator().manual_seed(s))  # noqa: E731
    _, report = run_against_eager(make, x, backend="aot_eager", ddp_kwargs={"bucket_cap_mb": 1}, ddp="torch")
    # DDPOptimizer calls the backend once per piece it cut
    assert len(report["graphs"]) >= 2


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


class AutocastMiddle(nn.Module):
    def __init__(self, autocast: bool = True) -> None:
        super().__init__()
        self.autocast = autocast
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        x = self.layers[0](x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            x = self.layers[1](x)
            x = self.layers[2](x)
        return self.layers[3](x.float())


def test_autocast_region_across_piece_boundaries():
    x = lambda s: torch.randn(4, 64, generator=torch.Generator().manual_seed(s))  # noqa: E731
    # Tight (outputs and gradients at every step): a piece that lost its autocast context computes in
    # fp32, and fp32 is far outside this tolerance (checked below on the eager model).
    _, report = run_against_eager(AutocastMiddle, x, backend="aot_eager", bucket_cap_mb=0.001, rtol=1e-5, atol=1e-6)
    assert report["graphs"][0]["pieces"] == 4
    torch.manual_seed(0)
    bf16 = AutocastMiddle()
    fp32 = AutocastMiddle(autocast=False)
    fp32.load_state_dict(bf16.state_dict())
    assert not torch.allclose(bf16(x(0)), fp32(x(0)), rtol=1e-3, atol=1e-4), "autocast made no difference"


class NoGradMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        x = self.layers[0](x)
        with torch.no_grad():
            self.calls.add_(1)  # an in-place-only stretch of graph
        x = self.layers[1](x)
        return self.layers[2](x)


def test_no_grad_and_in_place_only_region():
    x = lambda s: torch.randn(4, 32, generator=torch.Generator().manual_seed(s))  # noqa: E731
    compiled, report = run_against_eager(NoGradMiddle, x, backend="aot_eager", bucket_cap_mb=0.001)
    assert report["graphs"][0]["pieces"] == 3
    assert compiled.module.calls.item() == 2


# ---- bad input: a clear error before any compile work -----------------------------------------


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
        ({"options": {"no_such_option": 1}}, ValueError, "no_such_option"),
    ],
)
def test_bad_input_is_rejected_before_compiling(kwargs, exc, match):
    model = DDP(mlp(1))
    with pytest.raises(exc, match=match):
        compile_core.compile(model, **kwargs)
    assert getattr(model.module, "_compiled_call_impl", None) is None


def test_torch_mode_needs_a_ddp_model():
    with pytest.raises(ValueError, match="ddp='torch'.*needs a DDP model"):
        compile_core.compile(mlp(1), ddp="torch")


def test_calling_the_ddp_object_directly_still_aligns():
    from ddp.overlap import OverlapRecorder

    model = DDP(mlp())
    OverlapRecorder.attach(model)
    compiled = compile_core.compile(model, backend="aot_eager", bucket_cap_mb=0.25)
    for step in range(2):
        model(x256(step)).sum().backward()  # the user keeps calling the DDP object
    report = compiled.report()
    # the buckets DDP reduced in step 2 are our 3 pieces (numbers on 2 ranks: test_ddp_options_multirank)
    assert report.observed_alignment["ok"], report.observed_alignment["text"]
    assert len(report.observed_alignment["buckets"]) == 3
    assert [g.step for g in report.graphs] == [1]


def test_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        compile_core.compile(lambda x: x)


@pytest.mark.parametrize(
    "ddp_kwargs",
    [{"gradient_as_bucket_view": True}, {"find_unused_parameters": True}],
    ids=["gradient_as_bucket_view", "find_unused_parameters"],
)
def test_reducer_options_survive_alignment(ddp_kwargs):
    _, report = run_against_eager(
        mlp, x256, steps=3, backend="aot_eager", bucket_cap_mb=0.25, ddp_kwargs=ddp_kwargs, observe=True
    )
    assert report["observed_alignment"]["ok"], report["observed_alignment"]["text"]
    assert len(report["observed_alignment"]["buckets"]) == 3


def test_static_graph_keeps_ddps_buckets_and_says_why():
    _, report = run_against_eager(
        mlp, x256, steps=3, backend="aot_eager", bucket_cap_mb=0.25, ddp_kwargs={"static_graph": True}
    )
    assert report["alignment"]["status"] == "skipped"
    assert "static_graph" in report["alignment"]["detail"]


def test_each_recompile_is_counted_once():
    """Two cached entries failing before one new compile make one recompile, not two."""
    shapes = [(2, 8), (2, 9), (3, 10)]  # static; dynamic length; a new batch size fails both entries
    x = lambda s: torch.randint(0, 50, shapes[s], generator=torch.Generator().manual_seed(s))  # noqa: E731
    compiled, report = run_against_eager(SeqModel, x, steps=3, backend="aot_eager")
    assert len(report["graphs"]) == 3
    assert len(report["recompiles"]) == 2, report["recompiles"]


def train_with_recorder(ddp_kwargs, steps=3, **compile_kwargs):
    from ddp.overlap import OverlapRecorder

    torch.manual_seed(0)
    model = DDP(mlp(), **ddp_kwargs)
    OverlapRecorder.attach(model)
    compiled = compile_core.compile(model, backend="aot_eager", **compile_kwargs)
    for step in range(steps):
        compiled(x256(step)).square().mean().backward()
    return compiled.report()


def test_report_confirms_pieces_against_the_buckets_ddp_really_reduced():
    report = train_with_recorder({}, bucket_cap_mb=0.25)
    observed = report.to_dict()["observed_alignment"]
    assert observed["ok"] and len(observed["buckets"]) == 3
    assert "3/3 observed bucket boundaries" in str(report) and "WARNING" not in str(report)


def test_report_warns_when_ddp_buckets_cut_through_a_piece():
    # static_graph keeps DDP's own rebuilt buckets (0.3 MiB), which end inside our 0.25 MiB pieces
    report = train_with_recorder({"static_graph": True, "bucket_cap_mb": 0.3}, bucket_cap_mb=0.25)
    observed = report.to_dict()["observed_alignment"]
    assert not observed["ok"]
    assert observed["mismatched_params"]
    assert "WARNING: bucket" in str(report)
