"""compile_core.compile on real DDP (world size 1, gloo), compared with eager DDP: how a model is split into
pieces along DDP's bucket caps (from the arguments or the DDP object, ignored parameters, first bucket),
checkpointed blocks, growing sequence lengths with and without dynamic shapes and how recompiles are counted,
graph breaks (reported with their place, an error under fullgraph), the state dict, and autocast or no_grad
stretches that cross piece boundaries. The graph-break test expects this file's name in the report."""

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


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, scale: int = 1):
        return self.b(torch.tanh(self.a(x))) * scale


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_a_recompile_is_reported_at_the_users_forward_in_its_parameter_names(mode):
    """Dynamo guards the locals of our entry frame (`compiled_entry(*args, **kwargs)`); until session 65 every
    recompile was placed at compile_core/api.py, spoke of `args[0]` and `kwargs['scale']`, and carried torch's
    stack through our entry. `torch.compile(model)` names the user's `forward` and its parameters."""
    model = compile_core.compile(DDP(Scaled()), backend="aot_eager", ddp=mode, dynamic=False)
    model(torch.randn(5, 8)).sum().backward()
    model(torch.randn(7, 8)).sum().backward()  # a size guard on x
    model(torch.randn(7, 8), scale=2).sum().backward()  # keyword arguments where there were none
    model(torch.randn(7, 8), scale=3).sum().backward()  # a guard on the value of scale
    recompiles = model.report().recompiles
    assert len(recompiles) == 3, recompiles
    forward = Scaled.forward.__code__
    assert {r["where"] for r in recompiles} == {f"{forward.co_filename}:{forward.co_firstlineno} Scaled.forward"}
    size, kwargs, value = (r["reason"] for r in recompiles)
    assert "tensor 'x' size mismatch" in size, size
    assert "no keyword arguments" in kwargs, kwargs
    assert "scale == 2" in value and f"used at {__file__}:" in value, value
    for r in recompiles:
        assert "args" not in r["reason"] and "compile_core" not in r["reason"] and "\n" not in r["reason"], r
    assert "Scaled.forward: " in str(model.report())


def test_each_recompile_is_counted_once():
    """Two cached entries failing before one new compile make one recompile, not two."""
    shapes = [(2, 8), (2, 9), (3, 10)]  # static; dynamic length; a new batch size fails both entries
    x = lambda s: torch.randint(0, 50, shapes[s], generator=torch.Generator().manual_seed(s))  # noqa: E731
    compiled, report = run_against_eager(SeqModel, x, steps=3, backend="aot_eager")
    assert len(report["graphs"]) == 3
    assert len(report["recompiles"]) == 2, report["recompiles"]


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


def test_every_model_a_process_compiles_is_compiled_past_dynamos_recompile_limit():
    """Every compiled model enters through one function of ours; Dynamo keeps its cache on the function's code
    object and runs a code object uncompiled once it holds its recompile limit (8) of entries. Until session 63
    the 9th model compiled in a process (a sweep, a notebook, an evaluation harness) compiled no graph at all."""
    for i in range(10):
        model = compile_core.compile(DDP(mlp(2, 32)), backend="aot_eager")
        loss = model(torch.randn(4, 32)).sum()
        loss.backward()
        report = model.report().to_dict()
        assert len(report["graphs"]) == 1 and not report["graph_breaks"], f"model {i + 1}: {report['graphs']}"


@pytest.mark.parametrize("how", ["split", "in_graph", "train_step", "train_step_in_backward"])
def test_a_compiled_model_the_script_drops_is_freed(how):
    """A sweep or a notebook compiles model after model: each must go, with its parameters, gradients and DDP
    buckets, once the script drops it, as with plain torch.compile. Until session 63 Dynamo's process-wide tables
    (its backends, its compiled graphs, the hooks of its guards) reached every model we compiled, for good."""
    import gc
    import weakref

    def train_one() -> weakref.ref:
        inner = mlp(2, 32)
        ddp = DDP(inner)
        x, y = torch.randn(4, 32), torch.randn(4, 32)
        if how.startswith("train_step"):
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
            in_backward = how.endswith("in_backward")
            step = compile_core.train_step(
                ddp,
                opt,
                torch.nn.functional.mse_loss,
                backend="aot_eager",
                ddp="in_graph" if in_backward else None,
                optimizer_in_backward=in_backward,
            )
            for _ in range(3):
                step(x, y)
        else:
            model = compile_core.compile(ddp, backend="aot_eager", ddp=how)
            for _ in range(2):
                torch.nn.functional.mse_loss(model(x), y).backward()
        return weakref.ref(inner)

    gone = train_one()
    gc.collect()
    assert gone() is None, "the compiled model outlived the script's last reference to it"
