"""The pure bucket planner: no process group, graphs captured by Dynamo or built by hand."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ddp.bucketing import MiB, ParamInfo, plan_buckets, resolve_caps
from ddp.splitter import graph_parameters
from tests.single import ddp_helpers


def capture(module: nn.Module, *inputs: torch.Tensor):
    """The first graph Dynamo captures for `module(*inputs)` and its parameter table."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.optimize(keep)(lambda *a: module(*a))(*inputs)
    gm, example_inputs = graphs[0]
    names = {id(p): n for n, p in module.named_parameters()}
    table = {k: info for k, (info, _) in graph_parameters(gm, names, example_inputs).items()}
    return gm, table


def mlp(n: int = 3, width: int = 256) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _i in range(n):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


LAYER = 256 * 256 * 4 + 256 * 4  # bytes of one Linear(256, 256)


def test_mlp_one_bucket_per_layer_in_backward_order():
    gm, table = capture(mlp(), torch.randn(2, 256))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=int(0.25 * MiB))
    assert [b.params for b in plan.buckets] == [
        ("4.weight", "4.bias"),
        ("2.weight", "2.bias"),
        ("0.weight", "0.bias"),
    ]
    assert [b.nbytes for b in plan.buckets] == [LAYER] * 3
    assert plan.num_pieces == 3


def test_model_under_the_cap_is_one_bucket():
    gm, table = capture(mlp(), torch.randn(2, 256))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=25 * MiB)
    assert plan.num_pieces == 1
    assert plan.buckets[0].nbytes == 3 * LAYER


def test_first_bucket_has_its_own_cap():
    gm, table = capture(mlp(4), torch.randn(2, 256))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=int(0.6 * MiB), first_bucket_cap_bytes=int(0.2 * MiB))
    # first bucket closes after one layer, the others after three layers' worth (>= 0.6 MiB)
    assert [len(b.params) for b in plan.buckets] == [2, 6]
    assert plan.buckets[0].params == ("6.weight", "6.bias")


def test_default_first_cap_is_1mib_clamped_to_cap():
    assert resolve_caps(25 * MiB, None) == (25 * MiB, MiB)
    tiny = int(0.1 * MiB)
    assert resolve_caps(tiny, None) == (tiny, tiny)


@pytest.mark.parametrize("cap,first", [(0, None), (-1, None), (MiB, 0), (MiB, 2 * MiB)])
def test_bad_caps_are_rejected(cap, first):
    with pytest.raises(ValueError, match="cap"):
        resolve_caps(cap, first)


def test_tiny_cap_gives_a_bucket_per_parameter_using_node():
    gm, table = capture(mlp(), torch.randn(2, 256))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=int(0.001 * MiB))
    assert plan.num_pieces == 3  # F.linear takes weight and bias in one node: they stay together
    assert sum(b.nbytes for b in plan.buckets) == 3 * LAYER


def test_ignored_parameters_are_never_counted():
    gm, table = capture(mlp(), torch.randn(2, 256))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=25 * MiB, ignore=frozenset({"2.weight", "2.bias"}))
    params = [p for b in plan.buckets for p in b.params]
    assert "2.weight" not in params and "2.bias" not in params
    assert plan.buckets[0].nbytes == 2 * LAYER


def test_buffers_are_never_counted():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    gm, table = capture(model, torch.randn(4, 8))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=25 * MiB)
    params = sorted(p for b in plan.buckets for p in b.params)
    assert params == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert plan.buckets[0].nbytes == (64 + 8 + 8 + 8) * 4


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mid(self.emb(idx))))


def test_parameter_used_twice_is_counted_once_where_its_gradient_completes():
    gm, table = capture(Tied(), torch.randint(0, 64, (2, 5)))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=1)
    flat = [p for b in plan.buckets for p in b.params]
    assert sorted(flat) == ["emb.weight", "mid.bias", "mid.weight"]  # head.weight is emb.weight
    # Its gradient is complete only after the embedding's backward: the last bucket.
    assert plan.buckets[-1].params == ("emb.weight",)
    assert sum(b.nbytes for b in plan.buckets) == (64 * 32 + 32 * 32 + 32) * 4


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_checkpointed_regions_are_kept_whole():
    gm, table = capture(Checkpointed(), torch.randn(2, 64, requires_grad=True))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=1)  # would cut after every node if it could
    assert plan.num_pieces == 3
    for i, bucket in enumerate(reversed(plan.buckets)):
        assert sorted(bucket.params) == sorted(f"blocks.{i}.{n}" for n in ("0.weight", "0.bias", "2.weight", "2.bias"))
    # each checkpoint body (a get_attr) sits in the same piece as the op that calls it
    piece_of = plan.piece_of()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            users = list(node.users)
            assert all(piece_of[u.name] == piece_of[node.name] for u in users)


