"""`ddp="in_graph"` on 2 ranks: the compiled backward all-reduces its own buckets; DDP's reducer idles.

Every scenario trains compiled DDP in `in_graph` mode and eager DDP from the same weights on
rank-dependent data (3 SGD-momentum steps unless said otherwise), in the same processes, and checks:
  * parameters, buffers and losses equal eager DDP's (rtol 1e-5; the training update within 1e-4 of
    eager's) and are identical on both ranks, though each rank saw other data;
  * DDP's reducer all-reduced nothing (torch.profiler saw none of its bucket events): every
    reduction happened inside the compiled backward;
  * each graph is one piece, its in-graph buckets hold every reduced parameter exactly once, and both
    ranks compiled the same graphs and buckets.
All scenarios run in one 2-rank launch (module-scoped fixture); each test asserts on one entry.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from ddp.torch_ddp import reducer_bucket_elements
from examples.gpt import GPT, GPTConfig
from tests.multi_gpu.ddp_compare import (
    CollectiveLog,
    assert_matches_eager,
    ok,
    run_scenarios,
    selected_scenarios,
    snapshot,
    train_against_eager,
)
from tests.multi_gpu.models import WIDTH, GraphBreak, WithBatchNorm, WithUnused, batch, mlp
from tests.ranks import run_ranks, to_rank_device, wrap_ddp

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(420)]

CAP_MB = 0.015  # just under one Linear(64, 64): one layer per bucket


GPT_CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)


def tokens(step: int, rank: int, lengths: tuple[int, ...] = (12,)) -> tuple[torch.Tensor]:
    t = lengths[step % len(lengths)]
    return (torch.randint(0, 64, (2, t), generator=torch.Generator().manual_seed(1000 * rank + step)),)


class Tied(nn.Module):
    """Embedding and output head share one weight (one graph input, reduced once)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)) for _ in range(3)
        )

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def _train(rank: int, make_model, make_input=None, **kwargs) -> dict:
    kwargs.setdefault("backend", "aot_eager")
    kwargs.setdefault("bucket_cap_mb", CAP_MB)
    return train_against_eager(make_model, make_input or functools.partial(batch, rank=rank), ddp="in_graph", **kwargs)


