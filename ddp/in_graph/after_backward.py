"""Which parameters a compiled graph's backward buckets (`graph_buckets`), which it leaves to the reduction
after the backward, and why (`AfterBackward`).

Two kinds, both reduced by `ddp/in_graph/leftovers.py` once the backward ended, so that every rank
averages what eager DDP averages:
  * outside: something besides one compiled graph adds to the gradient (an auxiliary loss, eager code
    at a graph break, a second graph). Found by the probe (Note [Gradients from outside the compiled
    graph] in probe.py), agreed by all ranks, and from then on left out of new graphs' buckets.
  * hooked: the user's gradient hook (`register_hook`, `register_post_accumulate_grad_hook`) must see
    the rank's own gradient, as it does in eager DDP, whose reducer sits after it. Left out of every
    graph's buckets from the compile on.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx

from ddp import torch_ddp
from ddp.agreement import RankAgreement
from ddp.bucketing import ParamInfo
from ddp.bucketing.grad_buckets import GradBucketPlan, GradSlot, plan_grad_buckets, ready_order

log = logging.getLogger(__name__)


class AfterBackward:
    """Ids (and user names) of the parameters reduced after the backward instead of inside a graph."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names
        self.outside: dict[int, str] = {}
        """Gradient producers besides one compiled graph."""
        self.hooked: dict[int, str] = {}
        """The user's gradient hooks on them."""

    def __contains__(self, pid: int) -> bool:
        return pid in self.outside or pid in self.hooked

    def to_dict(self) -> dict[str, list[str]]:
        return {"outside_graph": sorted(self.outside.values()), "gradient_hooks": sorted(self.hooked.values())}

    def note_hooked(self, pid: int, name: str) -> None:
        if pid not in self.hooked:
            self.hooked[pid] = name
            log.warning(
                "compile_core: ddp='in_graph': %s has a gradient hook (register_hook / "
                "register_post_accumulate_grad_hook); DDP reduces what the hook returns, so its gradient leaves the "
                "compiled backward un-reduced and is all-reduced after the backward",
                name,
            )

    def learn_outside(self, found: set[int], agreement: RankAgreement, params: Iterable[torch.nn.Parameter]) -> None:
        """Add what any rank's probe found (every rank calls this at the same step)."""
        mine = sorted(self.names.get(i, "?") for i in found)
        everyone = agreement.exchange("outside gradients", mine)
        names = sorted(set().union(*everyone.values()))
        by_name = {self.names.get(id(p)): p for p in params}
        new = {id(by_name[n]): n for n in names if n in by_name and id(by_name[n]) not in self.outside}
        if new:
            self.outside.update(new)
            log.warning(
                "compile_core: ddp='in_graph': %s also get gradients from outside a single compiled graph "
                "(eager code, an auxiliary loss, another graph); they are all-reduced after the backward, "
                "as DDP reduces their total",
                sorted(new.values()),
            )


def ours_to_bucket(
    value: Any, *, names: Mapping[int, str], ignored: Iterable[str], ours: Mapping[int, Any], after: AfterBackward
) -> bool:
    """Whether graph input `value` is a parameter of DDP's reducer (`ours`, by id) with a gradient, not ignored by
    DDP and not left to after the backward; the caller still checks the user's gradient hooks."""
    if not isinstance(value, torch.nn.Parameter) or not value.requires_grad:
        return False
    name = names.get(id(value))
    return name is not None and name not in ignored and id(value) in ours and id(value) not in after


def graph_buckets(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    names: Mapping[int, str],
    ignored: Iterable[str],
    ours: Mapping[int, torch.nn.Parameter],
    after: AfterBackward,
    caps: tuple[int, int],
) -> GradBucketPlan:
    """The in-graph buckets of one captured graph (the same on every rank): the parameters of DDP's reducer
    (`ours`, by id) that it reads, except those DDP ignores and those left to after the backward (`after`,
    which learns here of the ones with the user's gradient hooks). `caps`: (bucket cap, first bucket cap)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots: dict[str, GradSlot] = {}
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not ours_to_bucket(value, names=names, ignored=ignored, ours=ours, after=after):
            continue
        name = names[id(value)]
        if torch_ddp.has_gradient_hooks(value):
            # Eager DDP reduces what the user's hook returns (a clamp, a mask, a non-linear rescale),
            # and a post-accumulate hook sees the local gradient: the graph hands this one back
            # un-reduced, the hooks run on it as in eager DDP, and it is reduced after the backward.
            after.note_hooked(id(value), name)
            continue
        info = ParamInfo(name=name, nbytes=value.numel() * value.element_size(), key=f"{value.dtype}/{value.device}")
        slots[node.name] = GradSlot(input_index=index, info=info)
    cap, first = caps
    return plan_grad_buckets(ready_order(gm.graph, slots), bucket_cap_bytes=cap, first_bucket_cap_bytes=first)