def test_mirrors_ddp_assignment_for_one_parameter_per_node():
    """Same cut points as DDP's own size-based assignment over the backward-ordered parameters."""
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(7)])
    gm, table = capture(model, torch.randn(2, 128))
    cap, first = 3 * 128 * 128 * 4 - 1, 128 * 128 * 4
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=cap, first_bucket_cap_bytes=first)
    params = list(reversed(list(model.parameters())))  # gradient-ready order
    indices, _ = dist._compute_bucket_assignment_by_size(params, [first, cap], [False] * len(params))
    names = [n for n, _ in reversed(list(model.named_parameters()))]
    expected = [tuple(names[i] for i in bucket) for bucket in indices]
    assert [b.params for b in plan.buckets] == expected


def test_handmade_graph_with_get_attr_parameters():
    """The planner also reads parameters held as get_attr nodes (older Dynamo / fx.symbolic_trace)."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(16, 16))
            self.w2 = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return F.linear(torch.relu(F.linear(x, self.w1)), self.w2)

    gm = torch.fx.symbolic_trace(Functional())
    table = {n.name: ParamInfo(name=n.target, nbytes=1024) for n in gm.graph.nodes if n.op == "get_attr"}
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=1024)
    assert [b.params for b in plan.buckets] == [("w2",), ("w1",)]
    assert str(plan).count("bucket") == 3  # header + one line per bucket


# -- repeated blocks (ddp/bucketing/repeats.py) ---------------------------------------------------------


def Blocks() -> nn.Module:
    """An input layer, four identical blocks, a small head: the shape of a transformer."""
    return ddp_helpers.Blocks(out=8)


BLOCK = (64 * 128 + 128 + 128 * 64 + 64) * 4  # bytes of one block's parameters


def test_repeated_units_come_from_names_and_sizes():
    from ddp.bucketing.repeats import describe_units, repeated_units, unit_of

    assert unit_of("blocks.3.fc.weight") == ("blocks", "blocks.3")
    assert unit_of("layers.2.sub.0.w") == ("layers", "layers.2")  # the outermost index wins
    assert unit_of("0.weight") == ("", "0") and unit_of("head.weight") is None
    infos = [ParamInfo(name=f"blocks.{i}.{s}", nbytes=64, key="f") for i in range(3) for s in ("w", "b")]
    infos += [ParamInfo(name="blocks.3.w", nbytes=128, key="f"), ParamInfo(name="head.w", nbytes=64, key="f")]
    units = repeated_units(infos)
    # blocks.3 has another size: not a repeat of the others; head belongs to no unit
    assert units == {f"blocks.{i}.{s}": f"blocks.{i}" for i in range(3) for s in ("w", "b")}
    assert describe_units(units) == "blocks.<i> (3 units)"


def _by_block(plan) -> dict[str, list[list[str]]]:
    """Block index -> the block parameter suffixes of each of its buckets (asserting one block per bucket)."""
    out: dict[str, list[list[str]]] = {}
    for b in plan.buckets:
        params = [p for p in b.params if p.startswith("blocks.")]
        blocks = {p.split(".")[1] for p in params}
        assert len(blocks) <= 1, f"a bucket spans blocks {sorted(blocks)}: {b.params}"
        if blocks:
            out.setdefault(blocks.pop(), []).append(sorted(p.split(".", 2)[2] for p in params))
    return out


def test_cuts_keep_to_block_boundaries_when_the_model_repeats_one():
    gm, table = capture(Blocks(), torch.randn(2, 64))
    from ddp.bucketing.repeats import repeated_units

    units = repeated_units(table.values())
    assert plan_buckets(gm.graph, table, bucket_cap_bytes=BLOCK // 3).aligned_to == ()
    # a cap under one block: every block is cut inside, at the same places, and no bucket spans two
    small = plan_buckets(gm.graph, table, bucket_cap_bytes=BLOCK // 3, repeats=units)
    assert small.aligned_to == ("blocks",)
    per_block = _by_block(small)
    assert sorted(per_block) == ["0", "1", "2", "3"]
    assert per_block["0"] == per_block["1"] == per_block["2"] == per_block["3"] and len(per_block["0"]) == 2
    assert small.buckets[0].params[:2] == ("head.weight", "head.bias")  # a sliver of a head joins block 3
    # a cap of one block: one block per bucket; of two blocks: two whole blocks per bucket
    one = plan_buckets(gm.graph, table, bucket_cap_bytes=BLOCK, first_bucket_cap_bytes=1, repeats=units)
    assert [b.nbytes for b in one.buckets if all(p.startswith("blocks.") for p in b.params)] == [BLOCK] * 4
    two = plan_buckets(gm.graph, table, bucket_cap_bytes=2 * BLOCK, first_bucket_cap_bytes=1, repeats=units)
    assert [b.nbytes for b in two.buckets if all(p.startswith("blocks.") for p in b.params)] == [2 * BLOCK, 2 * BLOCK]


class SharedAcrossBlocks(nn.Module):
    """Block i first uses block i+1's weight: the blocks' parameters interleave, so they are no units."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = torch.relu(block(F.linear(x, self.blocks[(i + 1) % 3].weight)))
        return x


