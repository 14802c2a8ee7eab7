"""`train_step(..., ddp="in_graph", optimizer_in_backward=True)` on 2 ranks, against eager DDP + eager optimizer.

Each scenario runs 5 optimizer updates on rank-dependent data and a hand-written eager DDP loop with the
same optimizer, schedule, accumulation and clipping in the same processes; it checks the parameters
(rtol 1e-4 on aot_eager), the optimizer state, that updates 2.. ran inside the backward (and update 1
on the normal path, which creates the optimizer state), that the gradients were freed, and that both
ranks hold identical parameters. All scenarios run in one 2-rank launch (module-scoped fixture).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os

import pytest
import torch
import torch.nn.functional as F

from tests.multi_gpu.ddp_compare import ok, run_scenarios, selected_scenarios, snapshot
from tests.multi_gpu.models import step_data, step_model
from tests.ranks import rank_device, run_ranks, to_rank_device, wrap_ddp

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(420)]

UPDATES = 5
CAP_MB = 0.015
CLIP = 0.05


make_model, make_data = step_model, step_data


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw_not_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True, fused=False),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    # every option the fused kernels take (a third state list with amsgrad; maximize; SGD's dampening)
    "adamw_amsgrad_maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True),
    "sgd_dampening_maximize": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3, maximize=True
    ),
}


class _EpsAfterUpdate3(torch.optim.lr_scheduler.LambdaLR):
    """A constant lr that sets every group's eps to 1e-6 after update 3 (a value torch's fused kernel, spliced
    into the compiled backward, holds as a constant)."""

    def __init__(self, opt):
        super().__init__(opt, lambda _: 1.0)

    def step(self, *args, **kwargs):
        super().step(*args, **kwargs)
        if self.last_epoch == 3:
            for group in self.optimizer.param_groups:
                group["eps"] = 1e-6


SCHEDULES = {
    None: None,
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=UPDATES, eta_min=1e-4),
    # cycle_momentum (its default) moves Adam's beta1 at every update
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=UPDATES),
    "eps_after_3": _EpsAfterUpdate3,
}


def _eager_loop(ddp, opt, sched, data, *, accum, clip, loss_fn):
    for i, (x, y) in enumerate(data):
        last = (i + 1) % accum == 0
        with ddp.no_sync() if not last else contextlib.nullcontext():
            (loss_fn(ddp(x), y) / accum).backward()
        if last:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()


def _state(opt) -> dict:
    return {
        k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in opt.state_dict()["state"].items()
    }


def _scenario(
    rank: int,
    *,
    opt: str,
    sched: str | None = None,
    accum: int = 1,
    clip: float | None = None,
    make=make_model,
    data=None,
    loss_fn=F.mse_loss,
    checkpoint: bool = False,
    backend: str = "aot_eager",
) -> dict:
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(make())
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    ours, theirs = wrap_ddp(model, bucket_cap_mb=CAP_MB), wrap_ddp(ref, bucket_cap_mb=CAP_MB)
    optimizer, ref_opt = OPTIMIZERS[opt](model.parameters()), OPTIMIZERS[opt](ref.parameters())
    schedule = SCHEDULES[sched](optimizer) if sched else None
    step = compile_core.train_step(
        ours,
        optimizer,
        loss_fn,
        backend=backend,
        ddp="in_graph",
        optimizer_in_backward=True,
        accum_steps=accum,
        clip_grad_norm=clip,
        lr_scheduler=schedule,
    )
    data = to_rank_device(data or make_data(rank, accum * UPDATES))
    grads_left = []
    for x, y in data:
        step(x, y)
        if step.applied:
            # measured when the backward ended, before the step's zero_grad (which would hide any)
            grads_left.append(step.report().to_dict()["optimizer_in_backward"]["grads_kept_last_backward"])
    _eager_loop(
        theirs, ref_opt, SCHEDULES[sched](ref_opt) if sched else None, data, accum=accum, clip=clip, loss_fn=loss_fn
    )
    out = {
        "params": snapshot(model),
        "ref": snapshot(ref),
        "initial": initial,
        "state": _state(optimizer),
        "ref_state": _state(ref_opt),
        "grads_left": grads_left,
        "report": step.report().to_dict(),
        "lr": float(optimizer.param_groups[0]["lr"]),
        "ref_lr": float(ref_opt.param_groups[0]["lr"]),
    }
    if checkpoint:
        # The optimizer's checkpoint must load into a plain eager optimizer and continue like eager.
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        fresh = OPTIMIZERS[opt](ref.parameters())
        fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        out["loaded_state"] = _state(fresh)
        out["loaded_lr"] = fresh.param_groups[0]["lr"]
    return out


def _llama():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _llama_scenario(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    data = [
        (torch.randint(0, 64, (2, 12), generator=g), torch.randint(0, 64, (2, 12), generator=g)) for _ in range(UPDATES)
    ]

    def loss_fn(out, y):
        return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), y.reshape(-1))

    return _scenario(rank, opt="sgd_momentum", make=_llama, data=data, loss_fn=loss_fn)


SCENARIOS = {
    "sgd_momentum": lambda rank: _scenario(rank, opt="sgd_momentum"),
    "sgd_nesterov": lambda rank: _scenario(rank, opt="sgd_nesterov"),
    "adam": lambda rank: _scenario(rank, opt="adam"),
    "adamw_cosine": lambda rank: _scenario(rank, opt="adamw", sched="cosine", checkpoint=True),
    "adam_onecycle": lambda rank: _scenario(rank, opt="adam", sched="onecycle"),
    "adamw_eps_after_3": lambda rank: _scenario(rank, opt="adamw", sched="eps_after_3"),
    "adamw_foreach": lambda rank: _scenario(rank, opt="adamw_foreach"),
    "adamw_not_fused": lambda rank: _scenario(rank, opt="adamw_not_fused"),
    "adamw_amsgrad_maximize": lambda rank: _scenario(rank, opt="adamw_amsgrad_maximize"),
    "sgd_dampening_maximize": lambda rank: _scenario(rank, opt="sgd_dampening_maximize"),
    "adamw_accum2": lambda rank: _scenario(rank, opt="adamw", accum=2),
    "adamw_clip": lambda rank: _scenario(rank, opt="adamw", clip=CLIP),
    "sgd_accum2_clip": lambda rank: _scenario(rank, opt="sgd_momentum", accum=2, clip=CLIP),
    "rmsprop_not_supported": lambda rank: _scenario(rank, opt="rmsprop"),
    "llama": _llama_scenario,
}


def _all_scenarios(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    return run_scenarios(SCENARIOS, rank, names)


@pytest.fixture(scope="module")
def results(request):
    return run_ranks(_all_scenarios, selected_scenarios(request, SCENARIOS), world_size=2, timeout=400)


def _assert_like_eager(
    per_rank: list[dict],
    *,
    rtol: float = 1e-4,
    atol: float = 1e-6,
    active: bool = True,
    fused: list[int] | None = None,
) -> None:
    """`fused`: the param groups whose update in the backward is torch's fused kernel (default: every group)."""
    for rank, r in enumerate(per_rank):
        for name, p in r["params"].items():
            torch.testing.assert_close(
                p, r["ref"][name], rtol=rtol, atol=atol, msg=lambda m: f"rank {rank} {name} vs eager: {m}"
            )
        assert any(not torch.equal(p, r["initial"][n]) for n, p in r["params"].items()), "training changed nothing"
        for k, state in r["ref_state"].items():
            for key, value in state.items():
                torch.testing.assert_close(
                    torch.as_tensor(r["state"][k][key]).double(),
                    torch.as_tensor(value).double(),
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m: f"rank {rank} state {k}.{key}: {m}",
                )
        iob = r["report"]["optimizer_in_backward"]
        assert iob["requested"] and iob["active"] is active, iob
        if active:
            assert iob["fused_kernel_groups"] == (fused if fused is not None else [0]), iob
            assert iob["from_update"] == 2 and iob["updates_in_backward"] == UPDATES - 1, iob
            # update 1 ran the normal path (every gradient kept for optimizer.step); later ones kept none
            assert r["grads_left"][0] > 0 and r["grads_left"][1:] == [0] * (UPDATES - 1), r["grads_left"]
    for name, p in per_rank[0]["params"].items():
        assert torch.equal(p, per_rank[1]["params"][name]), f"{name} differs between ranks"


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.scenarios(name))
        for name in (
            "sgd_momentum",
            "sgd_nesterov",
            "adam",
            "adamw_accum2",
            "adamw_amsgrad_maximize",
            "sgd_dampening_maximize",
        )
    ]
    + [pytest.param("adamw_foreach", marks=[pytest.mark.compat, pytest.mark.scenarios("adamw_foreach")])],
)
def test_update_inside_the_backward_matches_eager(results, name):
    _assert_like_eager(ok(results, name))


