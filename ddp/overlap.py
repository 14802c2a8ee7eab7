"""See whether DDP's gradient all-reduce really overlapped the backward pass, and check bucket alignment.

Two independent tools live here:

* `OverlapRecorder` -- an opt-in DDP communication hook. It performs exactly what DDP's default hook does
  (divide the bucket by the world size, then all-reduce it asynchronously) and, per bucket per step, records
  which parameters (user names) the bucket held, how many bytes it carried, when its gradients were ready
  (the hook call) and when its all-reduce finished (the future's callback). From that it computes the overlap
  fraction and draws a timeline PNG. It only uses public DDP APIs (`register_comm_hook`, `GradBucket`), so it
  keeps working when `compile_core` swaps DDP's reducer (hooks are carried over).
* `check_alignment` -- pure: compares planned graph pieces with the buckets DDP really used.

Note (the overlap math, stated once)
------------------------------------
For one training step:

* backward compute window ``[S, E]``. ``S`` is the time passed to `OverlapRecorder.mark_backward_start`
  (the benchmark calls it right before ``loss.backward()``); when nobody marked the step, ``S`` falls back to
  the first bucket's ready time. ``E`` is the *last bucket's ready time*: that is the moment the last gradient
  was produced, so gradient compute is over. We deliberately do not use an autograd ``queue_callback`` for
  ``E``: DDP's own end-of-backward callback (queued earlier) blocks on every outstanding all-reduce, so a
  callback queued after it would stretch the "compute" window over the communication tail and report a fake
  100 % overlap.
* communication intervals ``[ready_i, done_i]`` per bucket. Buckets queue behind each other on the
  communication stream, so we take their *union* ``U`` (never the sum: two queued buckets must not count the
  same wall-clock millisecond twice).
* ``hidden = |U ∩ [S, E]|``, ``exposed = |U| - hidden``, ``overlap = hidden / |U|`` (``None`` when there was
  no communication at all).

Consequence worth knowing: the last bucket's all-reduce starts at ``E`` and is therefore always exposed, so
even a perfect pipeline reports less than 100 % -- the exposed tail is the number that costs step time.
Also, ``[S, E]`` is the whole backward, DDP's own bucket copies included: a model whose gradients all arrive
at once (one unsplit graph) still shows some overlap, because the first bucket's all-reduce runs while DDP
copies the remaining buckets. Compare exposed milliseconds, not only percentages, across modes.

Limitation: times are host-side `time.perf_counter()` stamps. With gloo (CPU) the future completes when the
all-reduce is done, so the stamps are real. With NCCL the future's callback runs when the work is enqueued on
the stream, not when the GPU finishes it; use the profiler for GPU-accurate numbers.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "AlignmentResult",
    "BucketAlignment",
    "BucketRecord",
    "OverlapRecorder",
    "OverlapStats",
    "RecorderConfig",
    "StepTimeline",
    "check_alignment",
    "covered_length",
    "interval_union",
    "overlap_stats",
    "plot_timeline",
]


# --------------------------------------------------------------------------------------------------------
# Pure interval math
# --------------------------------------------------------------------------------------------------------


def interval_union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge intervals into sorted, disjoint ones (touching intervals merge)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts; pass (start, end) with start <= end")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_length(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of `intervals` that falls inside `window`."""
    lo, hi = window
    total = 0.0
    for start, end in interval_union(intervals):
        total += max(0.0, min(end, hi) - max(start, lo))
    return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlapStats:
    """How much of one step's all-reduce time was hidden behind backward compute (see the module Note)."""

    backward_s: float
    """Length of the backward compute window [S, E]."""
    comm_s: float
    """Wall-clock time with at least one all-reduce in flight (union of bucket intervals)."""
    hidden_s: float
    """Part of `comm_s` inside the backward compute window."""
    exposed_s: float
    """Part of `comm_s` after (or before) the compute window: what communication adds to the step."""
    fraction: float | None
    """hidden_s / comm_s; None when the step had no communication."""

    @property
    def percent(self) -> float | None:
        return None if self.fraction is None else 100.0 * self.fraction

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "percent": self.percent}


