"""Overlap really happens for a compiled split model on 2 ranks (gloo), from the overlap recorder's stamps.

A compiled piece hands autograd all of its gradients at once, when its backward finishes; DDP starts a
bucket's all-reduce when its last gradient arrives. With one piece per bucket, the first bucket's
all-reduce therefore starts after the LAST piece's backward, while the other pieces still compute; the
backward's last gradient (the last bucket's ready time) comes much later. Compiled as ONE graph
(ddp="none", the control), every gradient arrives at the end and all buckets start together.

The pieces are large enough (4 x 1 MiB layers, batch 256) that each piece's backward takes milliseconds,
well above the cost of launching an all-reduce.

The claim is about compute on the host: the recorder's stamps are host-side, and under nccl they mark
when kernels are enqueued, not when the GPU computes (ddp/overlap/intervals.py). So the ranks run on
gloo and the CPU even where GPUs are visible.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.multi_gpu.ddp_compare import ok, planned_buckets, run_scenarios
from tests.ranks import run_ranks

# One launch for the whole module; the *_multirank.py name keeps its tests on one xdist worker.
pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(300)]

WIDTH, LAYERS, BATCH = 512, 4, 256
CAP_MB = 1.0  # one 512x512 layer (1.002 MiB) per bucket, for DDP's own buckets and for our pieces
STEPS = 4


def _model() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _recorded(rank: int, ddp_mode: str) -> dict:
    import compile_core
    from ddp.overlap import OverlapRecorder

    torch.manual_seed(0)
    ddp = DDP(_model(), bucket_cap_mb=CAP_MB)
    recorder = OverlapRecorder.attach(ddp)  # before compiling: the reducer swap carries the hook over
    compiled = compile_core.compile(ddp, backend="aot_eager", ddp=ddp_mode)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        loss = compiled(torch.randn(BATCH, WIDTH, generator=g)).square().mean()
        recorder.mark_backward_start()
        loss.backward()
        ddp.zero_grad(set_to_none=True)
    report = compiled.report().to_dict()
    return {"steps": [t.to_dict() for t in recorder.steps()], "report": report}


SCENARIOS = {
    "split": lambda rank: _recorded(rank, "split"),
    "one_graph": lambda rank: _recorded(rank, "none"),
}


def _all_scenarios(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_scenarios, world_size=2, timeout=240, backend="gloo")


def _remaining_backward(step: dict) -> float:
    """Share of the backward (from its start to the last gradient) still to compute when the first
    bucket's all-reduce was issued."""
    first_ready = step["buckets"][0]["ready_ms"]
    last_ready = step["backward_ms"][1]  # the last bucket's ready time: the last gradient produced
    return (last_ready - first_ready) / last_ready if last_ready > 0 else 0.0


def test_first_allreduce_starts_while_the_split_backward_still_computes(results):
    for rank, r in enumerate(ok(results, "split")):
        planned = planned_buckets(r["report"])
        assert len(planned) == LAYERS
        aligned = r["steps"][1:]  # step 0 ran on DDP's initial buckets; we align before step 1
        assert len(aligned) == STEPS - 1
        for step in aligned:
            # what DDP reduced in this step is our plan: one bucket per piece, in backward order
            assert [b["params"] for b in step["buckets"]] == planned, f"rank {rank} step {step['step']}"
            assert step["start_marked"]
        # The claim itself: the first bucket's all-reduce was issued strictly before the backward's last
        # gradient existed, with a good part of the backward still to run (3 of 4 pieces ideally; seen
        # 0.73-0.9). Asserted for the best step: one descheduled step on a loaded machine must not decide.
        best = max(aligned, key=_remaining_backward)
        first, last = best["buckets"][0], best["buckets"][-1]
        assert first["ready_ms"] < last["ready_ms"], f"rank {rank}: no bucket started before the last gradient"
        assert _remaining_backward(best) > 0.5, (
            f"rank {rank}: only {_remaining_backward(best):.0%} of the backward remained when the first "
            f"all-reduce started: {best}"
        )
        assert r["report"]["observed_alignment"]["ok"], r["report"]["observed_alignment"]["text"]


def test_one_graph_control_starts_every_allreduce_at_the_end(results):
    # The control shows the measurement tells the difference: compiled whole, the gradients all arrive
    # when the single backward ends; what separates the buckets' start times then is only DDP's own
    # copying and launching (seen: 0.05-0.26 of the backward "remaining", against 0.73-0.9 split).
    split = [_remaining_backward(s) for r in ok(results, "split") for s in r["steps"][1:]]
    whole = [_remaining_backward(s) for r in ok(results, "one_graph") for s in r["steps"][1:]]
    for r in ok(results, "one_graph"):
        assert [g["pieces"] for g in r["report"]["graphs"]] == [1]
        assert all(len(s["buckets"]) >= LAYERS for s in r["steps"][1:])  # DDP's own ~1 MiB buckets
    assert statistics.median(whole) < statistics.median(split) / 2, (whole, split)
