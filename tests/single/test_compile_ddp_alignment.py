"""How compile_core.compile's pieces line up with the buckets DDP really reduces (world size 1, gloo, with the
overlap recorder attached): the alignment holds when the user calls the DDP object directly and under the
reducer options gradient_as_bucket_view, find_unused_parameters and static_graph (with and without
accumulation), and the report confirms the pieces or warns when DDP's buckets cut through one."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.ddp_helpers import mlp, run_against_eager, x256

pytestmark = pytest.mark.usefixtures("pg")


def test_calling_the_ddp_object_directly_still_aligns():
    from ddp.overlap import OverlapRecorder

    model = DDP(mlp())
    OverlapRecorder.attach(model)
    compiled = compile_core.compile(model, backend="aot_eager", bucket_cap_mb=0.25)
    for step in range(2):
        model(x256(step)).sum().backward()  # the user keeps calling the DDP object
    report = compiled.report()
    # the buckets DDP reduced in step 2 are our 3 pieces (numbers on 2 ranks: test_ddp_options_multirank)
    assert report.observed_alignment["ok"], report.observed_alignment["text"]
    assert len(report.observed_alignment["buckets"]) == 3
    assert [g.step for g in report.graphs] == [1]


@pytest.mark.parametrize(
    "ddp_kwargs",
    [{"gradient_as_bucket_view": True}, {"find_unused_parameters": True}],
    ids=["gradient_as_bucket_view", "find_unused_parameters"],
)
def test_reducer_options_survive_alignment(ddp_kwargs):
    _, report = run_against_eager(
        mlp, x256, steps=3, backend="aot_eager", bucket_cap_mb=0.25, ddp_kwargs=ddp_kwargs, observe=True
    )
    assert report["observed_alignment"]["ok"], report["observed_alignment"]["text"]
    assert len(report["observed_alignment"]["buckets"]) == 3


def test_static_graph_reduces_our_pieces_from_step_2():
    """DDP's static reducer would rebuild its buckets after step 2 from the compiled backward's order (before
    session 64 the reducer was left to it, and the report said "skipped"); ours is static too, its first
    backward reducing every bucket at its end as DDP's own first did."""
    _, report = run_against_eager(
        mlp, x256, steps=4, backend="aot_eager", bucket_cap_mb=0.25, ddp_kwargs={"static_graph": True}, observe=True
    )
    assert report["alignment"]["status"] == "aligned", report["alignment"]
    assert report["observed_alignment"]["ok"], report["observed_alignment"]["text"]
    assert len(report["observed_alignment"]["buckets"]) == 3


def test_static_graph_swaps_at_a_synchronising_forward_not_under_no_sync():
    """Accumulation with a static graph (step 1 synchronises, as the eager script needs): a backward under
    `no_sync()` that reached the new static reducer before its first synchronising one would be counted into that
    first backward, and no bucket would be ready after it: the gradients would stay unreduced."""
    from ddp.overlap import OverlapRecorder

    torch.manual_seed(0)
    model, ref = mlp(), mlp()
    ref.load_state_dict(model.state_dict())
    ours, theirs = DDP(model, static_graph=True), DDP(ref, static_graph=True)
    OverlapRecorder.attach(ours)
    compiled = compile_core.compile(ours, backend="aot_eager", bucket_cap_mb=0.25)
    for step in range(4):
        for ddp_model in (compiled, theirs):
            if step:  # micro-batch 1 of 2 accumulates
                with ddp_model.no_sync():
                    ddp_model(x256(10 + step)).square().mean().backward()
            ddp_model(x256(step)).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"step {step} {name}")
            p.grad = q.grad = None
    report = compiled.report().to_dict()
    assert report["alignment"]["status"] == "aligned", report["alignment"]
    assert report["observed_alignment"]["ok"], report["observed_alignment"]["text"]


def train_with_recorder(ddp_kwargs, steps=3, **compile_kwargs):
    from ddp.overlap import OverlapRecorder

    torch.manual_seed(0)
    model = DDP(mlp(), **ddp_kwargs)
    OverlapRecorder.attach(model)
    compiled = compile_core.compile(model, backend="aot_eager", **compile_kwargs)
    for step in range(steps):
        compiled(x256(step)).square().mean().backward()
    return compiled.report()


def test_report_confirms_pieces_against_the_buckets_ddp_really_reduced():
    report = train_with_recorder({}, bucket_cap_mb=0.25)
    observed = report.to_dict()["observed_alignment"]
    assert observed["ok"] and len(observed["buckets"]) == 3
    assert "3/3 observed bucket boundaries" in str(report) and "WARNING" not in str(report)


def test_report_warns_when_ddp_buckets_cut_through_a_piece(monkeypatch):
    # A DDP option the swap cannot keep (the python reducer, DDP's mixed precision, which registers a comm hook of
    # its own: stood in for here) leaves DDP's own rebuilt buckets (0.3 MiB), which end inside our 0.25 MiB pieces
    from ddp import torch_ddp_reducer

    blocker = torch_ddp_reducer.DDPOptionBlocker("python_reducer", "DDP uses the python reducer")
    monkeypatch.setattr(torch_ddp_reducer, "reducer_swap_blocker", lambda ddp: blocker)
    report = train_with_recorder({"bucket_cap_mb": 0.3}, bucket_cap_mb=0.25)
    observed = report.to_dict()["observed_alignment"]
    assert not observed["ok"]
    assert observed["mismatched_params"]
    assert "WARNING: bucket" in str(report)
