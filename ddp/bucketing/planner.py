"""Plan DDP gradient buckets over a captured FX graph.

Note [Bucket planning]
----------------------
Background: DDP reduces gradients in buckets. A bucket is all-reduced as soon as every gradient in it
is ready, and gradients become ready in backward order: last-used layers first. A compiled graph runs
its whole backward as one autograd node, so the graph must be cut into pieces whose parameter sets are
the buckets; then each bucket's all-reduce starts as soon as its own piece's backward is done.

Algorithm: walk the graph's compute nodes from the output backwards. A parameter belongs to the node
that uses it *first in forward order* (its gradient is complete only once that node's backward ran),
so a parameter used several times (tied weights) is counted once, where its gradient becomes ready.
Add each node's parameters to the open bucket; once the bucket holds at least its cap (the first
bucket has its own, smaller cap, exactly like DDP's reducer), close it and cut the graph just before
that node. Two refinements keep every piece well-formed:
  * a piece must produce something that a later piece or the graph output consumes; otherwise its
    backward would never run. The open bucket keeps growing until it does;
  * a leading run of nodes without parameters (input preprocessing) joins the piece after it.
A higher-order op (activation checkpointing, `wrap`) is one node whose body is a `get_attr`: the body
goes with its caller, so the region is never cut. Buffers and the parameters DDP ignores are never
counted. A bucket holds parameters of one dtype/device only (DDP's rule): a change of key closes it.
With `repeats` (parameter name -> repeated block, ddp/bucketing/repeats.py) a bucket closes only
once every block it touched is complete, so buckets hold whole blocks and their pieces are alike.

Notes: the planner is pure: it reads the graph and a table of parameter facts and returns a
`BucketPlan`; it needs no process group and mutates nothing. `ddp.splitter` turns the plan into
pieces; `ddp.alignment` makes DDP's reducer use the same buckets.

Debugging: `str(plan)` prints one line per bucket (piece, parameter names, bytes).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import torch.fx as fx

from ddp.bucketing.caps import MiB, resolve_caps


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """What the planner needs to know about one parameter input of the graph."""

    name: str
    """The user's fully qualified name (`blocks.3.fc.weight`)."""
    nbytes: int
    """Size of its gradient in bytes."""
    key: str = ""
    """dtype/device group: DDP never mixes two keys in a bucket."""

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"ParamInfo({self.name!r}): nbytes={self.nbytes} must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bucket:
    """One gradient bucket; it is also one graph piece."""

    index: int
    """Position in backward order (0 = gradients ready first)."""
    params: tuple[str, ...]
    """User names of its parameters, in the order the backward makes them ready."""
    nbytes: int
    """Sum of its parameters' gradient bytes."""
    nodes: tuple[str, ...]
    """Names of the graph nodes that form its piece, in graph order."""

    def to_dict(self) -> dict:
        return {"params": list(self.params), "bytes": self.nbytes}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """Buckets of one graph, in backward order."""

    buckets: tuple[Bucket, ...]
    """The buckets; `buckets[0]` is reduced first."""
    bucket_cap_bytes: int
    """Cap used for every bucket but the first."""
    first_bucket_cap_bytes: int
    """Cap used for the first bucket."""
    aligned_to: tuple[str, ...] = ()
    """Repeated blocks whose boundaries the cuts kept to (empty: cuts by bytes only)."""

    @property
    def num_pieces(self) -> int:
        return len(self.buckets)

    def piece_of(self) -> dict[str, int]:
        """Node name -> piece index in *forward* order (piece 0 runs first in forward)."""
        n = len(self.buckets)
        return {node: n - 1 - b.index for b in self.buckets for node in b.nodes}

    def params_in_backward_order(self) -> list[list[str]]:
        return [list(b.params) for b in self.buckets]

    def __str__(self) -> str:
        lines = [
            f"BucketPlan: {len(self.buckets)} bucket(s), cap {self.bucket_cap_bytes / MiB:.3g} MiB, "
            f"first {self.first_bucket_cap_bytes / MiB:.3g} MiB"
        ]
        for b in self.buckets:
            names = ", ".join(b.params) if b.params else "(no parameters)"
            lines.append(f"  bucket {b.index}: {b.nbytes / MiB:8.3f} MiB  {names}")
        return "\n".join(lines)