def test_interleaved_units_fall_back_to_cutting_by_bytes():
    gm, table = capture(SharedAcrossBlocks(), torch.randn(2, 16))
    from ddp.bucketing.repeats import repeated_units

    units = repeated_units(table.values())
    assert len(set(units.values())) == 3  # by their names they would be units...
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=1, repeats=units)
    assert plan.aligned_to == ()  # ...but waiting for one to complete could swallow the graph
    assert plan.num_pieces >= 2
    assert sum(b.nbytes for b in plan.buckets) == 3 * (16 * 16 + 16) * 4


def test_a_final_norm_joins_the_head_so_the_last_block_is_like_the_others():
    from ddp.bucketing.repeats import repeated_units
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=4, max_seq_len=8)
    gm, table = capture(GPT(cfg), torch.randint(0, 256, (2, 8)))
    plan = plan_buckets(gm.graph, table, bucket_cap_bytes=4096, repeats=repeated_units(table.values()))
    assert plan.buckets[0].params == ("head.weight", "ln_f.weight", "ln_f.bias")
    per_block = _by_block(plan)
    assert per_block["0"] == per_block["1"] == per_block["2"]  # block 2's buckets hold nothing but block 2
    # cut inside at the cap (about 4 KiB), never leaving a sliver (ln1) for a bucket of its own
    assert len(per_block["0"]) == 4 and ["ln1.bias", "ln1.weight", "qkv.bias", "qkv.weight"] in per_block["0"]


# -- bucket_cap_mb="auto": the pure choice (ddp/bucketing/auto_cap.py) ------------------------------------
def test_auto_cap_fits_latency_and_bandwidth_through_two_timings():
    from ddp.bucketing.auto_cap import fit_link

    latency, bandwidth = fit_link((1 << 20, 9 << 20), (0.001 + 1 / 1024, 0.001 + 9 / 1024))  # 1 GiB/s, 1 ms
    assert latency == pytest.approx(0.001) and bandwidth == pytest.approx(1 << 30)
    # a larger all-reduce that was not slower: no bandwidth to fit, the latency is the small one's time
    assert fit_link((1 << 20, 9 << 20), (0.002, 0.002)) == (0.002, pytest.approx((9 << 20) / 0.002))
    with pytest.raises(ValueError, match="larger one"):
        fit_link((9 << 20, 1 << 20), (0.001, 0.002))


@pytest.mark.parametrize(
    "latency_s,bytes_per_s,grad_mib,cap_mib,bound",
    [
        (1e-4, 1e9, 256, 1.0, "floor"),  # 9 * 100 us * 1 GB/s = 0.86 MiB: raised to the 1 MiB floor
        (1e-3, 1e9, 256, 9e6 / MiB, "latency"),  # 9 MB keeps the fixed cost at 10 %
        (2e-3, 1e9, 32, 8.0, "buckets"),  # 18 MB would leave 2 buckets: at least 4
        (0.1, 1e9, 4096, 64.0, "ceiling"),
        (1e-3, 1e9, 2, 1.0, "buckets"),  # a tiny model: one 1 MiB bucket per 1 MiB, never below the floor
    ],
)
def test_auto_cap_takes_the_bound_that_decides(latency_s, bytes_per_s, grad_mib, cap_mib, bound):
    from ddp.bucketing.auto_cap import choose_cap

    auto = choose_cap(latency_s=latency_s, bytes_per_s=bytes_per_s, grad_bytes=int(grad_mib * MiB))
    assert auto.cap_bytes == int(cap_mib * MiB) and auto.bound == bound, auto
    assert auto.to_dict()["cap_bytes"] == auto.cap_bytes


def test_auto_cap_is_refused_where_no_bucket_of_ours_exists_and_bad_strings_name_the_choices():
    from compile_core.config import CompileConfig

    assert CompileConfig(bucket_cap_mb="auto", backend="eager").auto_cap
    with pytest.raises(ValueError, match="ddp='torch' plans none"):
        CompileConfig(bucket_cap_mb="auto", ddp="torch", backend="eager")
    with pytest.raises(TypeError, match="'auto'"):
        CompileConfig(bucket_cap_mb="25MB", backend="eager")
    # the user's first-bucket cap is kept, clamped to the measured cap
    cfg = CompileConfig(bucket_cap_mb="auto", first_bucket_cap_mb=4, backend="eager")
    assert cfg.caps(None, auto_cap_bytes=2 * MiB) == (2 * MiB, 2 * MiB)
