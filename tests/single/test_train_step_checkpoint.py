"""Checkpoints of a compile_core.train_step run (one process, DDP-wrapped model): the saved model, optimizer and
scheduler state are in the user's format, load into an eager DDP loop that then ends where an uninterrupted
eager run ends, and load back into a compiled step that picks up the saved learning rate."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from compile_core.step import train_step
from tests.single.train_step_helpers import (
    BACKEND,
    assert_params_close,
    batches,
    eager_ddp_run,
    fresh_dynamo,  # noqa: F401 (an autouse fixture)
    make_setup,
    process_group,  # noqa: F401 (an autouse fixture)
    tiny_model,
)


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(blob: bytes):
    # A fresh copy per load: Optimizer.load_state_dict keeps the state tensors it is given, so two
    # optimizers loaded from one in-memory dict would share (and both update) exp_avg & co.
    return torch.load(io.BytesIO(blob), weights_only=True)


def test_checkpoint_loads_into_eager_and_resumes_identically():
    data = batches(6)
    model, opt, sched = make_setup("adamw", "cosine")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, lr_scheduler=sched)
    for x, y in data[:3]:
        step(x, y)
    blob = _save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    ckpt = _load(blob)

    # The checkpoint is in the user's format: plain floats, the user's flags, user's parameter names.
    for group in ckpt["opt"]["param_groups"]:
        assert isinstance(group["lr"], float) and all(isinstance(b, float) for b in group["betas"])
        assert group["betas"] == (0.9, 0.999) and group["capturable"] is False
    assert set(ckpt["model"]) == set(DDP(tiny_model()).state_dict())
    assert all(isinstance(v, float) for v in ckpt["sched"]["_last_lr"]), ckpt["sched"]
    assert all(isinstance(v, float) for v in sched.get_last_lr())

    resumed, resumed_opt, resumed_sched = make_setup("adamw", "cosine", seed=123)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_sched.load_state_dict(ckpt["sched"])
    eager_ddp_run(resumed, resumed_opt, resumed_sched, data[3:])

    ref_model, ref_opt, ref_sched = make_setup("adamw", "cosine")
    eager_ddp_run(ref_model, ref_opt, ref_sched, data)
    assert_params_close(resumed, ref_model)
    assert resumed_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)

    # ... and back into a compiled step, which must pick up the loaded LR.
    again, again_opt, again_sched = make_setup("adamw", "cosine", seed=7)
    ckpt = _load(blob)
    again.load_state_dict(ckpt["model"])
    again_opt.load_state_dict(ckpt["opt"])
    again_sched.load_state_dict(ckpt["sched"])
    again_step = train_step(again, again_opt, F.mse_loss, backend=BACKEND, lr_scheduler=again_sched)
    for x, y in data[3:]:
        again_step(x, y)
    assert_params_close(again, ref_model)


MODES = {
    "split": {"ddp": "split"},
    "in_graph": {"ddp": "in_graph"},
    "in_backward": {"ddp": "in_graph", "optimizer_in_backward": True},
}


@pytest.mark.parametrize("warmed_up", [False, True], ids=["load_first", "load_after_a_step"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_distributed_checkpoint_round_trip_resumes_as_eager(tmp_path, mode, warmed_up):
    """torch.distributed.checkpoint (torchtitan's way: `get_state_dict` / `set_state_dict` around `dcp.save` and
    `dcp.load`) of a train step: loaded into a fresh step, before its first update or after one (a job that
    compiled before it loaded; the load replaces the optimizer state the compiled update holds), the run
    ends where an uninterrupted eager DDP run ends."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data = batches(6)
    model, opt, _ = make_setup("adamw")
    step = train_step(model, opt, F.mse_loss, backend=BACKEND, **MODES[mode])
    for x, y in data[:3]:
        step(x, y)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "ckpt"))

    resumed, resumed_opt, _ = make_setup("adamw", seed=123)
    resumed_step = train_step(resumed, resumed_opt, F.mse_loss, backend=BACKEND, **MODES[mode])
    if warmed_up:
        for x, y in batches(2, seed=99):
            resumed_step(x, y)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for x, y in data[3:]:
        resumed_step(x, y)

    ref_model, ref_opt, _ = make_setup("adamw")
    eager_ddp_run(ref_model, ref_opt, None, data)
    assert_params_close(resumed, ref_model)
    assert resumed_opt.state_dict()["state"][0]["step"] == ref_opt.state_dict()["state"][0]["step"] == 6