def test_a_group_that_says_fused_false_updates_inside_the_backward_with_the_update_graph(results):
    """`fused=False`: the user's step is not torch's fused kernel, so neither is the update in the backward (the
    captured update graph, the backend's kernels); trained like eager DDP with the same optimizer."""
    _assert_like_eager(ok(results, "adamw_not_fused"), fused=[])


def test_adamw_with_a_schedule_and_a_checkpoint_that_loads_into_an_eager_optimizer(results):
    per_rank = ok(results, "adamw_cosine")
    _assert_like_eager(per_rank)
    for r in per_rank:
        assert r["lr"] == pytest.approx(r["ref_lr"], rel=1e-12)
        assert isinstance(r["loaded_lr"], float)
        for k, state in r["loaded_state"].items():
            for key, value in state.items():
                torch.testing.assert_close(torch.as_tensor(value), torch.as_tensor(r["state"][k][key]))
    assert [x for x in per_rank[0]["report"]["recompiles"]] == []


def test_a_schedule_that_moves_beta1_at_every_update_keeps_the_per_parameter_update(results):
    """OneCycleLR cycles Adam's beta1: torch's fused kernel would take it as a constant of the compiled backward
    (a recompile per update), so the group keeps the update graph that reads it as an input."""
    per_rank = ok(results, "adam_onecycle")
    _assert_like_eager(per_rank, fused=[])
    assert per_rank[0]["report"]["recompiles"] == []
    # seen before update 2 compiled: no backward was compiled with the fused kernel, none twice
    assert per_rank[0]["report"]["optimizer_in_backward"]["recompiled_for_changed_constants"] == []


