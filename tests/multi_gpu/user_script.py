"""The user's eager DDP script is the specification: run it as written, and through compile_core, side by side.

A `Script` describes one training loop the way a user writes it: the model, the DDP options, what is
done to the DDP object after wrapping (a comm hook, ignored parameters), the optimizer and its param
groups, the loss (which may read model parameters directly: an auxiliary loss), a scheduler,
accumulation, clipping, and anything the loop changes between steps (a branch that joins late).

`run_against_eager(script, rank, how=...)` trains the same initial weights on the same rank-dependent
data twice in the same process: once exactly as the eager script (the reference), once through
compile_core, either
  * `how="compile"`: `compile_core.compile(ddp, **kwargs)` in the user's own loop, or
  * `how="train_step"`: `compile_core.train_step(ddp, opt, loss_fn, **kwargs)`,
and returns both runs' parameters, optimizer state and what compile_core reported. The data differ
per rank, so a gradient that is not averaged over the ranks shows as a difference from the reference.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multi_gpu.ddp_compare import buffers, snapshot, update_rel_err
from tests.ranks import rank_device, wrap_ddp

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def mse(out: torch.Tensor, target: torch.Tensor, model: nn.Module, step: int) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), target.float())


def sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@dataclasses.dataclass(kw_only=True)
class Script:
    """One user training loop (see the module docstring)."""

    make_model: Callable[[], nn.Module]
    data: Callable[[int, int, torch.device], list[Batch]]
    """(rank, micro-batches, device) -> [(inputs, target)], different on every rank."""
    steps: int = 3
    """Optimizer updates."""
    ddp_kwargs: dict = dataclasses.field(default_factory=dict)
    ignore: tuple[str, ...] = ()
    """Parameters DDP is told to ignore (`_set_params_and_buffers_to_ignore_for_model`)."""
    delay: tuple[tuple[str, ...], str] | None = None
    """(parameters whose all-reduce DDP delays, the parameter whose gradient hook reduces them):
    DDP's `delay_all_reduce_named_params` and `param_to_hook_all_reduce`, by name."""
    setup: Callable[[DDP], None] | None = None
    """Called on the DDP object right after wrapping (register a comm hook, ...)."""
    eager_setup: Callable[[DDP], None] | None = None
    """Called on the reference's DDP object only (what compile_core is asked to do by an option)."""
    make_opt: Callable[[nn.Module], torch.optim.Optimizer] = sgd_momentum
    make_sched: Callable[[torch.optim.Optimizer], Any] | None = None
    loss: Callable[[Any, torch.Tensor, nn.Module, int], torch.Tensor] = mse
    """(model output, target, the inner module, micro-batch index) -> scalar loss."""
    accum: int = 1
    clip: float | None = None
    before_step: Callable[[nn.Module, int], None] | None = None
    """Called with the inner module before each micro-batch (e.g. switch a branch on)."""
    group: Callable[[], Any] | None = None
    """A process group for DDP (a subgroup of the world); None = the default group."""
    zero_grad_after_forward: bool = False
    """Zero the gradients between the forward and the backward (Lightning's order) instead of after the step."""
    before_step_opt: Callable[[nn.Module, torch.optim.Optimizer, int], None] | None = None
    """Called with the inner module and the optimizer before each micro-batch (e.g. add a param group)."""


def _build(script: Script, device: torch.device) -> tuple[nn.Module, nn.Module, dict]:
    torch.manual_seed(0)
    model = script.make_model().to(device)
    ref = copy.deepcopy(model)
    return model, ref, snapshot(model)


def _wrap(script: Script, module: nn.Module, group: Any, *, eager: bool) -> DDP:
    if script.ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(module, list(script.ignore))
    kwargs = dict(script.ddp_kwargs)
    if group is not None:
        kwargs["process_group"] = group
    if script.delay is not None:
        named = dict(module.named_parameters())
        kwargs["delay_all_reduce_named_params"] = [(n, named[n]) for n in script.delay[0]]
        kwargs["param_to_hook_all_reduce"] = named[script.delay[1]]
    ddp = wrap_ddp(module, **kwargs)
    if script.setup is not None:
        script.setup(ddp)
    if eager and script.eager_setup is not None:
        script.eager_setup(ddp)
    return ddp


def _eager_loop(script: Script, ddp: DDP, data: list[Batch]) -> dict:
    module = ddp.module
    opt = script.make_opt(module)
    sched = script.make_sched(opt) if script.make_sched else None
    losses = []
    for i, (inputs, target) in enumerate(data):
        if script.before_step:
            script.before_step(module, i)
        if script.before_step_opt:
            script.before_step_opt(module, opt, i)
        last = (i + 1) % script.accum == 0
        with ddp.no_sync() if not last else contextlib.nullcontext():
            loss = script.loss(ddp(*inputs), target, module, i)
            if script.zero_grad_after_forward and i % script.accum == 0:
                opt.zero_grad(set_to_none=True)
            (loss / script.accum if script.accum > 1 else loss).backward()
        losses.append(loss.item())
        if last:
            if script.clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), script.clip)
            opt.step()
            if not script.zero_grad_after_forward:
                opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    return {"opt": opt, "sched": sched, "losses": losses}


