"""Make DDP's gradient buckets coincide with our graph pieces.

Note [Bucket alignment]
-----------------------
Background: DDP's reducer all-reduces a bucket once every gradient in it is ready. A compiled piece
(forward + AOT backward run as one autograd Function) hands all of its parameter gradients to autograd
at once, when the piece's backward finishes. A bucket that spans two pieces therefore waits for the
second piece's backward, and the overlap of that bucket is lost.

DDP does not keep the buckets it was built with: with torch 2.13 defaults every parameter sits in one
bucket during iteration 1, and at the start of iteration 2 the reducer rebuilds its buckets from the
order in which gradients became ready, cutting at `first_bucket_bytes_cap` / `bucket_bytes_cap`.
PyTorch's DDPOptimizer plans its pieces in forward-graph order with the same caps but never looks at
the rebuilt buckets, so the two drift apart (offset boundaries, a different count).

Algorithm: once every graph of iteration 1 is planned, and before iteration 2 runs, we give the DDP
module a new `Reducer` whose buckets are exactly our plan (explicit `bucket_indices`) and whose
per-bucket caps for a later rebuild (`bucket_bytes_cap_list`, new in torch 2.13) are our buckets'
byte totals. Gradients of one piece become ready together, so a rebuild from the observed ready
order cuts at the same places. Comm hooks the user registered on the old reducer are registered again.
Every rank must reduce the same buckets: the ranks exchange their layouts first and all take rank 0's
(DDP does the same when it rebuilds); a rank whose own plan differed is named in the report.

Notes: we leave the reducer alone (and say why in the report) when DDP is in a mode the swap cannot
preserve: the python reducer, mixed precision, delayed all-reduce params, or a bucket that mixes
dtypes or devices. Parameters that no graph touched (used eagerly between graph breaks, or unused)
go to one trailing bucket so that every parameter is still reduced.

Debugging: `CompiledModel.report()` lists planned buckets and this alignment's state; with a
`ddp.overlap.OverlapRecorder` attached it also compares them with the buckets DDP really reduced.
Tests record DDP's real buckets through a comm hook and compare.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp import torch_ddp
from ddp.splitter import SplitGraph

log = logging.getLogger(__name__)

STATUSES = ("pending", "aligned", "skipped", "not applicable", "not ours")
"""pending: nothing swapped yet; aligned: DDP reduces our buckets; skipped: DDP kept its own (why in
`detail`); not applicable: no split (ddp='none' or no DDP); not ours: ddp='torch' (PyTorch buckets)."""


def alignment_blocker(ddp: DistributedDataParallel, buckets: Sequence[Sequence[torch.nn.Parameter]]) -> str | None:
    """Why the reducer of `ddp` cannot be rebuilt to `buckets` (None when it can)."""
    blocker = torch_ddp.reducer_swap_blocker(ddp)
    if blocker is not None:
        return blocker
    for i, bucket in enumerate(buckets):
        keys = {(p.dtype, p.device) for p in bucket}
        if len(keys) > 1:
            return f"bucket {i} mixes dtypes/devices {sorted(map(str, keys))}"
    return None


def agree_across_ranks(ddp: DistributedDataParallel, layout: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Every rank must reduce the same buckets: adopt rank 0's layout, as DDP does when it rebuilds.

    Returns (the layout to use, the ranks whose own plan differed). On a gloo group a monitored barrier
    first names any rank that never reaches this point, instead of hanging in the exchange.
    """
    group = ddp.process_group
    world = dist.get_world_size(group)
    if world == 1:
        return layout, []
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, wait_all_ranks=True)
    layouts: list = [None] * world
    dist.all_gather_object(layouts, layout, group=group)
    differing = [rank for rank, other in enumerate(layouts) if other != layouts[0]]
    return layouts[0], differing


def rebuild_reducer(
    ddp: DistributedDataParallel, buckets: Sequence[Sequence[torch.nn.Parameter]]
) -> tuple[list[list[int]], list[int]]:
    """Replace `ddp.reducer` by one whose buckets are `buckets` (in backward order).

    Parameters DDP reduces but that no bucket names are appended as a last bucket. Returns the bucket
    layout used (lists of indices into DDP's parameter list; rank 0's where ranks disagree) and the ranks
    whose plan differed from rank 0's. A collective: every rank calls it, between iterations only.
    """
    parameters, expect_sparse = torch_ddp.reducer_params(ddp)
    index_of = {id(p): i for i, p in enumerate(parameters)}
    layout: list[list[int]] = []
    seen: set[int] = set()
    for bucket in buckets:
        idx = [index_of[id(p)] for p in bucket if id(p) in index_of and index_of[id(p)] not in seen]
        seen.update(idx)
        if idx:
            layout.append(idx)
    rest = [i for i in range(len(parameters)) if i not in seen]
    # Leftovers are split by dtype/device: the reducer wants one of each per bucket.
    by_key: dict[tuple, list[int]] = {}
    for i in rest:
        by_key.setdefault((parameters[i].dtype, parameters[i].device), []).append(i)
    layout.extend(by_key.values())
    layout, differing = agree_across_ranks(ddp, layout)
    caps = [max(1, sum(parameters[i].numel() * parameters[i].element_size() for i in b)) for b in layout]
    torch_ddp.install_reducer(ddp, parameters, expect_sparse, layout, caps)
    if differing:
        log.warning("ddp: ranks %s planned other buckets than rank 0; every rank uses rank 0's", differing)
    log.info("ddp: reducer rebuilt with %d bucket(s) aligned to compiled pieces", len(layout))
    return layout, differing


