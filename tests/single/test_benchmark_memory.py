"""The benchmark's memory measurements (benchmarks/memory.py): the steady-state RSS high-water mark taken after
resetting the process peak, and the per-category count of what a DDP training job holds between steps
(parameters, gradients, DDP's buckets, optimizer state, buffers), each counted once."""

from __future__ import annotations

import pytest
import torch


def test_steady_peak_resets_below_an_earlier_high_water_mark_and_the_process_peak_survives_it():
    from benchmarks import memory

    if not memory.reset_peak() or memory.read_peak_mb() is None:
        pytest.skip("this kernel does not let a process reset VmHWM")
    # Anonymous mappings, not bytearrays: malloc may serve a bytearray from heap pages an earlier test in
    # this worker already made resident (then RSS does not grow); a fresh mapping always faults new pages.
    big = _touched_mapping(64)
    before = memory.read_peak_mb()
    big.close()
    tracker = memory.PeakTracker()
    tracker.start_steady()
    small = _touched_mapping(8)
    tracker.stop_steady()
    assert tracker.steady_mb < before - 32, (before, tracker.steady_mb)
    assert 6 < tracker.growth_mb < 32, tracker.growth_mb  # the 8 MiB the "steps" touched, not the baseline
    # the reset also reset ru_maxrss: the tracker remembers the peak from before it
    assert memory.process_peak_rss_mb() < before - 32
    assert tracker.process_peak_mb() >= before - 1
    small.close()


def test_training_state_counts_ddp_buckets_gradients_and_optimizer_state_once_each(pg):
    # What a job holds between steps; the step's absolute tensor peak is this plus the profiler's peak above it.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.memory import held_mb, training_state_mb
    from ddp.torch_ddp_reducer import release_reducer_buckets

    def state_after_one_step(**ddp_kwargs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))
        ddp = DDP(model, **ddp_kwargs)
        opt = torch.optim.AdamW(model.parameters())
        ddp(torch.randn(4, 256)).sum().backward()
        opt.step()
        return model, opt, ddp

    model, opt, ddp = state_after_one_step()
    mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    got = training_state_mb(model, opt, ddp)
    assert got["parameters"] == pytest.approx(mib) and got["gradient_bytes"] == pytest.approx(mib)
    assert got["gradients"] == pytest.approx(mib)  # .grad alive (no zero_grad yet)
    assert got["ddp_buckets"] == pytest.approx(mib)  # DDP's reducer: a second copy of every gradient
    assert got["optimizer_state"] == pytest.approx(2 * mib, rel=0.01)  # exp_avg, exp_avg_sq (+ step scalars)
    assert got["buffers"] == pytest.approx((2 * 256 * 4 + 8) / 2**20)  # running mean/var + num_batches_tracked
    assert held_mb(got) == pytest.approx(sum(v for k, v in got.items() if k != "gradient_bytes"))
    opt.zero_grad(set_to_none=True)
    release_reducer_buckets(ddp)  # what the in-graph modes do: no bucket copy is held any more
    after = training_state_mb(model, opt, ddp)
    assert after["gradients"] == 0.0 and after["ddp_buckets"] < 0.001
    # with gradient_as_bucket_view the .grad tensors are the buckets: counted once, as buckets
    model, opt, ddp = state_after_one_step(gradient_as_bucket_view=True)
    viewed = training_state_mb(model, opt, ddp)
    assert viewed["gradients"] == 0.0 and viewed["ddp_buckets"] == pytest.approx(mib)


def _touched_mapping(mib: int):
    import mmap

    region = mmap.mmap(-1, mib * 2**20)
    for i in range(0, len(region), mmap.PAGESIZE):  # touch every page: RSS really grows
        region[i] = 1
    return region