def _halve_grads_in_place(module: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in module.parameters():
        p.grad.mul_(0.5)


def _halve_grads_anew(module: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in module.parameters():
        p.grad = p.grad * 0.5


def _drop_grads(module: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)


def _accumulate(
    rank: int, accum: int = 2, updates: int = 3, *, sync_flag: bool = False, after_sync_forward=None
) -> dict:
    """no_sync micro-batches: the first accum-1 reduce nothing; the last reduces accumulated + its own.
    `sync_flag`: nanoGPT's loop (`ddp.require_backward_grad_sync = last` instead of `no_sync()`);
    `after_sync_forward(module, opt)`: what the loop does to `.grad` between the synchronising forward and
    its backward."""
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(mlp())
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    ours, theirs = wrap_ddp(model), wrap_ddp(ref)
    log = CollectiveLog()
    compiled = compile_core.compile(ours, backend="aot_eager", ddp="in_graph", bucket_cap_mb=CAP_MB)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    losses: dict[str, list[float]] = {"ours": [], "ref": []}
    for step in range(accum * updates):
        x = to_rank_device(batch(step, rank))
        last = (step + 1) % accum == 0
        for key, run, ddp, opt in (("ours", compiled, ours, opts[0]), ("ref", theirs, theirs, opts[1])):
            watch = log.step() if key == "ours" else contextlib.nullcontext()
            if sync_flag:
                ddp.require_backward_grad_sync = last
            with watch, ddp.no_sync() if not (last or sync_flag) else contextlib.nullcontext():
                loss = run(*x).square().mean()
                if last and after_sync_forward is not None:
                    after_sync_forward(ddp.module, opt)
                (loss / accum).backward()
            losses[key].append(loss.item())
            if last:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return {
        "params": snapshot(model),
        "ref": snapshot(ref),
        "initial": initial,
        "losses": losses["ours"],
        "ref_losses": losses["ref"],
        "reduced": log.steps,
        "report": compiled.report().to_dict(),
        "expected_reduced": sorted(n for n, _ in model.named_parameters()),
        "ddp_bucket_elements": reducer_bucket_elements(ours),
    }


def _autograd_grad_after_accumulation(rank: int) -> dict:
    """A no_sync micro-batch, then `torch.autograd.grad` through a synchronising forward: autograd.grad fills no
    `.grad`, so the accumulation the graph was lent stays the rank's own `.grad`, as in eager DDP."""
    import compile_core

    torch.manual_seed(0)
    ddp = wrap_ddp(to_rank_device(mlp()))
    model = compile_core.compile(ddp, backend="aot_eager", ddp="in_graph", bucket_cap_mb=CAP_MB)
    with ddp.no_sync():
        model(*to_rank_device(batch(0, rank))).square().mean().backward()
    held = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    loss = model(*to_rank_device(batch(1, rank))).square().mean()
    torch.autograd.grad(loss, list(ddp.module.parameters()))
    return {"held": held, "grads": {n: p.grad for n, p in ddp.module.named_parameters()}}


SCENARIOS = {
    "mlp": lambda rank: _train(rank, mlp),
    "gpt": lambda rank: _train(rank, lambda: GPT(GPT_CFG), functools.partial(tokens, rank=rank), bucket_cap_mb=0.01),
    "tied_weights": lambda rank: _train(rank, Tied, functools.partial(tokens, rank=rank)),
    "checkpointing": lambda rank: _train(rank, Checkpointed),
    "batchnorm_buffers": lambda rank: _train(rank, WithBatchNorm),
    "unused_parameters": lambda rank: _train(rank, WithUnused, ddp_kwargs={"find_unused_parameters": True}),
    "ignored_parameters": lambda rank: _train(rank, mlp, ignore=("2.weight", "2.bias")),
    "growing_sequence_dynamic": lambda rank: _train(
        rank,
        lambda: GPT(GPT_CFG),
        functools.partial(tokens, rank=rank, lengths=(6, 9, 13, 16)),
        steps=4,
        bucket_cap_mb=0.01,
        dynamic=True,
    ),
    "fullgraph": lambda rank: _train(rank, mlp, fullgraph=True),
    "graph_break": lambda rank: _train(rank, GraphBreak),
    "ddp_called_directly": lambda rank: _train(rank, mlp, call_ddp_directly=True),
    "no_sync_accumulation": lambda rank: _accumulate(rank),
    "sync_flag_accumulation": lambda rank: _accumulate(rank, accum=3, sync_flag=True),
    "accumulation_halved_in_place": lambda rank: _accumulate(rank, after_sync_forward=_halve_grads_in_place),
    "accumulation_halved_anew": lambda rank: _accumulate(rank, after_sync_forward=_halve_grads_anew),
    "accumulation_dropped": lambda rank: _accumulate(rank, after_sync_forward=_drop_grads),
    "autograd_grad_after_accumulation": _autograd_grad_after_accumulation,
}


def _all_scenarios(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    return run_scenarios(SCENARIOS, rank, names)


@pytest.fixture(scope="module")
def results(request):
    return run_ranks(_all_scenarios, selected_scenarios(request, SCENARIOS), world_size=2, timeout=400)


def _assert_reduced_in_graph(per_rank: list[dict], *, graphs: int = 1, not_reduced: tuple[str, ...] = ()) -> None:
    """DDP's reducer idled; the in-graph buckets cover each reduced parameter once; ranks agree."""
    for rank, r in enumerate(per_rank):
        assert all(step["ddp_reducer"] == 0 for step in r["reduced"]), f"rank {rank}: DDP's reducer ran: {r['reduced']}"
        report = r["report"]
        assert report["in_graph"]["reducer"] == "compiled backward", report["in_graph"]
        # DDP's reducer reduces nothing here: its gradient buckets (a full copy of the gradients) are gone
        assert r["ddp_bucket_elements"] == 1, f"rank {rank}: DDP still holds {r['ddp_bucket_elements']} elements"
        assert report["in_graph"]["ddp_buckets_released_bytes"] > 0, report["in_graph"]
        assert report["alignment"]["status"] == "not applicable"
        sync_graphs = [g for g in report["graphs"] if g.get("variant", "").startswith("reduce")]
        assert len({g["name"] for g in sync_graphs}) >= graphs
        assert all(g["pieces"] == 1 for g in report["graphs"])
        for variant in {g["variant"] for g in sync_graphs}:
            names = [n for g in sync_graphs if g["variant"] == variant for b in g["buckets"] for n in b["params"]]
            twice = [n for n, c in collections.Counter(names).items() if c > 1]
            assert not twice, f"rank {rank} {variant}: reduced twice in graph: {twice}"
            want = sorted(set(r["expected_reduced"]) - set(not_reduced))
            assert sorted(names) == want, f"rank {rank} {variant}: buckets hold {sorted(names)}, want {want}"
            assert all("after" in b for g in sync_graphs for b in g["buckets"])
    reports = [
        [(g["name"], g.get("variant"), [b["params"] for b in g["buckets"]]) for g in r["report"]["graphs"]]
        for r in per_rank
    ]
    assert reports[0] == reports[1], f"ranks compiled different graphs: {reports}"


@pytest.mark.compat
@pytest.mark.scenarios("mlp")
def test_mlp_is_reduced_in_the_backward_and_matches_eager_ddp(results):
    per_rank = ok(results, "mlp")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)
    buckets = per_rank[0]["report"]["graphs"][0]["buckets"]
    assert len(buckets) >= 4, f"cap {CAP_MB} MB should give one bucket per layer: {buckets}"
    for r in per_rank:  # one all-reduce per in-graph bucket per step, nothing else
        assert [s["all_reduces"] for s in r["reduced"]] == [len(buckets)] * len(r["reduced"]), r["reduced"]


def test_gpt_matches_eager_ddp(results):
    per_rank = ok(results, "gpt")
    assert_matches_eager(per_rank, update_rtol=1e-3)  # the key bias's ~0 gradient: see test_train_step_pieces
    _assert_reduced_in_graph(per_rank)


def test_tied_weights_are_one_input_reduced_once(results):
    per_rank = ok(results, "tied_weights")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)
    names = [n for b in per_rank[0]["report"]["graphs"][0]["buckets"] for n in b["params"]]
    assert "emb.weight" in names and "head.weight" not in names


def test_activation_checkpointing(results):
    per_rank = ok(results, "checkpointing")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)


