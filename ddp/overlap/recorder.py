"""`OverlapRecorder`: an opt-in DDP comm hook that all-reduces like DDP's default and times each bucket.

Per bucket per step it records which parameters (user names) the bucket held, how many bytes it
carried, when its gradients were ready (the hook call) and when its all-reduce finished (the
future's callback). It only uses public DDP APIs (`register_comm_hook`, `GradBucket`), so it keeps
working when `compile_core` swaps DDP's reducer (hooks are carried over). What it records is a
`StepTimeline` per step (`ddp/overlap/timeline.py`); the overlap math is in `ddp/overlap/intervals.py`.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp.overlap.intervals import OverlapStats
from ddp.overlap.plot import plot_timeline
from ddp.overlap.timeline import BucketRecord, StepTimeline
from ddp.torch_ddp import functional_all_reduce_sum


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """Options of `OverlapRecorder`."""

    keep_steps: int = 64
    """How many most recent complete steps to keep (older ones are dropped so long runs stay small)."""
    done_timeout_s: float = 30.0
    """How long `steps()` waits for in-flight all-reduce callbacks of the last step before giving up."""

    def __post_init__(self) -> None:
        if not isinstance(self.keep_steps, int) or self.keep_steps < 1:
            raise ValueError(f"RecorderConfig.keep_steps={self.keep_steps!r}: pass a positive int, e.g. 64")
        if not self.done_timeout_s > 0:
            raise ValueError(f"RecorderConfig.done_timeout_s={self.done_timeout_s!r}: pass a positive number")


class OverlapRecorder:
    """DDP comm hook that all-reduces like DDP's default and records per-bucket timing.

    Use `OverlapRecorder.attach(ddp_model)` before the first backward. Same gradients as DDP's default hook.
    """

    def __init__(
        self,
        names_by_param: dict[int, str],
        *,
        process_group: dist.ProcessGroup | None = None,
        config: RecorderConfig | None = None,
    ) -> None:
        self._names = dict(names_by_param)
        self._group = process_group
        self.config = config or RecorderConfig()
        self._lock = threading.Lock()
        self._step = 0
        self._marks: dict[int, float] = {}
        # step -> bucket index -> [params, nbytes, ready_s, done_s or None]; filled from two threads
        # (the hook runs on the autograd thread, the callback on the communication thread).
        self._open: dict[int, dict[int, list[Any]]] = {}
        self._last_seen: dict[int, bool] = {}
        self._done: list[StepTimeline] = []
        self._all_done = threading.Condition(self._lock)
        self.bypassed = False
        """True once DDP's python reducer called the hook per parameter (nothing can be recorded then)."""

    # -- wiring ------------------------------------------------------------------------------------------

    @classmethod
    def attach(
        cls,
        ddp_model: torch.nn.parallel.DistributedDataParallel,
        *,
        process_group: dist.ProcessGroup | None = None,
        config: RecorderConfig | None = None,
    ) -> "OverlapRecorder":
        """Register a recorder as `ddp_model`'s comm hook and return it."""
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"OverlapRecorder.attach got {type(ddp_model).__name__}; pass the DistributedDataParallel "
                "object itself (attach before torch.compile / compile_core.compile wraps it)"
            )
        names = {id(p): name for name, p in ddp_model.module.named_parameters()}
        recorder = cls(names, process_group=process_group, config=config)
        ddp_model.register_comm_hook(None, recorder._hook)
        return recorder

    def mark_backward_start(self, when: float | None = None) -> None:
        """Mark the backward start S of the current step (call right before `loss.backward()`)."""
        with self._lock:
            self._marks[self._step] = time.perf_counter() if when is None else when

    def _world_size(self) -> int:
        return dist.get_world_size(self._group)

    def _name_of(self, param: torch.Tensor) -> str:
        # A parameter we never saw (e.g. swapped by a wrapper after attach) keeps a readable placeholder
        # instead of failing the training step.
        return self._names.get(id(param), f"<unnamed {tuple(param.shape)}>")

    # No annotations on purpose: DDP compares them with the real classes, and `from __future__ import
    # annotations` turns them into strings that fail that check.
    def _hook(self, state, bucket):  # (None, dist.GradBucket) -> torch.futures.Future[torch.Tensor]
        if isinstance(bucket, tuple):
            return self._python_reducer_passthrough(*bucket)
        ready = time.perf_counter()
        buffer = bucket.buffer()
        params = tuple(self._name_of(p) for p in bucket.parameters())
        with self._lock:
            step = self._step
            self._open.setdefault(step, {})[bucket.index()] = [
                params,
                buffer.numel() * buffer.element_size(),
                ready,
                None,
            ]
            if bucket.is_last():
                self._last_seen[step] = True
                self._step += 1
        # Same arithmetic as torch's default allreduce_hook: average by pre-dividing, then sum.
        buffer.div_(self._world_size())
        fut = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
        index = bucket.index()

        def finished(f: torch.futures.Future) -> torch.Tensor:
            self._record_done(step, bucket_index=index, when=time.perf_counter())
            return f.value()[0]

        return fut.then(finished)

    def _python_reducer_passthrough(self, grad: torch.Tensor, _param: torch.Tensor) -> None:
        """DDP's python reducer (optimize_ddp="python_reducer") calls hooks per parameter under compiled
        autograd: there are no buckets to time, so do exactly what DDP does without a hook and record nothing.
        """
        self.bypassed = True
        group = self._group if self._group is not None else dist.group.WORLD
        grad.copy_(functional_all_reduce_sum(grad / self._world_size(), group))

    def _record_done(self, step: int, *, bucket_index: int, when: float) -> None:
        with self._lock:
            self._open[step][bucket_index][3] = when
            self._maybe_close(step)
            self._all_done.notify_all()

    def _maybe_close(self, step: int) -> None:
        """Move a step to the finished list once its last bucket was seen and every bucket completed."""
        buckets = self._open.get(step)
        if not buckets or not self._last_seen.get(step) or any(b[3] is None for b in buckets.values()):
            return
        records = tuple(
            BucketRecord(step=step, index=i, params=b[0], nbytes=b[1], ready_s=b[2], done_s=b[3])
            for i, b in sorted(buckets.items())
        )
        first_ready = min(r.ready_s for r in records)
        mark = self._marks.pop(step, None)
        self._done.append(
            StepTimeline(
                step=step,
                backward_start_s=min(mark, first_ready) if mark is not None else first_ready,
                backward_end_s=max(r.ready_s for r in records),
                start_marked=mark is not None,
                buckets=records,
            )
        )
        del self._open[step]
        del self._last_seen[step]
        del self._done[: -self.config.keep_steps]

    # -- reading -----------------------------------------------------------------------------------------

    def steps(self) -> list[StepTimeline]:
        """Every complete step kept so far (waits briefly for all-reduces still in flight)."""
        deadline = time.monotonic() + self.config.done_timeout_s
        with self._lock:
            while any(self._last_seen.get(s) for s in self._open) and time.monotonic() < deadline:
                self._all_done.wait(timeout=0.05)
            return list(self._done)

    def timeline(self, step: int = -1) -> StepTimeline:
        """One step's timeline: `step` is a recorder step number, or -1 for the latest complete step."""
        done = self.steps()
        if not done:
            why = (
                "DDP's python reducer (optimize_ddp='python_reducer') reduces per parameter, not per bucket"
                if self.bypassed
                else "run at least one backward on the DDP model it was attached to"
            )
            raise ValueError(f"OverlapRecorder has no complete step to show: {why}")
        if step == -1:
            return done[-1]
        for timeline in done:
            if timeline.step == step:
                return timeline
        raise ValueError(f"step={step} is not recorded; recorded steps are {[t.step for t in done]} (or pass -1)")

    def observed_buckets(self, step: int = -1) -> list[list[str]]:
        """User parameter names per bucket, in DDP's real bucket order, for one step."""
        return self.timeline(step).bucket_names()

    def overlap(self, step: int = -1) -> OverlapStats:
        return self.timeline(step).overlap()

    def summary(self, *, skip_first: int = 1) -> dict[str, Any]:
        """JSON-ready summary: median overlap over the kept steps, skipping the first `skip_first` steps.

        The first step is skipped by default because DDP rebuilds its buckets after it.
        """
        done = [t for t in self.steps() if t.step >= skip_first] or self.steps()
        stats = [t.overlap() for t in done]
        fractions = sorted(s.fraction for s in stats if s.fraction is not None)
        return {
            "steps": [t.step for t in done],
            "median_overlap_percent": (100.0 * statistics.median(fractions)) if fractions else None,
            "median_exposed_ms": 1e3 * statistics.median(s.exposed_s for s in stats) if stats else None,
            "median_comm_ms": 1e3 * statistics.median(s.comm_s for s in stats) if stats else None,
            "buckets": len(done[-1].buckets) if done else 0,
            "last_step": done[-1].to_dict() if done else None,
        }

    def plot_timeline(self, path: str | Path, *, step: int = -1, title: str = "") -> Path:
        """Draw one step's timeline to a PNG (see `ddp.overlap.plot.plot_timeline`)."""
        return plot_timeline(self.timeline(step), path, title=title)