def plan_buckets(
    graph: fx.Graph,
    params: Mapping[str, ParamInfo],
    *,
    bucket_cap_bytes: int,
    first_bucket_cap_bytes: int | None = None,
    ignore: frozenset[str] = frozenset(),
    repeats: Mapping[str, str] | None = None,
) -> BucketPlan:
    """Plan the buckets (= pieces) of `graph`.

    `params` maps the name of a graph node that *is* a trainable parameter (a placeholder, or a
    `get_attr` of a parameter) to its facts; every other node is data or a buffer. `ignore` holds
    user names DDP does not reduce (`_ddp_params_and_buffers_to_ignore`). `repeats` maps user names
    to their repeated block (`repeated_units`): buckets then hold whole blocks.
    """
    cap, first_cap = resolve_caps(bucket_cap_bytes, first_bucket_cap_bytes)
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    position = {n: i for i, n in enumerate(nodes)}

    # Each node owns the parameters whose first use it is.
    owned: dict[fx.Node, list[ParamInfo]] = {}
    for node in graph.nodes:
        info = params.get(node.name)
        if info is None or info.name in ignore:
            continue
        users = [u for u in node.users if u in position]
        if not users:
            continue  # an unused parameter input: DDP handles it, no piece owns it
        first = min(users, key=position.__getitem__)
        owned.setdefault(first, []).append(info)

    # A get_attr node (parameter, buffer or a higher-order op body) goes with its first user.
    anchor = {n: n for n in nodes}
    for n in nodes:
        if n.op == "get_attr":
            users = [u for u in n.users if u in position]
            if users:
                anchor[n] = min(users, key=position.__getitem__)

    attached_to: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        attached_to.setdefault(anchor[n], []).append(n)

    units = _contiguous_units(nodes, anchor, owned, repeats or {})
    remaining: dict[str, int] = {}
    for infos in owned.values():
        for p in infos:
            if p.name in units:
                remaining[units[p.name]] = remaining.get(units[p.name], 0) + 1
    open_units: set[str] = set()

    groups: list[dict] = []  # built in backward order
    open_group = {"nodes": [], "params": [], "bytes": 0, "key": None, "out": False}
    output_node = next(n for n in graph.nodes if n.op == "output")

    def feeds_outside(group_nodes: set, node: fx.Node) -> bool:
        return any(u is output_node or (u in position and u not in group_nodes and position[u] > position[node])
                   for u in node.users)

    # With repeated blocks: the bytes of non-block parameters between each step of the walk and the
    # next block, and whether a block follows. A small stretch of them (a final norm before the head)
    # joins the bucket before it rather than the next block's, so that block stays like the others.
    walk = [n for n in reversed(nodes) if anchor[n] is n]
    ahead_bytes: dict[fx.Node, int] = {}
    ahead_unit: dict[fx.Node, bool] = {}
    stretch, unit_next = 0, False
    for node in reversed(walk):
        ahead_bytes[node], ahead_unit[node] = stretch, unit_next
        infos = owned.get(node, [])
        if any(p.name in units for p in infos):
            stretch, unit_next = 0, True
        elif infos:
            stretch += sum(p.nbytes for p in infos)

    member: set = set()
    for node in walk:
        infos = owned.get(node, [])
        keys = {p.key for p in infos}
        if open_group["params"] and keys and keys != {open_group["key"]} and open_group["out"]:
            groups.append(open_group)
            open_group = {"nodes": [], "params": [], "bytes": 0, "key": None, "out": False}
            member = set()
            open_units = set()
        attached = attached_to[node]
        open_group["nodes"].extend(attached)
        member.update(attached)
        for p in infos:
            open_group["params"].append(p.name)
            open_group["bytes"] += p.nbytes
            open_group["key"] = p.key
            unit = units.get(p.name)
            if unit is not None:
                remaining[unit] -= 1
                open_units.add(unit)
        if not open_group["out"]:
            open_group["out"] = any(feeds_outside(member, n) for n in attached)
        limit = first_cap if not groups else cap
        whole = all(remaining[u] == 0 for u in open_units)
        before_block = not open_units and ahead_unit[node] and 0 < ahead_bytes[node] < cap
        if open_group["params"] and open_group["bytes"] >= limit and open_group["out"] and whole and not before_block:
            groups.append(open_group)
            open_group = {"nodes": [], "params": [], "bytes": 0, "key": None, "out": False}
            member = set()
            open_units = set()
    if open_group["nodes"]:
        if groups and not open_group["params"]:
            groups[-1]["nodes"].extend(open_group["nodes"])  # parameter-free preamble
        else:
            groups.append(open_group)
    if not groups:
        groups.append({"nodes": [], "params": [], "bytes": 0})

    buckets = tuple(
        Bucket(
            index=i,
            params=tuple(g["params"]),
            nbytes=g["bytes"],
            nodes=tuple(n.name for n in sorted(g["nodes"], key=position.__getitem__)),
        )
        for i, g in enumerate(groups)
    )
    containers = sorted({u.rsplit(".", 1)[0] if "." in u else "" for u in units.values()})
    return BucketPlan(buckets=buckets, bucket_cap_bytes=cap, first_bucket_cap_bytes=first_cap,
                      aligned_to=tuple(containers))


def _contiguous_units(
    nodes: list[fx.Node], anchor: dict, owned: dict[fx.Node, list[ParamInfo]], repeats: Mapping[str, str]
) -> dict[str, str]:
    """`repeats` restricted to units whose parameters are first used in one stretch of the graph.

    A unit interleaved with another (a weight shared across blocks) would keep its bucket open
    until the other completes, possibly to the end of the graph: such units are cut by bytes.
    """
    if not repeats:
        return {}
    runs: dict[str, int] = {}
    previous = None
    for node in nodes:
        if anchor[node] is not node:
            continue
        for p in owned.get(node, []):
            unit = repeats.get(p.name)
            if unit is None:
                continue
            if unit != previous:
                runs[unit] = runs.get(unit, 0) + 1
                previous = unit
    keep = {u for u, n in runs.items() if n == 1}
    kept = {name: unit for name, unit in repeats.items() if unit in keep}
    # Still repeats only if at least two units of one container survived.
    count: dict[str, int] = {}
    for unit in set(kept.values()):
        container = unit.rsplit(".", 1)[0] if "." in unit else ""
        count[container] = count.get(container, 0) + 1
    return {n: u for n, u in kept.items() if count[u.rsplit(".", 1)[0] if "." in u else ""] >= 2}