def test_batchnorm_buffers_follow_ddps_broadcast(results):
    per_rank = ok(results, "batchnorm_buffers")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)
    for rank, r in enumerate(per_rank):
        for name, buf in r["buffers"].items():
            torch.testing.assert_close(
                buf, r["ref_buffers"][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} buffer {name}: {m}"
            )


def test_unused_parameters_keep_no_gradient_as_in_ddp(results):
    per_rank = ok(results, "unused_parameters")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank, not_reduced=("unused.weight", "unused.bias"))


def test_ignored_parameters_are_never_reduced(results):
    per_rank = ok(results, "ignored_parameters")
    assert_matches_eager(per_rank, not_reduced=("2.weight", "2.bias"))
    _assert_reduced_in_graph(per_rank, not_reduced=("2.weight", "2.bias"))


def test_growing_sequence_length_with_dynamic_shapes(results):
    per_rank = ok(results, "growing_sequence_dynamic")
    assert_matches_eager(per_rank, update_rtol=1e-3)
    _assert_reduced_in_graph(per_rank)
    assert per_rank[0]["report"]["recompiles"] == []


def test_fullgraph_gives_one_graph(results):
    per_rank = ok(results, "fullgraph")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)
    assert len(per_rank[0]["report"]["graphs"]) == 1 and per_rank[0]["report"]["graph_breaks"] == []


def test_each_graph_of_a_graph_break_buckets_its_own_gradients(results):
    per_rank = ok(results, "graph_break")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank, graphs=2)
    graphs = per_rank[0]["report"]["graphs"]
    owned = [sorted({n.split(".")[0] for b in g["buckets"] for n in b["params"]}) for g in graphs]
    assert owned == [["first"], ["second"]], owned


