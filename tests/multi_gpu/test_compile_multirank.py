"""Two ranks (gloo on CPU, nccl with >= 2 GPUs): compiled DDP against eager DDP, and DDP's real buckets."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from examples.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from tests.ranks import run_ranks, to_rank_device, wrap_ddp

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(300)]

CFG = GPTConfig(vocab_size=128, d_model=64, n_layers=3, n_heads=4, max_seq_len=32)


def record_buckets(ddp: DDP, sink: list) -> None:
    """A comm hook doing DDP's default all-reduce, noting each bucket's parameter names."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}

    def hook(state, bucket):
        sink.append((bucket.index(), [names[id(p)] for p in bucket.parameters()]))
        buf = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)


def _eager_step(ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    lm_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def train_both(
    rank: int,
    world_size: int,
    backend: str,
    cap_mb: float,
    our_cap_mb: tuple | None = None,
    reuse_pieces: bool = True,
    ddp_mode: str = "split",
    outer_compile: bool = False,
    scripts_compile: str | None = None,
):
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(GPT(CFG))
    ref = copy.deepcopy(model)
    if scripts_compile == "compile_core.compile(model), then DDP":
        compile_core.compile(model, backend=backend)  # the place of nanoGPT's torch.compile(model), before DDP
    ours, theirs = wrap_ddp(model, bucket_cap_mb=cap_mb), wrap_ddp(ref, bucket_cap_mb=cap_mb)
    seen: list = []
    record_buckets(ours, seen)
    override = None if our_cap_mb is None else our_cap_mb[rank]
    handed = ours
    if scripts_compile == "torch.compile(ddp)":
        handed = torch.compile(ours, backend="eager")
    elif scripts_compile == "ddp.compile()":
        ours.compile(backend="eager")
    compiled = compile_core.compile(
        handed, backend=backend, ddp=ddp_mode, bucket_cap_mb=override, reuse_pieces=reuse_pieces
    )
    handed_back_ddp = compiled is ours
    outer_ops: list[str] = []
    if outer_compile:  # the script's own torch.compile around what ours returned (timm compiles after DDP)

        def scripts_backend(gm, example_inputs):
            outer_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        compiled = torch.compile(compiled, backend=scripts_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    per_step = []
    for step in range(3):
        x, y = to_rank_device(synthetic_batch(CFG, 2, 16, step=step, rank=rank))
        seen.clear()
        lm_loss(compiled(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_step.append([names for _, names in sorted(seen)])
        _eager_step(theirs, ref_opt, x, y)
    return {
        "params": _named(model),
        "ref": _named(ref),
        "report": ours.report().to_dict(),
        "ddp_buckets": per_step,
        "outer_ops": outer_ops,
        "handed_back_ddp": handed_back_ddp,
    }


@pytest.mark.compat
def test_two_ranks_match_eager_ddp_and_pieces_are_real_buckets():
    """On aot_eager: the pieces and DDP's buckets do not depend on the backend (they are planned before it runs),
    and Inductor-compiled pieces against eager DDP on 2 ranks are tests/multi_gpu/test_compile_once_multirank.py's
    (`test_inductor_ranks_share_compiles_and_a_warm_job_hits_every_cache`)."""
    results = run_ranks(train_both, "aot_eager", 0.05, world_size=2, timeout=280)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"

    pieces = [[g["pieces"] for g in r["report"]["graphs"]] for r in results]
    assert pieces[0] == pieces[1], f"ranks compiled different pieces: {pieces}"
    assert sum(pieces[0]) >= 3

    planned = [b["params"] for g in reversed(results[0]["report"]["graphs"]) for b in g["buckets"] if b["params"]]
    for rank, r in enumerate(results):
        assert r["report"]["alignment"]["status"] == "aligned"
        for step in (1, 2):  # steps 2 and 3: DDP has fixed its buckets by now
            real = r["ddp_buckets"][step]
            assert [sorted(b) for b in real] == [sorted(b) for b in planned], (
                f"rank {rank} step {step + 1}: DDP buckets {real} != pieces {planned}"
            )


def test_ranks_that_plan_differently_all_reduce_rank0s_buckets():
    """Per-rank caps make the ranks plan different pieces: all must still reduce the same buckets.
    (Without block alignment: cuts in step with the repeated blocks can make both caps plan alike.)"""
    results = run_ranks(train_both, "aot_eager", 0.05, (0.05, 0.02), False, world_size=2, timeout=280)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
    assert results[0]["report"]["alignment"]["buckets"] == results[1]["report"]["alignment"]["buckets"]
    assert "ranks [1] planned differently" in results[1]["report"]["alignment"]["detail"]
    assert results[0]["ddp_buckets"][2] == results[1]["ddp_buckets"][2]


@pytest.mark.compat
@pytest.mark.parametrize("mode", ["none", "torch"])
def test_whole_graph_and_pytorch_split_modes_match_eager_ddp(mode):
    """ddp="none" (one graph, DDP's reducer as DDP built it) and ddp="torch" (PyTorch's DDPOptimizer cuts the
    graph, we compile its pieces) train what eager DDP trains, on rank-dependent data. DDPOptimizer refuses a
    DDP bucket cap below its first bucket's (1 MiB), so ddp="torch" runs with DDP's cap at 1 MiB."""
    cap_mb = 1.0 if mode == "torch" else 0.05
    results = run_ranks(train_both, "aot_eager", cap_mb, None, True, mode, world_size=2, timeout=280)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
        assert r["report"]["ddp_mode"] == mode
        assert sum(len(step) for step in r["ddp_buckets"]) > 0, f"rank {rank}: DDP's reducer reduced nothing"
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"
    pieces = [g["pieces"] for g in results[0]["report"]["graphs"]]
    if mode == "none":
        assert pieces == [1], pieces
    else:  # each graph DDPOptimizer hands us is one piece
        assert pieces and set(pieces) == {1}, pieces
        assert results[0]["report"]["alignment"]["status"] == "not ours"


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_a_torch_compile_around_the_compiled_model_leaves_the_model_to_us(mode):
    """`torch.compile(compile_core.compile(ddp))`: the outer compile stops at our model call. Before, it traced
    our runtime frame by frame and compiled some of the model's own ops itself, outside our pieces. The outer
    compile runs torch's DDPOptimizer on DDP's own frames, which refuses a DDP bucket cap under 1 MiB."""
    results = run_ranks(train_both, "aot_eager", 1.0, None, True, mode, True, world_size=2, timeout=280)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
        model_ops = [op for op in r["outer_ops"] if "linear" in op or "layer_norm" in op or "embedding" in op]
        assert not model_ops, f"rank {rank}: the script's torch.compile compiled model ops {model_ops}"
        assert sum(g["pieces"] for g in r["report"]["graphs"]) >= 1 and not r["report"]["fallbacks"]
    if mode == "split":
        assert all(r["report"]["alignment"]["status"] == "aligned" for r in results)
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"


NOTES = {
    "torch.compile(ddp)": "torch.compile's wrapper of DistributedDataParallel",
    "ddp.compile()": "compiled by module.compile()",
    "compile_core.compile(model), then DDP": "compiled by compile_core.compile before DDP wrapped it",
}


@pytest.mark.parametrize("scripts_compile", sorted(NOTES))
@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_a_ddp_model_the_script_compiled_itself_is_compiled_by_us_in_its_place(mode, scripts_compile):
    """A script that kept its own compile of the DDP model. `compile_core.compile(torch.compile(ddp))`: before,
    the wrapper was compiled as a plain module whose call is DDP's, whose frame Dynamo skips: nothing was
    compiled by us (split: PyTorch's DDPOptimizer ran, and failed on a cap under the first bucket's) and
    `ddp='in_graph'` was refused as not DDP. `ddp.compile()` then `compile_core.compile(ddp)`: before, torch's
    compile of DDP's call ran around ours (in_graph: the same DDPOptimizer failure). `compile_core.compile(model)`
    before DDP wrapped it, then `compile_core.compile(ddp)`: before, refused ("compile each module once"). Now the
    DDP model is compiled by us alone and handed back (the wrapper's call runs it too)."""
    results = run_ranks(
        train_both, "aot_eager", 0.05, None, True, mode, False, scripts_compile, world_size=2, timeout=280
    )
    for rank, r in enumerate(results):
        assert r["handed_back_ddp"], f"rank {rank}: compile_core.compile did not hand back the DDP model"
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
        assert sum(g["pieces"] for g in r["report"]["graphs"]) >= 1, r["report"]["graphs"]
        assert any(NOTES[scripts_compile] in n for n in r["report"]["notes"]), r["report"]["notes"]
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"


def train_step_handed_torch_compiled(rank: int, world_size: int, mode: str):
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(GPT(CFG))
    ref = copy.deepcopy(model)
    ours, theirs = wrap_ddp(model, bucket_cap_mb=0.05), wrap_ddp(ref, bucket_cap_mb=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = compile_core.train_step(torch.compile(ours, backend="eager"), opt, lm_loss, backend="aot_eager", ddp=mode)
    for i in range(3):
        x, y = to_rank_device(synthetic_batch(CFG, 2, 16, step=i, rank=rank))
        step(x, y)
        _eager_step(theirs, ref_opt, x, y)
    return {
        "params": _named(model),
        "ref": _named(ref),
        "report": step.report().to_dict(),
        "model_is_ddp": step.model is ours,
    }


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_train_step_takes_torch_compiles_wrapper_of_ddp_as_the_ddp_model(mode):
    """`compile_core.train_step(torch.compile(ddp), ...)`: before, the step compiled nothing (split: torch's
    DDPOptimizer ran and refused a cap under the first bucket's) or refused the model as not DDP (in_graph)."""
    results = run_ranks(train_step_handed_torch_compiled, mode, world_size=2, timeout=280)
    for rank, r in enumerate(results):
        assert r["model_is_ddp"], f"rank {rank}: the step's model is not the DDP model"
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
        assert sum(g["pieces"] for g in r["report"]["graphs"]) >= 1, r["report"]["graphs"]


def _gan_steps(netG: nn.Module, netD: nn.Module, rank: int, steps: int = 3) -> None:
    """DCGAN's loop (pytorch/examples): the discriminator runs three forwards and three backwards per step, its
    gradients accumulate over two of them, and the generator's loss back-propagates through it."""
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        real, noise = torch.randn(8, 32, generator=gen) + rank, torch.randn(8, 16, generator=gen)
        netD.zero_grad()
        bce(netD(to_rank_device(real)), to_rank_device(torch.ones(8, 1))).backward()
        fake = netG(to_rank_device(noise))
        bce(netD(fake.detach()), to_rank_device(torch.zeros(8, 1))).backward()
        optD.step()
        netG.zero_grad()
        bce(netD(fake), to_rank_device(torch.ones(8, 1))).backward()
        optG.step()


def train_gan_both(rank: int, world_size: int, mode: str):
    import compile_core

    torch.manual_seed(0)
    g = to_rank_device(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh()))
    d = to_rank_device(nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)))
    ref_g, ref_d = copy.deepcopy(g), copy.deepcopy(d)
    initial = d[0].weight.detach().cpu().clone()
    ours = [compile_core.compile(wrap_ddp(m, bucket_cap_mb=0.01), backend="aot_eager", ddp=mode) for m in (g, d)]
    _gan_steps(*ours, rank)
    _gan_steps(wrap_ddp(ref_g, bucket_cap_mb=0.01), wrap_ddp(ref_d, bucket_cap_mb=0.01), rank)
    return {
        "params": {**_named(g), **{f"D.{n}": p for n, p in _named(d).items()}},
        "ref": {**_named(ref_g), **{f"D.{n}": p for n, p in _named(ref_d).items()}},
        "graphs": [len(m.report().graphs) for m in ours],
        "initial": initial,
    }


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_a_gan_with_two_ddp_models_trains_like_eager(mode):
    """Two compiled DDP models in one loop, one of them run three times per step (a field script shape, guarded:
    it passed when written)."""
    results = run_ranks(train_gan_both, mode, world_size=2, timeout=280)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert all(r["graphs"]), r["graphs"]
        assert (r["ref"]["D.0.weight"] - r["initial"]).abs().max() > 1e-3, f"rank {rank}: training did not move D"
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"


def _retaining_accumulation_steps(ddp: nn.Module, rank: int, steps: int = 3) -> None:
    """Two micro-batches per update; in the `no_sync()` one each of two losses back-propagates on its own
    through one forward (`retain_graph=True`), the synchronising one back-propagates their sum."""
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(200 + rank)
    for _ in range(steps):
        with ddp.no_sync():
            out = ddp(to_rank_device(torch.randn(4, 16, generator=gen) + rank))
            out.pow(2).mean().backward(retain_graph=True)
            out.abs().mean().backward()
        out = ddp(to_rank_device(torch.randn(4, 16, generator=gen)))
        (out.pow(2).mean() + out.abs().mean()).backward()
        opt.step()
        opt.zero_grad()


def train_retaining_both(rank: int, world_size: int, mode: str):
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)))
    ref = copy.deepcopy(model)
    # two buckets, [the last two layers] and [the first]: split's second piece keeps an activation of its own
    ours = compile_core.compile(wrap_ddp(model, bucket_cap_mb=0.003), backend="aot_eager", ddp=mode)
    _retaining_accumulation_steps(ours, rank)
    _retaining_accumulation_steps(wrap_ddp(ref, bucket_cap_mb=0.003), rank)
    return {"params": _named(model), "ref": _named(ref), "pieces": [g.pieces for g in ours.report().graphs]}


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_accumulation_whose_losses_back_propagate_one_by_one_trains_like_eager(mode):
    """Until session 65 the retaining backward failed in our pieces (AOTAutograd's "compiled with non-empty
    donated buffers"), where `torch.compile(ddp)` with aot_eager runs it."""
    results = run_ranks(train_retaining_both, mode, world_size=2, timeout=200)
    for rank, r in enumerate(results):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["ref"][name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        # in_graph compiles the no_sync() forward and the synchronising one each as one graph
        assert r["pieces"] == ([2] if mode == "split" else [1, 1]), r["pieces"]
    for name, p in results[0]["params"].items():
        assert torch.equal(p, results[1]["params"][name]), f"{name} differs between ranks"
