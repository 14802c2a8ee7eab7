"""compile_core.compile on 2 ranks for every DDP option and model shape the reducer swap must survive.

Each scenario trains compiled DDP (aot_eager, split into pieces) and eager DDP from the same weights on
rank-dependent data for 3 SGD-momentum steps, in the same processes, and the test checks:
  * parameters (and buffers, losses) equal eager DDP's on each rank, and are identical across ranks;
  * both ranks compiled the same graphs, pieces and buckets;
  * from step 2 on, the buckets DDP really reduced (recorded by a comm hook doing DDP's default
    all-reduce) are our pieces plus, where expected, one trailing bucket of parameters no graph touched;
  * every parameter DDP should reduce went through exactly one bucket in every backward.
All scenarios run in one 2-rank launch (a module-scoped fixture); each test asserts on one entry.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from tests.multi_gpu.ddp_compare import (
    assert_close_params,
    assert_matches_eager,
    assert_real_buckets_are_pieces,
    assert_reduced_once,
    assert_same_compile_on_every_rank,
    ok,
    planned_buckets,
    run_scenarios,
    train_against_eager,
    update_rel_err,
)
from tests.multi_gpu.models import LAYERS, WIDTH, GraphBreak, WithBatchNorm, WithUnused, batch, mlp
from tests.ranks import run_ranks

# One launch for the whole module (module-scoped fixture); the *_multirank.py name keeps every test of
# it on one xdist worker (see pytest_xdist_make_scheduler in tests/conftest.py).
pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(420)]

CAP_MB = 0.015  # just under one Linear(64, 64) (16,640 bytes): one layer per bucket, one bucket per piece


class EagerMiddle(nn.Module):
    """Two middle layers run eagerly (a disabled frame): no compiled graph owns their parameters.

    They are larger than the compiled layers, as eager regions in real models are of any size.
    """

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mid1, self.mid2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.c, self.d = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    @torch.compiler.disable
    def eager_part(self, x):
        return self.mid2(torch.tanh(self.mid1(x)))

    def forward(self, x):
        x = self.b(torch.tanh(self.a(x)))
        x = self.eager_part(x)
        return self.d(torch.tanh(self.c(x)))


class MixedDtypes(nn.Module):
    """fp32 and bf16 layers alternate: DDP never mixes dtypes in a bucket, nor may our pieces."""

    def __init__(self, bf16: bool = True) -> None:
        super().__init__()
        self.bf16 = bf16
        low = torch.bfloat16 if bf16 else torch.float32
        self.a, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.b, self.d = nn.Linear(WIDTH, WIDTH).to(low), nn.Linear(WIDTH, WIDTH).to(low)
        self.e = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        low = torch.bfloat16 if self.bf16 else torch.float32
        x = self.b(torch.tanh(self.a(x)).to(low)).float()
        x = self.d(torch.tanh(self.c(x)).to(low)).float()
        return self.e(torch.tanh(x))


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        for i in (1, 3):
            self.layers[i].requires_grad_(False)

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


class AutocastMiddle(nn.Module):
    """An autocast (bf16) region spanning three layers, so it crosses several piece boundaries."""

    def __init__(self, autocast: bool = True) -> None:
        super().__init__()
        self.autocast = autocast
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        # autocast for the device x is on: a CPU autocast region leaves CUDA ops in fp32
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for layer in self.layers[1:4]:
                x = torch.tanh(layer(x))
        return self.layers[4](x.float())


def _train(rank: int, make_model, **kwargs) -> dict:
    kwargs.setdefault("backend", "aot_eager")
    kwargs.setdefault("bucket_cap_mb", CAP_MB)
    return train_against_eager(make_model, functools.partial(batch, rank=rank), **kwargs)


SCENARIOS = {
    "plain": lambda rank: _train(rank, mlp),
    "gradient_as_bucket_view": lambda rank: _train(rank, mlp, ddp_kwargs={"gradient_as_bucket_view": True}),
    "find_unused_parameters": lambda rank: _train(rank, WithUnused, ddp_kwargs={"find_unused_parameters": True}),
    "eager_region": lambda rank: _train(rank, EagerMiddle),
    "mixed_dtypes": lambda rank: _train(rank, MixedDtypes, extra_refs={"fp32": lambda: MixedDtypes(bf16=False)}),
    "frozen": lambda rank: _train(rank, Frozen),
    "ignored": lambda rank: _train(rank, mlp, ignore=("2.weight", "2.bias")),
    "graph_break": lambda rank: _train(rank, GraphBreak),
    "ddp_called_directly": lambda rank: _train(rank, mlp, call_ddp_directly=True),
    "autocast_across_pieces": lambda rank: _train(
        rank, AutocastMiddle, extra_refs={"fp32": lambda: AutocastMiddle(autocast=False)}
    ),
    "batchnorm_buffers": lambda rank: _train(rank, WithBatchNorm),
    "static_graph": lambda rank: _train(rank, mlp, ddp_kwargs={"static_graph": True}, steps=4),
    "auto_cap": lambda rank: _train(rank, mlp, bucket_cap_mb="auto"),
    "auto_cap_in_graph": lambda rank: _train(rank, mlp, bucket_cap_mb="auto", ddp="in_graph"),
}


def _all_scenarios(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_scenarios, world_size=2, timeout=400)


def test_plain_mlp_matches_eager_ddp_and_ddp_reduces_our_pieces(results):
    per_rank = ok(results, "plain")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=LAYERS)
    assert_reduced_once(per_rank)
    assert_real_buckets_are_pieces(per_rank)


def test_gradient_as_bucket_view_survives_the_reducer_swap(results):
    per_rank = ok(results, "gradient_as_bucket_view")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=LAYERS)
    assert_reduced_once(per_rank)
    assert_real_buckets_are_pieces(per_rank)
    # The numbers cannot tell whether the option survived the swap; the gradients' storage can: in the
    # last step, the gradients of each bucket DDP reduced are views of one flat buffer.
    for rank, r in enumerate(per_rank):
        buckets = sorted(sorted(names) for _, names in r["reduced"][-1])
        assert r["grad_storage"] == buckets, (
            f"rank {rank}: gradients sharing storage {r['grad_storage']}, buckets {buckets}"
        )
    plain = ok(results, "plain")[0]
    assert all(len(g) == 1 for g in plain["grad_storage"]), "without the option every gradient has its own storage"


def test_find_unused_parameters_reduces_the_unused_ones_in_a_bucket_of_their_own(results):
    per_rank = ok(results, "find_unused_parameters")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank)
    assert_reduced_once(per_rank)  # the unused layer too: DDP marks it ready and reduces zeros
    assert_real_buckets_are_pieces(per_rank, untouched=("unused.weight", "unused.bias"))
    for r in per_rank:
        # the documented place of parameters no graph touches: one trailing bucket
        assert sorted(r["reduced"][1][-1][1]) == ["unused.bias", "unused.weight"]
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(r["params"][name], r["initial"][name]), f"{name} has no gradient: must not move"


EAGER_PARAMS = ("mid1.weight", "mid1.bias", "mid2.weight", "mid2.bias")


def test_parameters_used_outside_any_graph_are_reduced_and_match_eager(results):
    per_rank = ok(results, "eager_region")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank)
    assert [g["pieces"] for g in per_rank[0]["report"]["graphs"]] == [2, 2]  # a, b | c, d
    assert_reduced_once(per_rank)
    for r in per_rank:  # step 2 (the first after the swap): our pieces, then one trailing bucket, as documented
        pieces = [sorted(b) for b in planned_buckets(r["report"])]
        assert [sorted(n) for _, n in r["reduced"][1]] == pieces + [sorted(EAGER_PARAMS)]


def test_buckets_stay_pieces_after_ddps_rebuild_with_an_eager_region(results):
    per_rank = ok(results, "eager_region")
    assert_real_buckets_are_pieces(per_rank, untouched=EAGER_PARAMS)


def test_mixed_dtypes_match_eager_bf16_tightly_and_not_fp32(results):
    per_rank = ok(results, "mixed_dtypes")
    # bf16 layers: eager and compiled run the same bf16 kernels, so the update matches eager's to 1e-4 of
    # its size; the same model in fp32 ends > 1e-3 of the update away (asserted: the check can fail).
    assert_matches_eager(per_rank, rtol=1e-5, atol=1e-6)
    assert_same_compile_on_every_rank(per_rank, min_pieces=5)
    for r in per_rank:
        for name, p in r["params"].items():
            assert p.dtype == (torch.bfloat16 if name[0] in "bd" else torch.float32), name
        assert update_rel_err(r["others"]["fp32"], r["ref"], r["initial"]) > 1e-3, "bf16 made no difference"
    # pieces are cut at every dtype change (DDP never mixes dtypes in a bucket)
    buckets = per_rank[0]["report"]["graphs"][0]["buckets"]
    assert [sorted(b["params"]) for b in buckets] == [sorted([f"{x}.weight", f"{x}.bias"]) for x in "edcba"]
    assert_reduced_once(per_rank)
    for r in per_rank:  # step 2, the first after the swap: DDP reduces exactly our pieces
        assert [sorted(n) for _, n in r["reduced"][1]] == [sorted(b["params"]) for b in buckets]


def test_mixed_dtype_buckets_stay_pieces_after_ddps_rebuild(results):
    assert_real_buckets_are_pieces(ok(results, "mixed_dtypes"))


def test_frozen_parameters_are_neither_bucketed_nor_reduced(results):
    per_rank = ok(results, "frozen")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank)
    assert_reduced_once(per_rank)  # the expected set leaves the frozen layers out
    assert_real_buckets_are_pieces(per_rank)
    for r in per_rank:
        for name in ("layers.1.weight", "layers.1.bias", "layers.3.weight", "layers.3.bias"):
            assert torch.equal(r["params"][name], r["initial"][name])


def test_ignored_parameters_stay_local_and_the_rest_match_eager(results):
    per_rank = ok(results, "ignored")
    # DDP does not reduce ignored parameters: each rank trains them on its own data, as eager DDP does
    assert_matches_eager(per_rank, not_reduced=("2.weight", "2.bias"))
    assert_same_compile_on_every_rank(per_rank)
    assert_reduced_once(per_rank)  # the expected set leaves the ignored layer out
    assert_real_buckets_are_pieces(per_rank)


def test_buckets_follow_pieces_across_a_graph_break(results):
    per_rank = ok(results, "graph_break")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=6)
    assert [g["pieces"] for g in per_rank[0]["report"]["graphs"]] == [3, 3]
    assert len(per_rank[0]["report"]["graph_breaks"]) == 1
    assert_reduced_once(per_rank)
    # the second graph's backward runs first: its buckets come first in DDP's order
    assert_real_buckets_are_pieces(per_rank)
    assert all(n.startswith("second.") for _, names in per_rank[0]["reduced"][-1][:3] for n in names)


def test_calling_the_ddp_object_directly_matches_eager_and_aligns(results):
    per_rank = ok(results, "ddp_called_directly")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=LAYERS)
    assert_reduced_once(per_rank)
    assert_real_buckets_are_pieces(per_rank)


def test_autocast_region_across_pieces_matches_eager_autocast_not_fp32(results):
    per_rank = ok(results, "autocast_across_pieces")
    assert_same_compile_on_every_rank(per_rank, min_pieces=LAYERS)
    # Tight: a piece that lost the autocast context computes in fp32 and ends near the fp32 run, > 1e-3
    # of the update away from eager autocast (asserted below on the eager runs); the tolerance is 1e-4.
    assert_matches_eager(per_rank)
    for r in per_rank:
        assert update_rel_err(r["others"]["fp32"], r["ref"], r["initial"]) > 1e-3, "autocast made no difference"
    assert_reduced_once(per_rank)
    assert_real_buckets_are_pieces(per_rank)


def test_batchnorm_buffers_broadcast_like_eager_ddp(results):
    per_rank = ok(results, "batchnorm_buffers")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank)
    for rank, r in enumerate(per_rank):
        # DDP broadcasts rank 0's buffers before each forward: running stats must follow eager DDP's
        assert_close_params(r["buffers"], r["ref_buffers"], rtol=1e-5, atol=1e-6, what=f"rank {rank} buffers:")
    assert_reduced_once(per_rank)
    assert_real_buckets_are_pieces(per_rank)


def test_static_graph_reduces_our_pieces_and_matches_eager(results):
    """Until session 64 DDP's static reducer was left alone, to rebuild from the compiled backward's order.

    Step 2 is the new static reducer's first backward, over one bucket reduced at its end, as DDP's own first
    backward (step 1) and eager DDP's step 2 are; our pieces are DDP's buckets from step 3, where eager DDP's
    rebuilt ones start too."""
    per_rank = ok(results, "static_graph")
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=LAYERS)
    assert_reduced_once(per_rank)
    assert_real_buckets_are_pieces(per_rank, from_step=2)
    for r in per_rank:
        assert len(r["reduced"][1]) == 1, r["reduced"][1]
    for r in per_rank:
        assert r["report"]["alignment"]["status"] == "aligned", r["report"]["alignment"]


@pytest.mark.parametrize("scenario", ["auto_cap", "auto_cap_in_graph"])
def test_bucket_cap_auto_measures_the_link_and_every_rank_picks_the_same_cap(results, scenario):
    per_rank = ok(results, scenario)
    assert_matches_eager(per_rank)
    assert_same_compile_on_every_rank(per_rank, min_pieces=1)  # a 1 MiB cap: this small model is one bucket
    autos = [r["report"]["bucket_cap_auto"] for r in per_rank]
    assert all(a is not None for a in autos), autos
    # The ranks agree on the slowest rank's timings, so they pick one cap (a differing cap would plan
    # different buckets and, in_graph, pair different collectives).
    assert len({(a["cap_bytes"], a["latency_us"], a["gbytes_per_s"]) for a in autos}) == 1, autos
    auto = autos[0]
    assert auto["latency_us"] >= 0 and auto["gbytes_per_s"] > 0, auto
    grad_bytes = sum(t.numel() * t.element_size() for t in per_rank[0]["initial"].values())
    assert auto["grad_bytes"] == grad_bytes, (auto, grad_bytes)
    # This model's gradients (a few Linear(64, 64)) are far below 4 x 1 MiB: whatever the timings, the cap
    # is the 1 MiB floor (reached from below: "floor", or from a larger latency bound: "buckets").
    assert auto["cap_bytes"] == 1 << 20 and auto["bound"] in ("floor", "buckets"), auto
    if scenario == "auto_cap":  # the splitter planned with the chosen cap
        caps = [g["bucket_caps"]["requested_bytes"] for g in per_rank[0]["report"]["graphs"]]
        assert caps and set(caps) == {auto["cap_bytes"]}, caps
        assert_real_buckets_are_pieces(per_rank)
