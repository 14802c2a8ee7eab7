"""Gradients accumulated under `no_sync()`, handed to the synchronising micro-batch's graph, whose backward
reduces `accumulated + this micro-batch` in its buckets: one all-reduce per bucket per update, as DDP's reducer.

Note [Accumulated gradients in ddp="in_graph"]
----------------------------------------------
Background: eager DDP reduces, on the synchronising micro-batch, what `.grad` holds when its bucket is
ready: the earlier micro-batches' gradients plus this one's. The compiled backward reduces its buckets
itself, so the accumulated part must enter the graph (an extra input per bucketed parameter, added to
the parameter's gradient before the bucket is filled: ddp/in_graph/graph_pass.py `add_accumulated`).
Otherwise it would be all-reduced a second time after the backward: twice DDP's bytes per update,
the second half exposed.

Algorithm, two owners of the loop:
  * a train_step (`move_out`): nothing touches `.grad` between its forward and its backward; at a
    synchronising forward the accumulated gradients are moved out of `.grad` into the graph's inputs,
    and whatever no graph took goes back at the end of the backward.
  * a user's own loop may zero, rescale or replace `.grad` after the forward (Lightning zeroes there),
    so the gradients are lent, not moved, and only when the forward follows a `no_sync()` forward with
    gradients (nanoGPT, Lightning and the HF Trainer accumulate so; a loop that zeroes after the forward
    of every synchronised step keeps its one graph). When the backward begins, before any compiled
    backward runs, each lent tensor is settled: still `.grad`, `.grad` lets go of it (autograd must not
    add this micro-batch to it a second time) and the graph reads its values as they are now (its
    version is put back, so autograd takes an in-place write since the forward instead of refusing a
    saved tensor modified in place); dropped or replaced, it is zeroed, so the graph adds none of it,
    and a replacement is reduced after the backward like any other `.grad` held then.
  * under CUDA graphs (`lend=False`) a user's loop lends nothing: replay copies graph inputs into its
    own buffers at the forward, so a write or a drop before the backward would not reach the graph.

Debugging: the synchronising graph's variant is `reduce_acc` (`report()["graphs"]`), and
`report()["in_graph"]["leftovers_last_step"]` names what was reduced after the backward.
"""

from __future__ import annotations

from typing import Sequence

import torch

from aot.torch_eager import set_version, version_of


class AccumulatedGradients:
    """The accumulated `.grad` of one DDP model's reduced parameters, on their way into the graphs."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, lend: bool) -> None:
        self.params = list(params)
        self._by_id = {id(p): p for p in self.params}
        self.lend = lend
        """Whether a user's loop lends its accumulated `.grad` (off under CUDA graphs, see the Note)."""
        self.move_out = False
        """True (a train_step): moved out of `.grad` at the forward instead of lent."""
        self._stash: dict[int, torch.Tensor] = {}  # this forward's accumulated gradients, by parameter id
        self._lent: dict[int, tuple[torch.Tensor, int]] = {}  # taken by a graph, still `.grad`: (tensor, version)
        self._after_no_sync = False  # the last forward with gradients ran under no_sync
        self._let_go: dict[int, torch.Tensor] = {}  # lent, and `.grad` let go of it when the backward began

    def at_forward(self, *, sync: bool) -> bool:
        """Before the DDP model's forward (`sync`: it will reduce); whether its graphs take accumulated gradients."""
        if not sync:
            self._after_no_sync = self._after_no_sync or torch.is_grad_enabled()
            return False
        if not (self.move_out or (self._after_no_sync and self.lend)):
            return False
        self._stash = {id(p): p.grad for p in self.params if p.grad is not None}
        if self.move_out:
            for p in self.params:
                p.grad = None
        return bool(self._stash)

    def take(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The graph input for `param` at a run of a graph that takes them (zeros where none was accumulated)."""
        acc = self._stash.pop(id(param), None)
        if acc is None:
            return torch.zeros_like(param)
        if not self.move_out:
            self._lent[id(param)] = (acc, version_of(acc))
        return acc

    def at_backward_start(self) -> None:
        """Settle what was lent, before any compiled backward runs (see the Note)."""
        self._after_no_sync = False
        for pid, (acc, version) in self._lent.items():
            p = self._by_id[pid]
            if p.grad is acc:
                p.grad = None  # the graph's backward reduces it with this micro-batch; the sum becomes `.grad`
                self._let_go[pid] = acc
                if version_of(acc) != version:  # written in place since the forward: read as it is now
                    set_version(acc, version)
            else:  # dropped or replaced since the forward (`zero_grad()`): the graph must add none of it
                acc.zero_()
                set_version(acc, version)
        self._lent = {}

    def at_backward_end(self) -> set[int]:
        """What no graph took: moved out of `.grad`, it goes back (lent, it never left). A lent gradient whose
        `.grad` stayed empty (`torch.autograd.grad` fills no `.grad`) is given back as it was, unreduced: the
        ids of those are returned."""
        given_back = set()
        for pid, acc in self._let_go.items():
            p = self._by_id[pid]
            if p.grad is None:
                p.grad = acc
                given_back.add(pid)
        self._let_go = {}
        if self.move_out:
            for pid, acc in self._stash.items():
                p = self._by_id[pid]
                p.grad = acc if p.grad is None else p.grad.add_(acc)
        self._stash = {}
        return given_back

    def abandon(self) -> None:
        """The forward that took them never ran its backward."""
        self.at_backward_end()
        self._lent = {}
