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
Every rank must reduce the same buckets, and no rank may wait for another where the user's eager
script would not (rank 0 alone may evaluate, sample or log, with or without gradients, before the
first step or between steps). So the ranks agree without a rendezvous of their own:
  * the layout comes from the graphs compiled in the first forward with gradients enabled (a forward
    under `no_grad` compiles graphs of its own that never reduce); right after that forward each rank
    posts its layout to the store and goes on (`RankAgreement.post`: nothing waits);
  * the swap happens at the first forward, of whatever kind (one under `torch.inference_mode` too: the
    new buckets are made outside it), after this rank's first synchronising
    backward ended. That backward all-reduced with every other rank, so every rank had finished its
    layout forward and posted: reading the others' layouts (`collect`) waits for nothing that needs
    this rank's progress, and its timeout only guards against a rank that is genuinely stuck. Every
    rank swaps before its next synchronising backward, which is where DDP itself would rebuild its
    buckets (a broadcast in its forward after the first synchronising backward);
  * all ranks take the lowest rank's layout (as DDP's rebuild does); a rank whose own plan differed is
    named in the report. If any rank cannot swap, none does.

Who uses it: `ddp="split"` (pieces are buckets: the overlap), and `ddp="in_graph"` where DDP's reducer runs a comm
hook the compiled backward cannot (one graph hands every gradient over at its end, so nothing overlaps; the swap
gives the reducer the buckets eager DDP rebuilds, in the backward's order, which an order-dependent hook such as
PowerSGD reads: compile_core/modes.py, `InGraphMode._follow_reduction`).

Notes: we leave the reducer alone (and say why in the report) when DDP is in a mode the swap cannot
preserve: the python reducer, mixed precision, delayed all-reduce params, or a bucket that mixes
dtypes or devices. With `static_graph=True` the new reducer is static too, and its first backward must be a
static graph's first (every bucket reduced at its end), as DDP's own reducer's was: a backward it saw before,
under `no_sync()`, would be counted as part of that one, and no bucket would be ready after it. So there the swap
waits for the first synchronising forward (DDP's ranks run those in step), that first backward runs over one
bucket per dtype as DDP's own first did, and our buckets are cut at the next synchronising forward (eager DDP
cuts its own there too, from the order its second backward made the gradients; left alone, DDP would cut from
the compiled backward's order). Parameters that no graph touched (used eagerly between graph breaks, or
unused) go to one trailing bucket so that every parameter is still reduced.

Debugging: `CompiledModel.report()` lists planned buckets and this alignment's state; with a
`ddp.overlap.OverlapRecorder` attached it also compares them with the buckets DDP really reduced.
Tests record DDP's real buckets through a comm hook and compare.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from aot.torch_eager import tree_leaves
from ddp import torch_ddp, torch_ddp_reducer
from ddp.agreement import PostedValue, RankAgreement

log = logging.getLogger(__name__)

STATUSES = ("pending", "aligned", "skipped", "not applicable", "not ours")
"""pending: nothing swapped yet; aligned: DDP reduces our buckets; skipped: DDP kept its own (why in
`detail`); not applicable: no split (ddp='none' or no DDP); not ours: ddp='torch' (PyTorch buckets)."""


def alignment_blocker(ddp: DistributedDataParallel, buckets: Sequence[Sequence[torch.nn.Parameter]]) -> str | None:
    """Why the reducer of `ddp` cannot be rebuilt to `buckets` (None when it can)."""
    blocker = torch_ddp_reducer.reducer_swap_blocker(ddp)
    if blocker is not None:
        return blocker.text
    for i, bucket in enumerate(buckets):
        keys = {(p.dtype, p.device) for p in bucket}
        if len(keys) > 1:
            return f"bucket {i} mixes dtypes/devices {sorted(map(str, keys))}"
    return None