def test_calling_the_ddp_object_directly(results):
    per_rank = ok(results, "ddp_called_directly")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)


def _assert_accumulation_reduced_once(per_rank: list[dict], accum: int) -> None:
    """The synchronising micro-batch's graph reduced `accumulated + its own` in its buckets: one all-reduce per
    bucket per update, as DDP's reducer, and nothing reduced again after the backward."""
    report = per_rank[0]["report"]
    assert sorted(g["variant"] for g in report["graphs"]) == ["local", "reduce_acc"], report["graphs"]
    assert report["recompiles"] == []
    (synced,) = [g for g in report["graphs"] if g["variant"] == "reduce_acc"]
    buckets = len(synced["buckets"])
    for rank, r in enumerate(per_rank):
        assert r["report"]["in_graph"]["leftovers_last_step"] == [], (rank, r["report"]["in_graph"])
        expected = [buckets if (i + 1) % accum == 0 else 0 for i in range(len(r["reduced"]))]
        assert [s["all_reduces"] for s in r["reduced"]] == expected, (rank, r["reduced"])


def test_no_sync_accumulation_reduces_once_per_update_without_recompiling(results):
    per_rank = ok(results, "no_sync_accumulation")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)
    _assert_accumulation_reduced_once(per_rank, accum=2)


def test_nanogpt_sync_flag_accumulation_reduces_once_per_update(results):
    """nanoGPT sets `require_backward_grad_sync` on the DDP object instead of entering no_sync()."""
    per_rank = ok(results, "sync_flag_accumulation")
    assert_matches_eager(per_rank)
    _assert_reduced_in_graph(per_rank)
    _assert_accumulation_reduced_once(per_rank, accum=3)


@pytest.mark.parametrize(
    "scenario, reduced_after",
    [
        # compat: the graph reads a saved input written in place since the forward (aot/torch_eager.py:set_version)
        pytest.param(
            "accumulation_halved_in_place",
            False,
            marks=[pytest.mark.compat, pytest.mark.scenarios("accumulation_halved_in_place")],
        ),
        ("accumulation_halved_anew", True),
        ("accumulation_dropped", False),
    ],
)
def test_gradients_touched_between_the_synchronising_forward_and_its_backward(results, scenario, reduced_after):
    """The graph took the accumulated `.grad` at the forward; the loop then rescales it in place, replaces it, or
    drops it (zero_grad) before the backward: every rank still ends with what eager DDP averages."""
    per_rank = ok(results, scenario)
    assert_matches_eager(per_rank)
    leftovers = per_rank[0]["report"]["in_graph"]["leftovers_last_step"]
    # a replacement `.grad` is not what the graph took: it is reduced after the backward, as eager DDP reduces it
    assert bool(leftovers) == reduced_after, leftovers


@torch.library.custom_op("ddp_compile_tests::dropped_all_reduce", mutates_args=())
def dropped_all_reduce(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """A backend that loses the collective: the bucket's own values come back, not the ranks' sum."""
    return tensor.clone()


@dropped_all_reduce.register_fake
def _(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


def _with_all_reduces_dropped(rank: int, world_size: int) -> dict:
    from ddp.in_graph import graph_pass

    graph_pass._all_reduce = torch.ops.ddp_compile_tests.dropped_all_reduce.default
    return _train(rank, lambda: mlp(3))


def test_a_compiled_backward_that_lost_its_all_reduces_stops_the_job_after_the_first_step():
    """Inductor's lite settings compiled a backward without our all-reduces while the report named them; any
    compile that loses them must stop the job on every rank, naming the gradients, not train each rank alone."""
    with pytest.raises(RuntimeError, match=r"gradients of \['0.weight'.* differ between rank \d and rank \d"):
        run_ranks(_with_all_reduces_dropped, world_size=2, timeout=200)


def test_autograd_grad_after_no_sync_accumulation_leaves_grad_as_it_was(results):
    for rank, r in enumerate(ok(results, "autograd_grad_after_accumulation")):
        for name, held in r["held"].items():
            grad = r["grads"][name]
            assert grad is not None and torch.equal(grad, held), f"rank {rank}: {name}'s accumulated .grad changed"