def _compile_loop(script: Script, ddp: DDP, data: list[Batch], kwargs: dict) -> dict:
    import compile_core

    module = ddp.module
    compiled = compile_core.compile(ddp, **kwargs)
    opt = script.make_opt(module)
    sched = script.make_sched(opt) if script.make_sched else None
    losses = []
    for i, (inputs, target) in enumerate(data):
        if script.before_step:
            script.before_step(module, i)
        if script.before_step_opt:
            script.before_step_opt(module, opt, i)
        last = (i + 1) % script.accum == 0
        with ddp.no_sync() if not last else contextlib.nullcontext():
            loss = script.loss(compiled(*inputs), target, module, i)
            if script.zero_grad_after_forward and i % script.accum == 0:
                opt.zero_grad(set_to_none=True)
            (loss / script.accum if script.accum > 1 else loss).backward()
        losses.append(loss.item())
        if last:
            if script.clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), script.clip)
            opt.step()
            if not script.zero_grad_after_forward:
                opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    return {"opt": opt, "sched": sched, "losses": losses, "report": compiled.report().to_dict()}


def _train_step_loop(script: Script, ddp: DDP, data: list[Batch], kwargs: dict) -> dict:
    import compile_core

    module = ddp.module
    opt = script.make_opt(module)
    sched = script.make_sched(opt) if script.make_sched else None
    index = {"i": 0}

    def loss_fn(out, target):
        return script.loss(out, target, module, index["i"])

    step = compile_core.train_step(
        ddp, opt, loss_fn, accum_steps=script.accum, clip_grad_norm=script.clip, lr_scheduler=sched, **kwargs
    )
    losses, grads_after_update = [], []
    for i, (inputs, target) in enumerate(data):
        index["i"] = i
        if script.before_step:
            script.before_step(module, i)
        if script.before_step_opt:
            script.before_step_opt(module, opt, i)
        losses.append(step(*inputs, target).item())
        if step.applied:
            grads_after_update.append(sorted(n for n, p in module.named_parameters() if p.grad is not None))
    return {
        "opt": opt,
        "sched": sched,
        "losses": losses,
        "report": step.report().to_dict(),
        "grads_after_update": grads_after_update,
    }


def _state(opt: torch.optim.Optimizer) -> dict:
    # ZeroRedundancyOptimizer's own state_dict() needs a consolidation across ranks: its shard's optimizer
    # holds this rank's state, sharded alike in both runs.
    local = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return {
        k: {n: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
        for k, s in local.state_dict()["state"].items()
    }


def run_against_eager(script: Script, rank: int, *, how: str = "compile", **kwargs: Any) -> dict:
    """Train `script` eagerly and through compile_core (`how`: "compile" or "train_step"); see the module doc."""
    device = rank_device(rank)
    model, ref, initial = _build(script, device)
    group = script.group() if script.group is not None else None
    ours, theirs = _wrap(script, model, group, eager=False), _wrap(script, ref, group, eager=True)
    data = script.data(rank, script.steps * script.accum, device)
    kwargs.setdefault("backend", "aot_eager")
    run = {"compile": _compile_loop, "train_step": _train_step_loop}[how](script, ours, data, kwargs)
    eager = _eager_loop(script, theirs, data)
    cpu = lambda d: {n: t.cpu() for n, t in d.items()}  # noqa: E731
    out = {
        "params": cpu(snapshot(model)),
        "ref": cpu(snapshot(ref)),
        "initial": cpu(initial),
        "buffers": cpu(buffers(model)),
        "ref_buffers": cpu(buffers(ref)),
        "losses": run["losses"],
        "ref_losses": eager["losses"],
        "report": run["report"],
        "state": _state(run["opt"]),
        "ref_state": _state(eager["opt"]),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in run["opt"].param_groups],
        "grads_after_update": run.get("grads_after_update"),
    }
    if run["sched"] is not None:
        out["last_lr"] = run["sched"].get_last_lr()
        out["ref_last_lr"] = eager["sched"].get_last_lr()
    return out


def assert_like_eager(
    per_rank: list[dict],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    not_reduced: tuple[str, ...] = (),
    state: bool = True,
    update_rtol: float | None = None,
) -> None:
    """Parameters (and optimizer state) equal the eager script's on every rank; the data differed per
    rank, training moved the parameters, and DDP-reduced parameters are identical across ranks.

    `update_rtol` (for bf16 parameters, whose compiled optimizer math rounds differently from eager's
    by an ulp that later steps carry on): instead of element-wise closeness, the distance to the
    eager run must be under this fraction of how far training moved the parameters (a gradient not
    averaged over the ranks moves them by a different update altogether, ~1.0 of it)."""
    for rank, r in enumerate(per_rank):
        if update_rtol is not None:
            err = update_rel_err(r["params"], r["ref"], r["initial"])
            assert err < update_rtol, f"rank {rank}: {err:.2e} of the update away from the eager script"
            state = False
        else:
            for name, p in r["params"].items():
                torch.testing.assert_close(
                    p,
                    r["ref"][name],
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m: f"rank {rank} {name} vs the eager script: {m}",
                )
        moved = max((r["ref"][n] - r["initial"][n]).abs().max().item() for n in r["ref"])
        assert moved > 100 * atol, f"rank {rank}: training barely moved the parameters ({moved:.2e})"
        if state:
            assert sorted(r["state"]) == sorted(r["ref_state"]), f"rank {rank}: optimizer state keys differ"
            for k, s in r["ref_state"].items():
                for key, value in s.items():
                    torch.testing.assert_close(
                        torch.as_tensor(r["state"][k][key]).double(),
                        torch.as_tensor(value).double(),
                        rtol=rtol * 10,
                        atol=atol * 10,
                        msg=lambda m: f"rank {rank} optimizer state {k}.{key}: {m}",
                    )
    r0, r1 = per_rank[0], per_rank[1]
    assert r0["ref_losses"][0] != r1["ref_losses"][0], (
        "both ranks saw the same data: a missing reduction would not show"
    )
    for name in r0["params"]:
        if name not in not_reduced:
            assert torch.equal(r0["params"][name], r1["params"][name]), f"{name} differs between ranks"