def local_layout(ddp: DistributedDataParallel, buckets: Sequence[Sequence[torch.nn.Parameter]]) -> list[list[int]]:
    """`buckets` (backward order) as lists of indices into DDP's parameter list.

    Parameters DDP reduces but that no bucket names are appended as last buckets, one per
    dtype/device (the reducer wants one of each per bucket), so every parameter is still reduced. A
    parameter whose gradient is sparse (`nn.Embedding(sparse=True)`) gets a bucket of its own, ahead of
    the rest of its bucket: a `Reducer` refuses it in a bucket with others, and DDP's own layout gives
    it one alone.
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
    by_key: dict[tuple, list[int]] = {}
    for i in range(len(parameters)):
        if i not in seen:
            by_key.setdefault((parameters[i].dtype, parameters[i].device), []).append(i)
    layout.extend(by_key.values())
    if not any(expect_sparse):
        return layout
    alone: list[list[int]] = []
    for bucket in layout:
        alone.extend([i] for i in bucket if expect_sparse[i])
        dense = [i for i in bucket if not expect_sparse[i]]
        if dense:
            alone.append(dense)
    return alone


def rebuild_reducer(ddp: DistributedDataParallel, layout: Sequence[Sequence[int]]) -> bool:
    """Replace `ddp.reducer` by one whose buckets are `layout` (the same on every rank).

    Returns whether the layout is frozen (DDP will not rebuild it later; see `install_reducer`).
    """
    parameters, expect_sparse = torch_ddp.reducer_params(ddp)
    frozen = torch_ddp_reducer.install_reducer(ddp, parameters, expect_sparse, layout)
    log.info(
        "ddp: reducer rebuilt with %d bucket(s) aligned to compiled pieces%s",
        len(layout),
        "" if frozen else " (DDP may still re-cut them after its first backward)",
    )
    return frozen


def arm_end_of_backward(output: Any, callback: Any) -> None:
    """Run `callback` when the backward through `output` (a forward's result) has ended."""
    armed = []

    def hook(grad: torch.Tensor) -> None:
        if not armed:
            armed.append(True)
            torch_ddp.queue_end_of_backward(callback)

    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)


@dataclasses.dataclass(frozen=True)
class PlannedGraph:
    """One compiled graph as the alignment sees it: its name and the real parameters of each of its buckets."""

    name: str
    buckets: list[list[torch.nn.Parameter]]
    """In backward order (the order their gradients are ready)."""


