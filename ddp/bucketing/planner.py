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
With `repeats` (parameter name -> repeated block, ddp/bucketing/repeats.py) the cuts keep in step
with the blocks (whole blocks per bucket, or the same cuts inside every block when a block is bigger
than the cap), so the pieces of the blocks are alike (Note [Buckets at block boundaries]).

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
    remaining: dict[str, int] = {}  # per unit: parameters not yet in a bucket
    left: dict[str, int] = {}  # per unit: bytes not yet in a bucket
    for infos in owned.values():
        for p in infos:
            if p.name in units:
                remaining[units[p.name]] = remaining.get(units[p.name], 0) + 1
                left[units[p.name]] = left.get(units[p.name], 0) + p.nbytes
    # A block bigger than the cap is cut inside, at the same places in every block ("periodic");
    # smaller blocks are grouped whole, as many as the cap takes.
    periodic = {u for u, nbytes in left.items() if nbytes > cap}

    groups: list[dict] = []  # built in backward order
    output_node = next(n for n in graph.nodes if n.op == "output")

    def feeds_outside(group_nodes: set, node: fx.Node) -> bool:
        return any(
            u is output_node or (u in position and u not in group_nodes and position[u] > position[node])
            for u in node.users
        )

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

    state = {"group": _new_group(), "member": set(), "units": set()}

    def close() -> None:
        groups.append(state["group"])
        state.update(group=_new_group(), member=set(), units=set())

    for node in walk:
        group = state["group"]
        infos = owned.get(node, [])
        keys = {p.key for p in infos}
        if group["params"] and keys and keys != {group["key"]} and group["out"]:
            close()
        node_units = {units[p.name] for p in infos if p.name in units}
        entering = node_units - state["units"]
        if entering and state["group"]["params"] and state["group"]["out"] and (entering | state["units"]) & periodic:
            # A block cut inside never shares a bucket with another block; parameters outside any
            # block (a head) keep a bucket of their own unless they are a sliver (under half a cap).
            if state["units"] or state["group"]["bytes"] >= (first_cap if not groups else cap) / 2:
                close()
        group = state["group"]
        attached = attached_to[node]
        group["nodes"].extend(attached)
        state["member"].update(attached)
        for p in infos:
            group["params"].append(p.name)
            group["bytes"] += p.nbytes
            group["key"] = p.key
            unit = units.get(p.name)
            if unit is not None:
                remaining[unit] -= 1
                left[unit] -= p.nbytes
                state["units"].add(unit)
        if not group["out"]:
            group["out"] = any(feeds_outside(state["member"], n) for n in attached)
        if not (group["params"] and group["out"]):
            continue
        limit = first_cap if not groups else cap
        whole = all(remaining[u] == 0 for u in state["units"])
        inside = state["units"] & periodic
        if inside:
            # Cut by bytes inside the block, but leave no sliver of it for a bucket of its own.
            if whole or (group["bytes"] >= limit and all(left[u] >= limit / 2 for u in inside)):
                close()
        elif group["bytes"] >= limit and whole:
            if not (not state["units"] and ahead_unit[node] and 0 < ahead_bytes[node] < cap):
                close()
    open_group = state["group"]
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
    return BucketPlan(
        buckets=buckets, bucket_cap_bytes=cap, first_bucket_cap_bytes=first_cap, aligned_to=tuple(containers)
    )


def _new_group() -> dict:
    return {"nodes": [], "params": [], "bytes": 0, "key": None, "out": False}


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
