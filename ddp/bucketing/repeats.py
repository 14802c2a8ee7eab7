"""Find the repeated blocks of a model from its parameter names (pure).

Note [Buckets at block boundaries]
----------------------------------
Background: a transformer is mostly one block repeated (`blocks.0` ... `blocks.11`). When every
bucket holds whole blocks, the graph pieces of those buckets are the same graph with other
parameters, and each distinct piece needs to be compiled only once (compile_core/reuse/compile_once.py).
Cutting by bytes alone puts the cuts at a different offset inside each block, so no two pieces are
alike and every one is compiled.

Algorithm: a *unit* is a parameter-name prefix ending in a numeric component (`blocks.3`, or `3` for
an `nn.Sequential` at the top). Units of one container (`blocks`) that have the same parameters
(name suffixes, bytes, dtype/device) are *repeats*; a container needs at least two of them. The
planner (planner.py) then keeps its cuts in step with the blocks:
  * a block smaller than the cap: a bucket closes only once every block it touched is complete,
    so buckets hold whole blocks (as many as the cap takes);
  * a block bigger than the cap: every block starts a new bucket and is cut by bytes inside, which
    puts the cuts at the same places in every block (no bucket spans two blocks; the last piece of a
    block takes any sliver under half a cap rather than leaving it a bucket of its own).
Either way the buckets stay close to the requested cap (the report shows planned next to requested
bytes) and the pieces of block k and block k+1 are the same graph. Where a parameter belongs to no
unit (embeddings, the head), cuts follow the bytes rule as before; a small stretch of them right
before a block (a final norm) joins the bucket before it, so the last block stays like the others.

Notes: the outermost numeric component wins (`layers.2.sub.0.w` belongs to `layers.2`), so a
nested list inside a block stays inside its block. The planner also drops a unit whose parameters
are not first used in one contiguous stretch of the graph (weights shared across blocks): waiting
for it to complete could swallow the whole graph. Nothing here looks at the graph or at tensors.

Debugging: `repeated_units(names)` on the parameter table shows the units; the plan's
`aligned_to` names the container.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ddp.bucketing.planner import ParamInfo


def unit_of(name: str) -> tuple[str, str] | None:
    """(container, unit) of a parameter name, from its outermost numeric component."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i]), ".".join(parts[: i + 1])
    return None


def repeated_units(params: Iterable[ParamInfo]) -> dict[str, str]:
    """User parameter name -> unit (`blocks.3`), for the parameters of repeated units only."""
    members: dict[tuple[str, str], list[ParamInfo]] = {}
    for info in params:
        found = unit_of(info.name)
        if found is not None:
            members.setdefault(found, []).append(info)
    by_container: dict[str, dict[tuple, list[str]]] = {}
    for (container, unit), infos in members.items():
        signature = tuple(sorted((i.name[len(unit) + 1 :], i.nbytes, i.key) for i in infos))
        by_container.setdefault(container, {}).setdefault(signature, []).append(unit)
    out: dict[str, str] = {}
    for container, signatures in by_container.items():
        for units in signatures.values():
            if len(units) < 2:
                continue
            for unit in units:
                for info in members[(container, unit)]:
                    out[info.name] = unit
    return out


def describe_units(units: Mapping[str, str]) -> str | None:
    """`blocks.<i> (12 units)` for the report; None when there are no units."""
    if not units:
        return None
    names = sorted(set(units.values()))
    containers = sorted({unit.rsplit(".", 1)[0] if "." in unit else "" for unit in names})
    shown = ", ".join(f"{c}.<i>" if c else "<i>" for c in containers)
    return f"{shown} ({len(names)} units)"
