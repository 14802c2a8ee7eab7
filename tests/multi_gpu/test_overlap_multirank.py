"""The overlap recorder on real eager DDP with 2 ranks (gloo on CPU, nccl with 2 GPUs): buckets, bytes,
timing order, gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from tests.ranks import run_ranks, to_rank_device, wrap_ddp

CFG = GPTConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
STEPS = 3


def _recorded_run(rank: int, world_size: int) -> dict:
    from ddp.overlap import OverlapRecorder

    torch.manual_seed(0)
    model = to_rank_device(GPT(CFG))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a tiny cap forces many buckets, so order and boundaries are actually exercised
    ddp = wrap_ddp(model, bucket_cap_mb=0.01)
    recorder = OverlapRecorder.attach(ddp)
    for step in range(STEPS):
        x, y = to_rank_device(synthetic_batch(CFG, 2, 8, step=step, rank=rank))
        loss = lm_loss(ddp(x), y)
        recorder.mark_backward_start()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

    # the recorder's all-reduce must give DDP's default result: the mean over ranks of the local gradients
    local = to_rank_device(GPT(CFG))
    local.load_state_dict(reference)
    x, y = to_rank_device(synthetic_batch(CFG, 2, 8, step=STEPS - 1, rank=rank))
    lm_loss(local(x), y).backward()
    max_err = 0.0
    for name, p in local.named_parameters():
        mean = p.grad.detach().clone()
        dist.all_reduce(mean)
        mean /= world_size
        max_err = max(max_err, (mean - grads[name]).abs().max().item())

    return {
        "steps": [t.to_dict() for t in recorder.steps()],
        "observed": recorder.observed_buckets(),
        "summary": recorder.summary(),
        "param_bytes": {n: p.numel() * p.element_size() for n, p in model.named_parameters()},
        "max_grad_err": max_err,
    }


@pytest.mark.multi_gpu
@pytest.mark.timeout(180)
def test_recorder_sees_every_parameter_once_with_ordered_times():
    results = run_ranks(_recorded_run, world_size=2, timeout=150)
    for rank, res in enumerate(results):
        assert [s["step"] for s in res["steps"]] == list(range(STEPS)), f"rank {rank}"
        assert res["max_grad_err"] < 1e-5, f"rank {rank}: gradients differ from DDP's default averaging"
        param_bytes = res["param_bytes"]
        for step in res["steps"]:
            names = [n for b in step["buckets"] for n in b["params"]]
            assert sorted(names) == sorted(param_bytes), f"rank {rank} step {step['step']}: params differ"
            assert sum(b["bytes"] for b in step["buckets"]) == sum(param_bytes.values())
            if step["step"] >= 1:  # DDP starts with one bucket and rebuilds by ready order after step 0
                assert len(step["buckets"]) > 2, "bucket_cap_mb=0.01 should give several buckets"
            assert [b["index"] for b in step["buckets"]] == list(range(len(step["buckets"])))
            start, end = step["backward_ms"]
            assert start == 0.0 and end >= 0.0
            readies = [b["ready_ms"] for b in step["buckets"]]
            assert readies == sorted(readies), "DDP launches buckets in index order"
            assert max(readies) == pytest.approx(end)
            for b in step["buckets"]:
                assert 0.0 <= b["ready_ms"] <= b["done_ms"], f"bucket {b['index']} finished before it was ready"
            pct = step["overlap"]["percent"]
            assert pct is not None and 0.0 <= pct <= 100.0
        assert res["observed"] == [b["params"] for b in res["steps"][-1]["buckets"]]
        assert res["summary"]["buckets"] == len(res["observed"])
    # both ranks run the same bucket layout (DDP would hang otherwise)
    assert results[0]["observed"] == results[1]["observed"]
