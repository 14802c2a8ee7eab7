"""compile_core.train_step on 2 ranks (gloo on CPU, nccl when 2 GPUs are visible).

AdamW + cosine schedule + accum_steps=2, 4 optimizer updates (8 micro-batches per rank, different
data on each rank): the parameters must equal an eager-DDP reference run in the same processes, be
identical across ranks, and DDP must all-reduce once per update, not once per micro-batch. AdamW as the
user leaves it (per block on the CPU), with foreach=True (compiled whole, CUDA's default) and with fused=True
(torch's fused step as it is).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.ranks import run_ranks, to_rank_device, wrap_ddp

ACCUM = 2
UPDATES = 4


IMPLEMENTATIONS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""AdamW's implementation flag, per test id."""


def _setup(impl: str):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    inner = to_rank_device(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)))
    model = wrap_ddp(inner)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, **IMPLEMENTATIONS[impl])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=UPDATES, eta_min=1e-4)
    return model, opt, sched


class _Count:
    def __init__(self) -> None:
        self.calls = 0


def _counting_allreduce(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def _rank_fn(rank: int, world_size: int, backend: str, impl: str, options: dict | None = None):
    import torch
    import torch.nn.functional as F

    from compile_core.step import train_step

    options = dict(options or {})
    copies = _copy_out_of_pool() if options.pop("copy_out_of_pool", False) else None
    # a user comm hook keeps DDP's reducer in charge: ddp="in_graph" would not reduce in its graphs
    count_allreduces = options.pop("count_allreduces", True)

    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    data = to_rank_device(
        [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(ACCUM * UPDATES)]
    )

    model, opt, sched = _setup(impl)
    initial = [p.detach().cpu().numpy().copy() for p in model.parameters()]
    count = _Count()
    if count_allreduces:
        model.register_comm_hook(count, _counting_allreduce)
    step = train_step(model, opt, F.mse_loss, backend=backend, accum_steps=ACCUM, lr_scheduler=sched, **options)
    losses = [step(x, y) for x, y in data]

    ref, ref_opt, ref_sched = _setup(impl)
    ref_count = _Count()
    if count_allreduces:
        ref.register_comm_hook(ref_count, _counting_allreduce)
    for i, (x, y) in enumerate(data):
        last = (i + 1) % ACCUM == 0
        with ref.no_sync() if not last else torch.enable_grad():
            (F.mse_loss(ref(x), y) / ACCUM).backward()
        if last:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_sched.step()

    report = step.report().to_dict()
    return {
        "params": [p.detach().cpu().numpy().copy() for p in model.parameters()],
        "ref_params": [p.detach().cpu().numpy().copy() for p in ref.parameters()],
        "initial": initial,
        "losses": [float(v) for v in losses],
        "allreduces": count.calls,
        "ref_allreduces": ref_count.calls,
        "lr": float(opt.param_groups[0]["lr"]),
        "ref_lr": float(ref_opt.param_groups[0]["lr"]),
        "updates": report["updates"],
        "optimizer": report["optimizer"],
        "in_backward": report.get("optimizer_in_backward"),
        "in_graph_reduces": [g.get("variant") for g in report["graphs"] if g.get("variant")],
        "copies": copies,
    }


def _copy_out_of_pool() -> list[int]:
    """Tell the train step it accumulates under CUDA graphs (none on the CPU: the copy of the accumulated
    gradients out of their pool runs, compile_core/step/accumulation.py); returns the per-call copy counts."""
    import compile_core.step.train as train
    from compile_core.step.accumulation import GradsOutOfGraphPool

    counts: list[int] = []
    original = GradsOutOfGraphPool.after_accumulating_backward
    train.accumulates_under_cuda_graphs = lambda config, device_type: True
    GradsOutOfGraphPool.after_accumulating_backward = lambda self, params: counts.append(original(self, params))
    return counts


@pytest.mark.multi_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", [pytest.param("default", marks=pytest.mark.compat), "foreach", "fused"])
def test_adamw_cosine_accumulation_matches_eager_ddp_on_two_ranks(impl):
    results = run_ranks(_rank_fn, "aot_eager", impl, world_size=2, timeout=240)

    for rank, r in enumerate(results):
        assert r["updates"] == UPDATES
        if impl in ("fused", "foreach"):  # foreach: torch's fused step, fused=True only while it steps
            assert "fused=True" in (r["optimizer"]["as_is"] or "") and r["optimizer"]["graphs"] == 0, r["optimizer"]
        else:
            assert r["optimizer"]["compiled"], (rank, r["optimizer"])
        if impl == "foreach":
            assert "foreach=True" in r["optimizer"]["as_is"], r["optimizer"]
        assert [x for x in r["optimizer"]["recompiles"] if x["update"] > 2] == [], r["optimizer"]["recompiles"]
        assert r["lr"] == pytest.approx(r["ref_lr"], rel=1e-9)
        assert any(not np.array_equal(p, q) for p, q in zip(r["params"], r["initial"])), "training changed nothing"
        for i, (p, q) in enumerate(zip(r["params"], r["ref_params"])):
            np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-6, err_msg=f"rank {rank} param {i} vs eager DDP")
        # no_sync on the first micro-batch of each update: one round of all-reduces per update.
        assert r["ref_allreduces"] > 0 and r["allreduces"] == r["ref_allreduces"], (
            r["allreduces"],
            r["ref_allreduces"],
        )

    # DDP keeps replicas identical; different data per rank means this is not trivially true.
    assert results[0]["losses"] != results[1]["losses"]
    for i, (p0, p1) in enumerate(zip(results[0]["params"], results[1]["params"])):
        np.testing.assert_array_equal(p0, p1, err_msg=f"param {i} differs between ranks")