def planned_buckets(graphs: Sequence[SplitGraph]) -> list[list[torch.nn.Parameter]]:
    """Every bucket of `graphs` (compiled in one step, in forward order), in backward order.

    Later graphs run their backward first. A parameter used by several graphs is ready after the
    earliest of them, so it keeps only its last place in backward order.
    """
    buckets = [bucket for graph in reversed(graphs) for bucket in graph.params]
    seen: set[int] = set()
    deduped: list[list[torch.nn.Parameter]] = []
    for bucket in reversed(buckets):
        kept = [p for p in bucket if id(p) not in seen]
        seen.update(id(p) for p in kept)
        deduped.append(kept)
    return [b for b in reversed(deduped) if b]


@dataclasses.dataclass
class ReducerAlignment:
    """The reducer swap of one compiled DDP model, as an explicit state (see the Note above).

    Graphs are recorded as the splitter compiles them; `before_forward` swaps the reducer once,
    before the first forward that follows a compiling step.
    """

    ddp: DistributedDataParallel | None
    """The DDP model whose reducer is swapped (None: not a DDP model)."""
    names: dict[int, str]
    """id(parameter) -> the user's name, for the report."""
    status: str = "pending"
    """One of `STATUSES`."""
    detail: str = ""
    """Why (for skipped) or what (for aligned), in words."""
    buckets: list[frozenset[str]] = dataclasses.field(default_factory=list)
    """The buckets DDP reduces since the swap (user names), in backward order."""
    graphs: list[tuple[int, SplitGraph]] = dataclasses.field(default_factory=list)
    """(step that compiled it, graph) for every split graph."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Facts worth a line in the report (ranks that planned differently, late graphs)."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: expected one of {STATUSES}")

    def record(self, step: int, graph: SplitGraph) -> None:
        """A graph was split; after the swap, a graph whose pieces are not DDP buckets gets a note."""
        if self.status in ("not applicable", "not ours"):
            return
        self.graphs.append((step, graph))
        if self.status != "aligned":
            return
        aligned = set(self.buckets)
        stray = [list(b.params) for b in graph.plan.buckets if b.params and frozenset(b.params) not in aligned]
        if stray:
            self.notes.append(f"{graph.name} (compiled at step {step}) has pieces that are not DDP buckets: {stray}")

    def before_forward(self, step: int) -> None:
        """Swap once, before the first forward with grad that follows a compiling step."""
        if self.status == "pending" and self.graphs and torch.is_grad_enabled():
            self._align(step)

    def first_step_graphs(self) -> list[SplitGraph]:
        first = self.graphs[0][0]
        return [g for step, g in self.graphs if step == first]

    def planned_names(self) -> list[list[str]]:
        """Planned buckets of the first compiling step, in backward order, as user names."""
        return [[self.names[id(p)] for p in b] for b in planned_buckets(self.first_step_graphs())]

    def _align(self, step: int) -> None:
        buckets = planned_buckets(self.first_step_graphs())
        blocker = alignment_blocker(self.ddp, buckets)
        if blocker is not None:
            self.status, self.detail = "skipped", blocker
            log.warning("compile_core: DDP buckets left as DDP built them: %s", blocker)
            return
        layout, differing = rebuild_reducer(self.ddp, buckets)
        params, _ = torch_ddp.reducer_params(self.ddp)
        self.buckets = [frozenset(self.names[id(params[i])] for i in b) for b in layout]
        self.status = "aligned"
        self.detail = f"DDP reducer uses our {len(layout)} bucket(s) from step {step + 1}"
        if differing:
            # Correct on every rank (all reduce rank 0's buckets), but this rank's pieces may not match.
            self.detail += f"; ranks {differing} planned differently and use rank 0's buckets"
            self.notes.append(f"ranks {differing} compiled other pieces than rank 0 (see alignment)")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status}
        if self.detail:
            out["detail"] = self.detail
        if self.status == "aligned":
            out["buckets"] = [sorted(b) for b in self.buckets]
        return out

    def observed(self) -> dict[str, Any] | None:
        """Our planned buckets against the buckets an attached `OverlapRecorder` saw DDP reduce."""
        from ddp.overlap import OverlapRecorder, check_alignment

        if not self.graphs:
            return None
        hooks = [getattr(hook, "__self__", None) for hook, _ in torch_ddp.comm_hooks(self.ddp)]
        recorder = next((r for r in hooks if isinstance(r, OverlapRecorder)), None)
        steps = recorder.steps() if recorder is not None else []
        if not steps:
            return None
        result = check_alignment(self.planned_names(), steps[-1].bucket_names())
        return {"step": len(steps), **result.to_dict(), "text": str(result)}
