"""The parameters the compiled graphs leave to the reduction after the backward, and why.

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
from typing import Iterable

import torch

from ddp.agreement import RankAgreement

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