def planned_buckets(graphs: Sequence[PlannedGraph]) -> list[list[torch.nn.Parameter]]:
    """Every bucket of `graphs` (compiled in one step, in forward order), in backward order.

    Later graphs run their backward first. A parameter used by several graphs is ready after the
    earliest of them, so it keeps only its last place in backward order.
    """
    buckets = [bucket for graph in reversed(graphs) for bucket in graph.buckets]
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

    Graphs are recorded as the splitter compiles them; `after_forward` posts this rank's layout after
    the first forward with gradients, and `before_forward` swaps the reducer once, at the first forward
    after a synchronising backward ended.
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
    graphs: list[tuple[int, PlannedGraph]] = dataclasses.field(default_factory=list)
    """(step that compiled it, graph) for every graph planned into buckets."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Facts worth a line in the report (ranks that planned differently, late graphs)."""
    agreement: RankAgreement | None = None
    """How the ranks exchange their layouts (None: a single process, nothing to exchange)."""
    layout_forward: int | None = None
    """The forward (numbered from 1) whose graphs give the layout: the first with gradients enabled."""
    posted: PostedValue | None = None
    """This rank's layout, once posted for the other ranks."""
    synced: bool = False
    """True once a synchronising backward (DDP all-reduced) ended on this rank."""
    static_cut: str | None = None
    """With `static_graph=True`, after the swap: "after first backward" until the new reducer's first backward
    (over one bucket per dtype, as DDP's own first) ended on this rank, then "due": our buckets are cut at the
    next synchronising forward (`cut_static_layout`, a broadcast), which every rank runs in step. The swap itself
    may come at a forward of this rank alone (an evaluation with gradients on rank 0): not the cut."""
    _forward: int = 0
    _sync_forward: bool = False

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r}: expected one of {STATUSES}")

    def record(self, step: int, graph: PlannedGraph) -> None:
        """A graph was planned; after the swap, a graph whose buckets are not DDP buckets gets a note."""
        if self.status in ("not applicable", "not ours"):
            return
        self.graphs.append((step, graph))
        if self.status != "aligned":
            return
        aligned = set(self.buckets)
        named = [[self.names[id(p)] for p in b] for b in graph.buckets]
        stray = [b for b in named if b and frozenset(b) not in aligned]
        if stray:
            self.notes.append(f"{graph.name} (compiled at step {step}) has buckets that are not DDP's: {stray}")

    def before_forward(self, step: int) -> None:
        """Before DDP's forward number `step + 1` (`step` counts earlier forwards): swap if this rank's first
        synchronising backward has ended (see the Note), else note what kind of forward this is."""
        self._forward = step + 1
        grad = torch.is_grad_enabled()
        self._sync_forward = grad and self.ddp is not None and bool(self.ddp.require_backward_grad_sync)
        if self.static_cut == "due" and self._sync_forward:
            self.static_cut = None
            with torch.inference_mode(False):
                torch_ddp_reducer.cut_static_layout(self.ddp)
        if self.status != "pending":
            return
        if self.synced and (self._sync_forward or not self.ddp.static_graph):
            self._align(self._forward)
            return
        if grad and self.layout_forward is None:
            self.layout_forward = self._forward

    def after_forward(self, output: Any) -> None:
        """After DDP's forward: post the layout once its forward is done; until a synchronising backward
        has ended, arm a callback at the end of this forward's backward if it synchronises (and, with a static
        graph, until the new reducer's first backward has ended)."""
        if self.static_cut == "after first backward" and self._sync_forward:
            arm_end_of_backward(output, self._static_first_backward_ended)
        if self.status != "pending":
            return
        if self.posted is None and self._forward == self.layout_forward:
            self._post()
        if self._sync_forward and not self.synced:
            self._sync_forward = False
            arm_end_of_backward(output, self._backward_synced)

    def _backward_synced(self) -> None:
        self.synced = True

    def _static_first_backward_ended(self) -> None:
        if self.static_cut == "after first backward":
            self.static_cut = "due"

    def _post(self) -> None:
        buckets = planned_buckets(self.layout_graphs())
        offer = (alignment_blocker(self.ddp, buckets), local_layout(self.ddp, buckets))
        self.posted = (
            self.agreement.post("bucket layout", offer)
            if self.agreement is not None
            else PostedValue(topic="bucket layout", n=0, value=offer)
        )

    def layout_graphs(self) -> list[PlannedGraph]:
        """The graphs of the layout forward (what the first forward with gradients compiled)."""
        return [g for step, g in self.graphs if step == self.layout_forward]

    def planned_names(self) -> list[list[str]]:
        """Planned buckets of the layout forward, in backward order, as user names."""
        return [[self.names[id(p)] for p in b] for b in planned_buckets(self.layout_graphs())]

    def _align(self, step: int) -> None:
        if self.posted is None:  # the layout forward raised before its end: post what it compiled
            self._post()
        assert self.posted is not None
        blocker = self.posted.value[0]
        offers = {0: self.posted.value} if self.agreement is None else self.agreement.collect(self.posted)
        blocked = {r: b for r, (b, _) in sorted(offers.items()) if b is not None}
        if blocked:
            # One rank that cannot swap means none may: all ranks must reduce the same buckets.
            self.status = "skipped"
            self.detail = "; ".join(f"rank {r}: {b}" for r, b in blocked.items()) if len(offers) > 1 else blocker
            log.warning("compile_core: DDP buckets left as DDP built them: %s", self.detail)
            return
        first = min(offers)
        chosen = offers[first][1]
        differing = [r for r, (_, other) in sorted(offers.items()) if other != chosen]
        # The forward that swaps may be an evaluation under torch.inference_mode: the new reducer's bucket
        # tensors, which every later backward writes into, must not be inference tensors.
        with torch.inference_mode(False):
            frozen = rebuild_reducer(self.ddp, chosen)
        if self.ddp.static_graph:  # this forward synchronises (`before_forward`)
            torch_ddp.queue_static_graph_first_backward(self.ddp)
            self.static_cut = "after first backward" if frozen else None
        params, _ = torch_ddp.reducer_params(self.ddp)
        self.buckets = [frozenset(self.names[id(params[i])] for i in b) for b in chosen]
        self.status = "aligned"
        self.detail = f"DDP reducer uses our {len(chosen)} bucket(s) from forward {step}"
        if self.ddp.static_graph and frozen:
            self.detail = (
                f"DDP's reducer, static, has one bucket per dtype in the backward of forward {step} (a static graph's "
                f"first, as DDP's own was) and our {len(chosen)} bucket(s) from the next synchronising forward"
            )
        if not frozen:
            why = (
                "find_unused_parameters keeps DDP from rebuilding"
                if self.ddp.find_unused_parameters and not self.ddp.static_graph
                else "dtypes need conflicting caps: DDP re-cuts them by the order gradients become ready after step 2"
            )
            self.detail += f" ({why})"
        if differing:
            # Correct on every rank (all reduce rank 0's buckets), but those ranks' pieces may not match.
            self.detail += f"; ranks {differing} planned differently and use rank {first}'s buckets"
            self.notes.append(f"ranks {differing} compiled other pieces than rank {first} (see alignment)")
            log.warning(
                "ddp: ranks %s planned other buckets than rank %d; every rank uses rank %d's", differing, first, first
            )

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
