"""What is live at a step's memory peak, by kind (benchmarks/memory_peak.py; issue 34, item 5): the replay of
a trace's allocations, then real steps of a parameter-heavy model under the profiler, where the kinds are known
in advance (all gradients live while a foreach AdamW step runs; none with the update inside the backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from benchmarks.memory_peak import BACKWARD_NODE, STEP_MARK, ZERO_GRAD, Alloc, Span, peak_by_kind, profiled_peak

MB = 2**20


def _trace():
    # forward 0-10 allocates A (activation, 4 MB) and T0 (2 MB, freed in the forward); backward 10-30
    # allocates G (gradient, 3 MB) and T1 (5 MB, freed at 25), frees A at 28; zero_grad 35-36 frees G; the
    # step also frees 1 MB allocated before it (a previous step's leftover) at 5 and keeps K (1 MB).
    a = [
        Alloc(1, 0xA, 4 * MB, "cpu"),
        Alloc(2, 0x70, 2 * MB, "cpu"),
        Alloc(3, 0x70, -2 * MB, "cpu"),
        Alloc(5, 0xF0, -1 * MB, "cpu"),
        Alloc(12, 0x6, 3 * MB, "cpu"),
        Alloc(20, 0x71, 5 * MB, "cpu"),
        Alloc(21, 0xC, 1 * MB, "cuda:0"),  # another device: not counted
        Alloc(25, 0x71, -5 * MB, "cpu"),
        Alloc(28, 0xA, -4 * MB, "cpu"),
        Alloc(29, 0xB, 1 * MB, "cpu"),
        Alloc(35.5, 0x6, -3 * MB, "cpu"),
    ]
    spans = [
        Span(STEP_MARK, 0, 40),
        Span(f"{BACKWARD_NODE}: MmBackward0", 10, 18),
        Span(f"{BACKWARD_NODE}: AddBackward0", 19, 30),
        Span(f"{ZERO_GRAD}#AdamW.zero_grad", 35, 36),
    ]
    return a, spans


def test_the_peak_is_taken_apart_into_gradients_activations_temporaries_and_what_was_held():
    allocs, spans = _trace()
    held = {"parameters": 3.0, "optimizer_state": 6.0, "ddp_buckets": 3.0, "gradients": 0.0, "gradient_bytes": 3.0}
    out = peak_by_kind(allocs, spans, device="cpu", held=held)
    assert out["measured"]
    # running: 4, 6, 4, 3, 6, 11 (peak at t=20), 6, 2, 3, 0
    assert out["step_peak_mb"] == pytest.approx(11.0)
    assert out["step_mb"] == {"gradients": 3.0, "activations": 4.0, "temporaries": 5.0, "kept": 0.0}
    assert out["held_freed_mb"] == pytest.approx(1.0)
    assert out["where"] == "backward"
    assert out["backward_fraction"] == pytest.approx(0.5)
    assert out["at_ms"] == pytest.approx(0.020)
    assert out["held_mb"] == {"parameters": 3.0, "optimizer_state": 6.0, "ddp_buckets": 3.0, "gradients": 0.0}
    assert out["peak_mb"] == pytest.approx(12.0 + 11.0)


def test_a_peak_in_the_forward_or_after_the_backward_says_so_and_what_outlives_the_step_is_kept():
    allocs, spans = _trace()
    early = [*allocs[:2], Alloc(2.5, 0x99, 20 * MB, "cpu"), Alloc(2.6, 0x99, -20 * MB, "cpu"), *allocs[2:]]
    out = peak_by_kind(early, spans, device="cpu")
    assert (out["where"], out["backward_fraction"], out["step_peak_mb"]) == ("forward", None, 26.0)
    assert "peak_mb" not in out  # nothing held was given: only the step's own share
    late = [*allocs, Alloc(32, 0xD, 9 * MB, "cpu")]  # after the backward, with K and G still live
    out = peak_by_kind(late, spans, device="cpu")
    assert out["where"] == "after backward"
    assert out["step_mb"] == {"gradients": 3.0, "activations": 0.0, "temporaries": 0.0, "kept": 10.0}


def test_a_trace_without_the_step_mark_or_the_devices_allocations_is_not_measured_and_says_why():
    allocs, spans = _trace()
    assert "no bench::step" in peak_by_kind(allocs, spans[1:], device="cpu")["reason"]
    assert "no allocation on cuda:1" in peak_by_kind(allocs, spans, device="cuda:1")["reason"]


class _Wide(nn.Module):
    # parameters dominate (4 x 512 x 512 floats, 4 MiB), activations are a few rows
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def _loss(out, y):
    return (out - y).square().mean()


def _gradient_mb(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / MB


def test_a_real_eager_step_holds_every_gradient_at_its_peak_while_the_foreach_update_runs(tmp_path):
    # the profiler's own trace, read back: kinds known in advance (a foreach AdamW step allocates its
    # intermediates while every .grad is live; zero_grad(set_to_none) then drops them)
    torch.manual_seed(0)
    model = _Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(2, 512), torch.randn(2, 512)

    def step():
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on
    out = profiled_peak(step, device="cpu", held=None, trace_path=tmp_path / "t.json")
    assert out["where"] == "after backward", out
    assert out["step_mb"]["gradients"] == pytest.approx(_gradient_mb(model), rel=1e-6)
    assert out["step_mb"]["activations"] < 0.1
    assert not (tmp_path / "t.json").exists()  # read once, then removed


@pytest.mark.timeout(300)
def test_with_the_update_inside_the_backward_no_gradient_is_live_at_the_peak(pg, tmp_path):
    # the same model as a train_step: ddp="in_graph" keeps every gradient until the update after the
    # backward, optimizer_in_backward=True updates each bucket in the backward and drops its gradients there
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compile_core

    peaks = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = _Wide()
        ddp = DDP(model, bucket_cap_mb=1)  # 4 buckets: each one's gradients can go before the next lands
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        step = compile_core.train_step(
            ddp, opt, _loss, backend="aot_eager", ddp="in_graph", optimizer_in_backward=in_backward
        )
        x, y = torch.randn(2, 512), torch.randn(2, 512)
        for _ in range(3):  # update 1 is eager for in_backward; 2 compiles the update into the backward
            step(x, y)
        assert step.report().to_dict()["optimizer_in_backward"]["active"] is in_backward
        peaks[in_backward] = profiled_peak(lambda: step(x, y), device="cpu", held=None, trace_path=tmp_path / "t")
    grads = _gradient_mb(model)
    # after the backward, torch's fused step (a foreach AdamW, compile_core/step/fused.py) allocates nothing:
    # the in-graph step peaks late in the backward, with all but the last bucket's gradients live
    assert peaks[False]["where"] == "backward", peaks[False]
    assert grads / 2 < peaks[False]["step_mb"]["gradients"] < grads, peaks[False]
    assert peaks[True]["step_mb"]["gradients"] == 0.0, peaks[True]
    # (the peaks themselves are not compared: under aot_eager the spliced updates run as unfused aten ops,
    # whose temporaries Inductor would fuse away)


def test_the_report_table_shows_each_modes_peak_by_kind_and_why_a_mode_has_none():
    from benchmarks.gpu_report import memory_table

    allocs, spans = _trace()
    held = {"parameters": 300.0, "optimizer_state": 600.0, "ddp_buckets": 0.0, "buffers": 0.5, "gradients": 0.0}
    measured = peak_by_kind(allocs, spans, device="cpu", held=held)
    modes = {
        "ours_step_in_backward": {"memory_at_peak": measured},
        "torch_savvy": {"memory_at_peak": {"measured": False, "reason": "reading the memory profile failed: X"}},
        "eager": {},
    }
    lines = memory_table({"modes": modes})
    assert lines[0].startswith("| mode | peak MB | where | parameters | optimizer state | ddp buckets | other held")
    row = "| `ours_step_in_backward` | 912 | backward at 50% | 300 | 600 | 0.0 | 0.5 | 3.0 | 4.0 | 5.0 | 0.0 |"
    assert lines[2] == row
    assert "reading the memory profile failed" in lines[3] and lines[4].startswith("| `eager` | - | not measured")
    assert memory_table({"modes": {"eager": {}}}) == []  # no mode measured: no table at all