@pytest.mark.multi_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "options",
    [{"ddp": "split"}, {"ddp": "in_graph"}, {"ddp": "in_graph", "optimizer_in_backward": True}],
    ids=["split", "in_graph", "in_backward"],
)
def test_accumulated_gradients_copied_out_of_the_cuda_graph_pool_match_eager_ddp_on_two_ranks(options):
    """The copy a train step makes of its accumulated `.grad` under CUDA graphs, run here on the CPU (the step
    told it accumulates under CUDA graphs): the parameters are eager DDP's on both ranks, in every way of
    reducing, the in-backward update included (the accumulated copies enter the synchronising graph)."""
    results = run_ranks(
        _rank_fn,
        "aot_eager",
        "default",
        {**options, "copy_out_of_pool": True, "count_allreduces": False},
        world_size=2,
        timeout=240,
    )
    n = len(results[0]["params"])
    for rank, r in enumerate(results):
        assert r["updates"] == UPDATES
        assert r["copies"] == [n] * UPDATES, r["copies"]  # once per update: the first micro-batch's gradients
        if options["ddp"] == "in_graph":  # the accumulated copies enter the synchronising graph
            assert any(v.startswith("reduce_acc") for v in r["in_graph_reduces"]), r["in_graph_reduces"]
        if options.get("optimizer_in_backward"):
            in_backward = r["in_backward"]
            assert in_backward["active"], in_backward["reason"]
            assert in_backward["updates_in_backward"] == UPDATES - 1, in_backward  # update 1 runs as eager DDP
        assert any(not np.array_equal(p, q) for p, q in zip(r["params"], r["initial"])), "training changed nothing"
        for i, (p, q) in enumerate(zip(r["params"], r["ref_params"])):
            np.testing.assert_allclose(p, q, rtol=1e-4, atol=1e-6, err_msg=f"rank {rank} param {i} vs eager DDP")
    assert results[0]["losses"] != results[1]["losses"]
    for i, (p0, p1) in enumerate(zip(results[0]["params"], results[1]["params"])):
        np.testing.assert_array_equal(p0, p1, err_msg=f"param {i} differs between ranks")


def _keyword_rank_fn(rank: int, world_size: int, ddp_mode: str, in_backward: bool):
    """A model that takes its batch as keywords and computes its own loss from `labels=` (a Hugging Face
    model's shape), through `step(**batch, target=None)`, against eager DDP's `model(**batch)["loss"]`."""
    import copy

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import compile_core

    class KeywordModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.mix, self.head = nn.Embedding(32, 16), nn.Linear(16, 16), nn.Linear(16, 32)

        def forward(self, input_ids, attention_mask=None, labels=None):
            h = torch.tanh(self.mix(self.embed(input_ids)))
            if attention_mask is not None:
                h = h * attention_mask.unsqueeze(-1)
            logits = self.head(h)
            return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}

    torch.manual_seed(0)
    inner = to_rank_device(KeywordModel())
    ref_inner = copy.deepcopy(inner)
    model, ref = wrap_ddp(inner, bucket_cap_mb=0.002), wrap_ddp(ref_inner, bucket_cap_mb=0.002)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = compile_core.train_step(
        model,
        opt,
        lambda out, target: out["loss"],
        backend="aot_eager",
        ddp=ddp_mode,
        optimizer_in_backward=in_backward,
        accum_steps=ACCUM,
    )
    gen = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(UPDATES * ACCUM):
        ids = torch.randint(0, 32, (2, 6), generator=gen)
        mask = (torch.rand(2, 6, generator=gen) > 0.2).float()
        batches.append({k: to_rank_device(v) for k, v in dict(input_ids=ids, attention_mask=mask, labels=ids).items()})
    for batch in batches:
        step(**batch, target=None)
    for i, batch in enumerate(batches):
        if (i + 1) % ACCUM:
            with ref.no_sync():
                (ref(**batch)["loss"] / ACCUM).backward()
        else:
            (ref(**batch)["loss"] / ACCUM).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    named = lambda m: {n: p.detach().cpu() for n, p in m.named_parameters()}  # noqa: E731
    return {"params": named(inner), "ref": named(ref_inner)}


@pytest.mark.multi_gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ddp_mode,in_backward", [("split", False), ("in_graph", True)], ids=["split", "in_backward"])
def test_keyword_inputs_with_accumulation_match_eager_ddp_on_two_ranks(ddp_mode, in_backward):
    """`step(**batch, target=None)`: keyword inputs reach the model as keywords (session 65; a TypeError before)."""
    import torch

    results = run_ranks(_keyword_rank_fn, ddp_mode, in_backward, world_size=2, timeout=240)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"