def overlap_stats(*, compute: tuple[float, float], comm: Sequence[tuple[float, float]]) -> OverlapStats:
    """Overlap of communication intervals `comm` with the compute window `compute` (times in seconds)."""
    start, end = compute
    if end < start:
        raise ValueError(f"compute window {compute} ends before it starts; pass (start, end) with start <= end")
    comm_s = sum(e - s for s, e in interval_union(comm))
    hidden_s = covered_length(comm, compute)
    return OverlapStats(
        backward_s=end - start,
        comm_s=comm_s,
        hidden_s=hidden_s,
        exposed_s=comm_s - hidden_s,
        fraction=(hidden_s / comm_s) if comm_s > 0 else None,
    )


# --------------------------------------------------------------------------------------------------------
# Recorded data
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketRecord:
    """One bucket's all-reduce in one step."""

    step: int
    """Step number (0-based, counted by the recorder from the first backward it saw)."""
    index: int
    """DDP's bucket index (`GradBucket.index()`); DDP launches buckets in this order."""
    params: tuple[str, ...]
    """User names of the bucket's parameters, in DDP's order inside the bucket."""
    nbytes: int
    """Size of the flat gradient buffer that was all-reduced."""
    ready_s: float
    """perf_counter time the hook was called: every gradient of the bucket was ready."""
    done_s: float
    """perf_counter time the all-reduce's future completed."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTimeline:
    """Every bucket of one step plus the backward compute window."""

    step: int
    """Step number."""
    backward_start_s: float
    """S: marked backward start, or the first bucket's ready time when the step was not marked."""
    backward_end_s: float
    """E: the last bucket's ready time (the last gradient produced)."""
    start_marked: bool
    """True when S came from `mark_backward_start`, False when it fell back to the first ready time."""
    buckets: tuple[BucketRecord, ...]
    """Buckets in DDP's launch (index) order."""

    def overlap(self) -> OverlapStats:
        return overlap_stats(
            compute=(self.backward_start_s, self.backward_end_s),
            comm=[(b.ready_s, b.done_s) for b in self.buckets],
        )

    def bucket_names(self) -> list[list[str]]:
        return [list(b.params) for b in self.buckets]

    def to_dict(self) -> dict[str, Any]:
        t0 = self.backward_start_s
        return {
            "step": self.step,
            "start_marked": self.start_marked,
            "backward_ms": [0.0, 1e3 * (self.backward_end_s - t0)],
            "buckets": [
                {
                    "index": b.index,
                    "params": list(b.params),
                    "bytes": b.nbytes,
                    "ready_ms": 1e3 * (b.ready_s - t0),
                    "done_ms": 1e3 * (b.done_s - t0),
                }
                for b in self.buckets
            ],
            "overlap": self.overlap().to_dict(),
        }


# --------------------------------------------------------------------------------------------------------
# The recorder
# --------------------------------------------------------------------------------------------------------


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
                params, buffer.numel() * buffer.element_size(), ready, None
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
        import torch.distributed._functional_collectives as fcol

        self.bypassed = True
        group = self._group if self._group is not None else dist.group.WORLD
        grad.copy_(fcol.all_reduce(grad / self._world_size(), "sum", group))

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
            "median_overlap_percent": (100.0 * _median(fractions)) if fractions else None,
            "median_exposed_ms": 1e3 * _median(sorted(s.exposed_s for s in stats)) if stats else None,
            "median_comm_ms": 1e3 * _median(sorted(s.comm_s for s in stats)) if stats else None,
            "buckets": len(done[-1].buckets) if done else 0,
            "last_step": done[-1].to_dict() if done else None,
        }

    def plot_timeline(self, path: str | Path, *, step: int = -1, title: str = "") -> Path:
        """Draw one step's timeline to a PNG (see `plot_timeline`)."""
        return plot_timeline(self.timeline(step), path, title=title)


def _median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])


# --------------------------------------------------------------------------------------------------------
# Timeline picture
# --------------------------------------------------------------------------------------------------------


