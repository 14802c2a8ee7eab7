"""`ddp="in_graph"` inside `DistributedDataParallel.join()` (uneven inputs per rank).

Note [ddp="in_graph" inside join()]
-----------------------------------
Background: a rank that runs out of inputs inside `with ddp.join():` keeps the others company by shadowing,
at each of their steps, the collectives of DDP's forward and the all-reduce of every bucket of DDP's
reducer, with zeros (`_DDPJoinHook.main_hook`, torch/nn/parallel/distributed.py). The compiled backward of
ddp="in_graph" all-reduces its own buckets, whose number and sizes DDP's reducer does not know (and whose
buffers we released): a joined rank's shadow would pair with the wrong collectives (an abort on gloo, a hang
on nccl).

Algorithm: `DDP.join()` asks the model for its join hook when the context is entered, on every rank at
once, before any rank can have joined. There the reducer gives DDP's reducer buckets again
(`restore_reducer_buckets`, one per dtype and device) and opens the join window; inside it every forward
runs the graphs compiled without collectives ("local", as under no_sync()) and leaves `require_backward_grad_sync`
as the script set it, so DDP's reducer reduces each step and a joined rank's shadow pairs with it, as in eager
DDP. The window closes at the end of the join hook's `post_hook`, which every rank runs once all have
joined; the next synchronising step reduces in the graph again and releases DDP's buckets once more. If the
context ends with an exception, no post-hook runs: DDP's reducer keeps reducing (correct, without the
overlap of in-graph buckets).

Debugging: `report()["in_graph"]["joins"]` counts the join windows opened; a step inside one reports
`in_graph=False` with this reason to the optimizer update inside the backward, which then leaves the update
after the backward for good.
"""

from __future__ import annotations

from typing import Callable

from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel

from ddp import torch_ddp

REASON = "inside DistributedDataParallel.join() (uneven inputs) DDP's reducer reduces, so a joined rank can shadow it"
"""Why a step inside the join window does not reduce in the graph (the reducer's `step_outcome`)."""


class JoinWindow:
    """From `ddp.join()` to the end of its post-hook, on this rank (see the Note above)."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        self.open = False
        self.opened = 0
        """Join windows opened so far."""

    def enter(self, hook: JoinHook) -> JoinHook:
        """DDP's join hook, wrapped so that the window closes after its post-hook."""
        self.open = True
        self.opened += 1
        return _ClosingHook(hook, self._close)

    def ddp_reduces(self) -> bool:
        """Whether DDP's reducer reduces this forward (the window is open and the context enabled)."""
        return self.open and torch_ddp.join_enabled(self.ddp)

    def _close(self) -> None:
        self.open = False


class _ClosingHook(JoinHook):
    def __init__(self, hook: JoinHook, close: Callable[[], None]) -> None:
        self.hook = hook
        self.close = close

    def main_hook(self) -> None:
        self.hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        try:
            self.hook.post_hook(is_last_joiner)
        finally:
            self.close()