def test_a_value_the_fused_kernel_holds_as_a_constant_changed_later_recompiles_once_with_the_update_graph(results):
    """eps changes after update 3: updates 2 and 3 ran torch's fused kernel in the backward, then the backward
    compiles once more with the per-parameter update graph for that group (which reads eps as a value), and
    training stays in the backward and like eager to the end; the report says which value moved."""
    per_rank = ok(results, "adamw_eps_after_3")
    _assert_like_eager(per_rank, fused=[])
    for r in per_rank:
        iob = r["report"]["optimizer_in_backward"]
        assert iob["recompiled_for_changed_constants"] == ["update 4: param group 0 changed eps 1e-08 -> 1e-06"], iob
        assert r["report"]["recompiles"] == [], r["report"]["recompiles"]


@pytest.mark.parametrize("name", ["adamw_clip", "sgd_accum2_clip"])
def test_clipping_uses_the_global_norm_after_the_last_all_reduce(results, name):
    per_rank = ok(results, name)
    _assert_like_eager(per_rank)
    assert "global norm" in per_rank[0]["report"]["optimizer_in_backward"]["clip"]


def test_an_unsupported_optimizer_keeps_the_normal_path_and_says_why(results):
    per_rank = ok(results, "rmsprop_not_supported")
    _assert_like_eager(per_rank, active=False)
    assert "RMSprop" in per_rank[0]["report"]["optimizer_in_backward"]["reason"]


def test_a_transformers_llama_trains_like_eager(results):
    _assert_like_eager(ok(results, "llama"), rtol=1e-4, atol=1e-5)


def _inductor_job(rank: int, world_size: int, cache_dir: str, opts: tuple[str, ...]) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # before anything compiles in this process
    from torch._dynamo.utils import counters

    out = run_scenarios({opt: functools.partial(_scenario, opt=opt, backend="inductor") for opt in opts}, rank)
    out["counters"] = {k: dict(counters[k]) for k in ("aot_autograd", "inductor")}
    out["device"] = rank_device(rank).type
    return out


@pytest.fixture(scope="module")
def inductor_cold(tmp_path_factory) -> tuple[str, list[dict]]:
    """One cold Inductor job for both optimizers (their model's graphs compile once): the cache dir and
    the per-rank results."""
    cache = str(tmp_path_factory.mktemp("in_backward_inductor") / "cache")
    return cache, run_ranks(_inductor_job, cache, ("adamw", "sgd_momentum"), world_size=2, timeout=700)


@pytest.mark.inductor
@pytest.mark.timeout(900)
def test_inductor_updates_like_eager_and_a_warm_job_loads_the_update_variant_from_the_cache(inductor_cold):
    """The update-2 graph (all-reduce + update per bucket, ordered by control deps) is compiled by
    Inductor, matches eager, and a second job on the same cache compiles nothing."""
    cache, cold = inductor_cold
    # Inductor's kernels round differently and Adam magnifies it where a gradient is near zero:
    # 1% of one update (lr 1e-2) absolute; a missing or doubled reduction moves parameters by ~lr.
    _assert_like_eager(ok(cold, "adamw"), rtol=1e-3, atol=1e-4)
    warm = run_ranks(_inductor_job, cache, ("adamw",), world_size=2, timeout=400)
    _assert_like_eager(ok(warm, "adamw"), rtol=1e-3, atol=1e-4)
    # the update variant (update 1 is eager DDP, the update spliced into the backward) comes from
    # AOTAutograd's cache
    for rank, r in enumerate(warm):
        aot, fx = r["counters"]["aot_autograd"], r["counters"]["inductor"]
        assert aot.get("autograd_cache_hit", 0) >= 1 and not aot.get("autograd_cache_miss"), (rank, aot)
        assert fx.get("fxgraph_cache_hit", 0) >= 1, (rank, fx)
        assert not aot.get("autograd_cache_bypass") and not fx.get("fxgraph_cache_bypass"), (rank, aot, fx)
        assert not fx.get("fxgraph_cache_miss"), (rank, fx)


@pytest.mark.inductor
@pytest.mark.timeout(900)
def test_inductor_with_plain_momentum_sgd_matches_eager(inductor_cold):
    """SGD's update is proportional to the gradient, so a wrong divisor (a sum instead of an average,
    a bucket divided twice) shows at once; Adam's normalisation would hide it."""
    _assert_like_eager(ok(inductor_cold[1], "sgd_momentum"), rtol=1e-4, atol=1e-5)
