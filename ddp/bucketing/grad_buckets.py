"""Plan the gradient buckets that `ddp="in_graph"` all-reduces inside a compiled backward (pure).

Note [In-graph buckets]
-----------------------
Background: in `ddp="in_graph"` mode the compiled backward graph all-reduces the gradients itself,
one flat all-reduce per bucket. Unlike `ddp="split"`, buckets do not have to be graph pieces, so
bucket size and graph size are independent: one graph can hold any number of buckets.

Algorithm: the parameters of one captured graph are ordered by when their gradient is complete,
which is the reverse of their first use in the forward (the last layer's gradient is ready first;
a parameter used several times, tied weights included, is complete only after its first use's
backward). Walking that order, each dtype/device key keeps one open bucket; a parameter joins its
key's bucket, and a bucket closes once it holds at least its cap. Like DDP's reducer, the first
bucket of each key has its own, smaller cap, so the first all-reduce starts early. Buckets are
listed in the order they close, which is the order their all-reduces are issued.

Notes: the plan depends only on the forward graph, the parameter sizes and the caps, so every rank
computes the same plan from the same graph, and it is known before AOTAutograd runs (a compiled
artifact taken from a cache carries the same plan in its key). Where exactly each all-reduce is
issued (after which backward op) is decided later, on the real backward graph
(`ddp/in_graph/graph_pass.py`).

Debugging: `str(plan)` lists buckets with parameter names and bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch.fx as fx

from ddp.bucketing.caps import MiB, resolve_caps
from ddp.bucketing.planner import ParamInfo


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradSlot:
    """A parameter input of the graph whose gradient the backward produces."""

    input_index: int
    """Position among the graph's inputs (what AOTAutograd's gradient outputs refer to)."""
    info: ParamInfo
    """User name, gradient bytes, dtype/device key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradBucket:
    """One flat all-reduce in the backward."""

    index: int
    """Issue order (0 = the first all-reduce of the backward)."""
    params: tuple[str, ...]
    """User names, in the order their gradients become ready."""
    input_indices: tuple[int, ...]
    """Graph input positions of those parameters (same order)."""
    nbytes: int
    """Bytes all-reduced."""
    key: str
    """dtype/device of every gradient in the bucket."""

    def to_dict(self) -> dict:
        return {"params": list(self.params), "bytes": self.nbytes}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradBucketPlan:
    """Every in-graph bucket of one graph, in issue order."""

    buckets: tuple[GradBucket, ...]
    bucket_cap_bytes: int
    first_bucket_cap_bytes: int

    def fingerprint(self) -> tuple:
        """What every rank must agree on before the first collective: sizes, dtypes, order."""
        return tuple((b.nbytes, b.key, len(b.params)) for b in self.buckets)

    def input_indices(self) -> frozenset[int]:
        return frozenset(i for b in self.buckets for i in b.input_indices)

    def __str__(self) -> str:
        lines = [
            f"GradBucketPlan: {len(self.buckets)} bucket(s), cap {self.bucket_cap_bytes / MiB:.3g} MiB, "
            f"first {self.first_bucket_cap_bytes / MiB:.3g} MiB"
        ]
        lines += [f"  bucket {b.index}: {b.nbytes / MiB:8.3f} MiB {b.key} {', '.join(b.params)}" for b in self.buckets]
        return "\n".join(lines)


def ready_order(graph: fx.Graph, params: Mapping[str, GradSlot]) -> list[GradSlot]:
    """Parameter inputs of `graph` in the order their gradients complete (reverse first use).

    `params` maps placeholder names to slots; placeholders no compute node uses are left out.
    """
    position = {n: i for i, n in enumerate(graph.nodes)}
    first_use: list[tuple[int, GradSlot]] = []
    for node in graph.nodes:
        slot = params.get(node.name)
        if slot is None or node.op != "placeholder":
            continue
        users = [position[u] for u in node.users if u.op != "output"]
        if users:
            first_use.append((min(users), slot))
    first_use.sort(key=lambda t: (-t[0], t[1].input_index))
    return [slot for _, slot in first_use]


def plan_grad_buckets(
    slots: Sequence[GradSlot], *, bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None
) -> GradBucketPlan:
    """Buckets over `slots` (already in ready order), one open bucket per dtype/device key."""
    cap, first_cap = resolve_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    open_buckets: dict[str, list[GradSlot]] = {}
    closed_count: dict[str, int] = {}
    done: list[list[GradSlot]] = []
    for slot in slots:
        key = slot.info.key
        bucket = open_buckets.setdefault(key, [])
        bucket.append(slot)
        limit = first_cap if closed_count.get(key, 0) == 0 else cap
        if sum(s.info.nbytes for s in bucket) >= limit:
            done.append(bucket)
            closed_count[key] = closed_count.get(key, 0) + 1
            open_buckets[key] = []
    # What is left open closes at the end; every bucket is issued once its last gradient is ready.
    done.extend(b for b in open_buckets.values() if b)
    last = {id(s): i for i, s in enumerate(slots)}
    done.sort(key=lambda b: last[id(b[-1])])
    buckets = tuple(
        GradBucket(
            index=i,
            params=tuple(s.info.name for s in b),
            input_indices=tuple(s.input_index for s in b),
            nbytes=sum(s.info.nbytes for s in b),
            key=b[0].info.key,
        )
        for i, b in enumerate(done)
    )
    return GradBucketPlan(buckets=buckets, bucket_cap_bytes=cap, first_bucket_cap_bytes=first_cap)
