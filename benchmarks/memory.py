"""Per-rank memory: the process's peak RSS, and the peak over the timed steps only.

The process peak (`ru_maxrss`) is set by compilation (Dynamo, Inductor and the C++ compiler driver
allocate far more than training does), so it cannot show what a mode costs while it trains. Linux lets a
process reset its own high-water mark: writing "5" to /proc/self/clear_refs sets VmHWM back to the current
RSS (Documentation/admin-guide/mm/soft-dirty.rst, proc.rst). Reset right before the timed steps, read
VmHWM after them: the steady-state peak. It still counts pages the allocator keeps after a free, so the
step's tensor peak from the profiler (benchmarks/profile_overlap.py) is the sharper number for freed
gradients; this one is what the machine really has to provide.

The reset also resets `ru_maxrss` (both read the kernel's one high-water mark), so `PeakTracker` keeps
the process peak from before the reset itself.

The profiler's tensor peak is relative: the most a step held *above* what was alive when it began. What was
alive then differs between modes (DDP's reducer keeps a flat bucket copy of every gradient across steps;
the in-graph modes release it, and `optimizer_in_backward` leaves no gradient alive after the step), so
`training_state_mb` counts the tensors a job holds between steps, by kind, and the step's absolute tensor
peak is that plus the relative one.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def process_peak_rss_mb() -> float:
    """High-water mark of the whole process so far (compilation included), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it (then read_peak is None)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def read_peak_mb() -> float | None:
    """VmHWM (peak RSS since the last reset, or since start), MiB; None where /proc is unavailable."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) / 1024.0 if match else None


class PeakTracker:
    """The process peak and the steady-state peak of one job: `start_steady()` right before the timed
    steps, `stop_steady()` right after them, `process_peak_mb()` at the end."""

    def __init__(self) -> None:
        self._before_reset = 0.0
        self.steady_mb: float | None = None
        """Peak RSS over the timed steps; None where the high-water mark cannot be reset."""
        self.start_mb: float | None = None
        """RSS when the timed steps began (the high-water mark right after the reset)."""
        self._reset = False

    def start_steady(self) -> None:
        self._before_reset = process_peak_rss_mb()
        self._reset = reset_peak()
        self.start_mb = read_peak_mb() if self._reset else None

    def stop_steady(self) -> None:
        if self._reset and self.steady_mb is None:
            self.steady_mb = read_peak_mb()

    @property
    def growth_mb(self) -> float | None:
        """How far the timed steps raised RSS above where it stood when they began: what the steps
        themselves need (gradients, activations, buffers), without the code and caches loaded before."""
        if self.steady_mb is None or self.start_mb is None:
            return None
        return self.steady_mb - self.start_mb

    def process_peak_mb(self) -> float:
        """Peak RSS of the whole process, compilation included (across the reset)."""
        return max(self._before_reset, process_peak_rss_mb())


def training_state_mb(model: Any, optimizer: Any, ddp: Any | None) -> dict[str, float]:
    """Tensor memory the training state holds between two steps, by kind, MiB (each storage counted once,
    in the first kind that holds it): `parameters`, `buffers`, `gradients` (the `.grad` tensors alive now),
    `optimizer_state`, `ddp_buckets` (DDP's reducer; allocates a zero copy of them for a moment, so call it
    outside anything measured), and `gradient_bytes` (what one gradient per trainable parameter takes: the
    yardstick of the issue's memory target, not a holding)."""
    import torch

    seen: set[tuple[str, int]] = set()

    def held(tensors) -> float:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total / 2**20

    params = list(model.parameters())
    out = {
        "parameters": held(params),
        "buffers": held(model.buffers()),
        "optimizer_state": held(v for state in optimizer.state.values() for v in state.values()),
    }
    buckets = 0.0
    if ddp is not None:
        from ddp.torch_ddp import reducer_bucket_bytes

        buckets = reducer_bucket_bytes(ddp) / 2**20
    grads = held(p.grad for p in params if p.grad is not None)
    # With gradient_as_bucket_view the .grad tensors are views into those buckets (already counted), unless
    # the buckets were released (the in-graph modes: then the reducer holds a 1-element placeholder).
    as_views = ddp is not None and getattr(ddp, "gradient_as_bucket_view", False) and buckets >= grads > 0
    out["gradients"] = 0.0 if as_views else grads
    out["ddp_buckets"] = buckets
    out["gradient_bytes"] = sum(p.numel() * p.element_size() for p in params if p.requires_grad) / 2**20
    return out


def held_mb(state: dict[str, float] | None) -> float | None:
    """The tensor memory a `training_state_mb` result holds (its yardstick left out)."""
    if state is None:
        return None
    return sum(v for k, v in state.items() if k != "gradient_bytes")


def tensor_memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: the step's tensor peak above its start, what the job held at the start (by kind), and
    their sum, the step's absolute tensor peak."""
    peaks = [p.get("tensor_peak_mb") for p in ranks]
    states = [p.get("state_mb") for p in ranks]
    held = [held_mb(s) for s in states]
    return {
        "tensor_peak_mb_per_rank": peaks,
        "state_mb_per_rank": states,
        "held_mb_per_rank": held,
        "absolute_peak_mb_per_rank": [h + p if h is not None and p is not None else None for h, p in zip(held, peaks)],
    }


MEMORY_REFERENCE = "ours_step"
"""The mode the memory savings are read against: the same compiled step with DDP's reducer (the issue's
yardstick: `optimizer_in_backward` must hold at least 75% of the gradient bytes less at its peak)."""


def gradient_savings(modes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For each finished mode with an absolute step tensor peak: how much lower that peak is than
    `MEMORY_REFERENCE`'s (worst rank of each), in MiB and as a share of the model's gradient bytes."""
    ref = (modes.get(MEMORY_REFERENCE) or {}).get("profile") or {}
    ref_peak = _worst(ref.get("absolute_peak_mb_per_rank"))
    grads = _worst([(s or {}).get("gradient_bytes") for s in ref.get("state_mb_per_rank") or []])
    if ref_peak is None or not grads:
        return []
    out = []
    for mode, agg in modes.items():
        prof = (agg.get("profile") or {}) if agg.get("status") == "ok" else {}
        peak = _worst(prof.get("absolute_peak_mb_per_rank"))
        if mode == MEMORY_REFERENCE or peak is None:
            continue
        saved = ref_peak - peak
        out.append({"mode": mode, "peak_mb": peak, "saved_mb": saved, "gradient_mb": grads, "share": saved / grads})
    return out


def _worst(values: list[float | None] | None) -> float | None:
    present = [v for v in values or [] if v is not None]
    return max(present) if present else None