def plot_timeline(timeline: StepTimeline | dict[str, Any], path: str | Path, *, title: str = "") -> Path:
    """PNG timeline: a backward-compute lane on top, one lane per bucket below it.

    Each bucket bar runs from "gradients ready" to "all-reduce done"; the part inside the compute window is
    green (hidden), the part after it red (exposed). Accepts a `StepTimeline` or its `to_dict()`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = timeline.to_dict() if isinstance(timeline, StepTimeline) else timeline
    bwd_lo, bwd_hi = data["backward_ms"]
    buckets = data["buckets"]
    lanes = len(buckets) + 1
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.45 * lanes))
    ax.barh(0, bwd_hi - bwd_lo, left=bwd_lo, color="#4477aa", height=0.6)
    for lane, b in enumerate(buckets, start=1):
        lo, hi = b["ready_ms"], b["done_ms"]
        hidden_hi = max(lo, min(hi, bwd_hi))
        ax.barh(lane, hidden_hi - lo, left=lo, color="#44aa66", height=0.6)
        ax.barh(lane, hi - hidden_hi, left=hidden_hi, color="#cc4444", height=0.6)
    labels = ["backward compute"] + [
        f"bucket {b['index']}: {len(b['params'])} params, {b['bytes'] / 2**20:.2f} MiB" for b in buckets
    ]
    ax.set_yticks(range(lanes), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward start")
    pct = data["overlap"]["percent"]
    headline = f"overlap {pct:.0f}%" if pct is not None else "no communication"
    ax.set_title(
        f"{title + ' - ' if title else ''}step {data['step']}: {headline}, "
        f"exposed all-reduce {1e3 * data['overlap']['exposed_s']:.1f} ms",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [
        Patch(color="#4477aa", label="backward compute (start .. last gradient ready)"),
        Patch(color="#44aa66", label="all-reduce hidden behind backward"),
        Patch(color="#cc4444", label="all-reduce exposed"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------------------
# Alignment check (pure)
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketAlignment:
    """Whether one observed bucket ends exactly on a planned piece boundary."""

    index: int
    """Position of the bucket in the observed (DDP) order."""
    params: tuple[str, ...]
    """The bucket's parameters."""
    aligned: bool
    """True when the params of buckets 0..index are exactly the params of planned pieces 0..k for some k."""
    piece: int | None
    """When aligned: the planned piece the boundary falls after; otherwise the first planned piece cut by it."""
    split_before: tuple[str, ...] = ()
    """When misaligned: params of the cut piece(s) that fall in this bucket or an earlier one."""
    split_after: tuple[str, ...] = ()
    """When misaligned: params of the cut piece(s) that fall in a later bucket."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlignmentResult:
    """Outcome of `check_alignment`."""

    buckets: tuple[BucketAlignment, ...]
    """One entry per observed bucket."""
    only_planned: tuple[str, ...] = ()
    """Params in the plan that no observed bucket carries (e.g. unused or ignored by DDP)."""
    only_observed: tuple[str, ...] = ()
    """Params DDP all-reduced that the plan does not know."""
    unused_piece_boundaries: tuple[int, ...] = ()
    """Planned pieces whose end is not a bucket boundary (a graph split that buys no overlap)."""

    @property
    def ok(self) -> bool:
        return all(b.aligned for b in self.buckets) and not self.only_planned and not self.only_observed

    @property
    def mismatched(self) -> list[BucketAlignment]:
        return [b for b in self.buckets if not b.aligned]

    def mismatched_params(self) -> list[str]:
        """Every parameter name involved in any mismatch, in first-seen order."""
        seen: dict[str, None] = {}
        for b in self.mismatched:
            seen.update(dict.fromkeys(b.split_before + b.split_after))
        seen.update(dict.fromkeys(self.only_planned + self.only_observed))
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "buckets": [dataclasses.asdict(b) for b in self.buckets],
            "only_planned": list(self.only_planned),
            "only_observed": list(self.only_observed),
            "unused_piece_boundaries": list(self.unused_piece_boundaries),
            "mismatched_params": self.mismatched_params(),
        }

    def __str__(self) -> str:
        aligned = sum(b.aligned for b in self.buckets)
        lines = [
            f"bucket alignment: {aligned}/{len(self.buckets)} observed bucket boundaries fall on planned "
            f"piece boundaries" + (" - OK" if self.ok else "")
        ]
        for b in self.mismatched:
            lines.append(
                f"WARNING: bucket {b.index} ends inside planned piece {b.piece}: "
                f"{_names(b.split_before)} | {_names(b.split_after)} are split across buckets, so that piece's "
                "backward must finish before either bucket can start its all-reduce"
            )
        if self.only_planned:
            lines.append(f"WARNING: planned but never all-reduced by DDP: {_names(self.only_planned)}")
        if self.only_observed:
            lines.append(f"WARNING: all-reduced by DDP but missing from the plan: {_names(self.only_observed)}")
        if self.unused_piece_boundaries:
            lines.append(
                f"note: planned pieces {list(self.unused_piece_boundaries)} end where no bucket ends "
                "(extra graph splits that buy no overlap)"
            )
        return "\n".join(lines)


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


def _prefix_sets(groups: Sequence[Sequence[str]]) -> list[frozenset[str]]:
    out, acc = [], set()
    for group in groups:
        acc.update(group)
        out.append(frozenset(acc))
    return out


def _validate_groups(label: str, groups: Any) -> list[list[str]]:
    if isinstance(groups, (str, bytes)) or not all(
        isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in groups
    ):
        raise ValueError(
            f"check_alignment({label}={groups!r}): pass a list of lists of parameter names, "
            "e.g. [['head.weight'], ['blocks.1.fc.weight', 'blocks.1.fc.bias']]"
        )
    counts = collections.Counter(n for g in groups for n in g)
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        raise ValueError(f"check_alignment: {label} lists {dupes} more than once; each parameter belongs to one group")
    return [list(g) for g in groups]


def check_alignment(planned: Sequence[Sequence[str]], observed: Sequence[Sequence[str]]) -> AlignmentResult:
    """Compare planned graph pieces with DDP's observed buckets (both in backward order, user names).

    Observed bucket i is aligned when buckets 0..i hold exactly the parameters of planned pieces 0..k for
    some k -- i.e. the bucket ends where a piece ends, so the bucket's all-reduce can start as soon as that
    piece's backward finishes. Order inside a bucket or piece does not matter. Parameters present on only
    one side are reported separately and excluded from the boundary test.
    """
    planned = _validate_groups("planned", planned)
    observed = _validate_groups("observed", observed)
    planned_names = {n for g in planned for n in g}
    observed_names = {n for g in observed for n in g}
    common = planned_names & observed_names
    # Compare on the shared parameters only, so one unknown parameter produces one clear message instead
    # of making every later boundary look wrong.
    plan = [[n for n in g if n in common] for g in planned]
    obs = [[n for n in g if n in common] for g in observed]
    plan_prefixes = _prefix_sets(plan)
    piece_of = {n: i for i, g in enumerate(plan) for n in g}
    boundary_piece = {p: i for i, p in reversed(list(enumerate(plan_prefixes)))}

    results = []
    for i, prefix in enumerate(_prefix_sets(obs)):
        if prefix in boundary_piece:
            results.append(BucketAlignment(index=i, params=tuple(observed[i]), aligned=True, piece=boundary_piece[prefix]))
            continue
        cut = sorted({piece_of[n] for n in prefix} & {piece_of[n] for n in common - prefix})
        cut_names = [n for k in cut for n in plan[k]]
        results.append(
            BucketAlignment(
                index=i,
                params=tuple(observed[i]),
                aligned=False,
                piece=cut[0] if cut else None,
                split_before=tuple(n for n in cut_names if n in prefix),
                split_after=tuple(n for n in cut_names if n not in prefix),
            )
        )
    observed_prefixes = set(_prefix_sets(obs))
    unused = tuple(
        k for k, p in enumerate(plan_prefixes) if plan[k] and p not in observed_prefixes and k < len(plan) - 1
    )
    return AlignmentResult(
        buckets=tuple(results),
        only_planned=tuple(n for g in planned for n in g if n not in common),
        only_observed=tuple(n for g in observed for n in g if n not in common),
        unused_piece_boundaries=unused,
    )
