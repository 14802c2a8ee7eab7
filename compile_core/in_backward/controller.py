"""When `train_step` updates inside the backward, and why not when it does not (`InBackwardController`).

It follows Note [Optimizer update inside the backward] (compile_core/in_backward/__init__.py). Besides
switching on after update 1 and off for good when the model or the optimizer no longer fits, the
controller restarts the in-backward updates when optimizer state the compiled backward reads has gone
(`optimizer.state.clear()`, a `load_state_dict` without some parameters): that update's backward is the
compiled variant that only reduces (compiled then, once, if update 1 ran eagerly: eager DDP is no option
any more, DDP's reducer was released after the first compiled step), torch's own step recreates the state
after it, and the updates return into the backward from the next update on.

Its only contact with the in-graph reducer is the contract of ddp/in_graph/hooks.py: `begin_step(hook or
None)` before each synchronising forward, `step_outcome()` after the backward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from compile_core.in_backward.graph_inputs import UpdatesHook
from compile_core.in_backward.optimizer import OptimizerInBackward
from compile_core.step.optim_math import support
from ddp.in_graph import InGraphReducer, StepOutcome

logger = logging.getLogger(__name__)


class InBackwardController:
    """When `train_step` updates inside the backward, and why not when it does not (see the module doc)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reducer: InGraphReducer,
        *,
        clip_max_norm: float | None,
        half_on_kernel: bool = False,
        blocker: str | None = None,
    ) -> None:
        self.reducer = reducer
        self.updates = OptimizerInBackward(optimizer, clip_max_norm=clip_max_norm, half_on_kernel=half_on_kernel)
        self.hook = UpdatesHook(self.updates)
        self.reason: str | None = blocker or support(optimizer)
        """Why updates are not (or no longer) inside the backward; None while they are or may be."""
        self.active = False
        """Whether the coming synchronising backwards update (the reducer gets the hook at each one)."""
        self.from_update: int | None = None
        """First update applied inside the backward."""
        self.updates_in_backward = 0
        """Updates applied inside the backward so far."""
        self.restarted_at: list[int] = []
        """Updates that recreated lost optimizer state on the normal path (see the module doc)."""
        self.recompiled_for: list[str] = []
        """Why the backward with updates compiled again: constants of the fused kernel that changed."""

    def before_sync_step(self, index: int) -> None:
        """Before the forward of the micro-batch of update `index` that will update: stale templates
        switch us off; lost optimizer state pauses us for this update; else this update's scalars (step
        counts, schedules) are computed. The reducer learns whether this step's backward updates."""
        if self.active:
            changed = self.updates.changed_hyperparameters()
            if changed is not None:
                self._stop(changed)
            elif not self._paused_for_lost_state(index):
                self._note_moved_constants(index)
                self.updates.refresh()
        self.reducer.begin_step(self.hook if self.active else None)

    def _note_moved_constants(self, index: int) -> None:
        moved = self.updates.moved_constants()
        if moved:
            self.recompiled_for.append(f"update {index}: " + "; ".join(moved))
            logger.warning(
                "train_step: before update %d, %s, a constant of torch's fused kernel in the compiled backward: "
                "the backward compiles again, with the per-parameter update (which reads it as a value) for %s",
                index,
                "; ".join(moved),
                "that group" if len(moved) == 1 else "those groups",
            )

    def _paused_for_lost_state(self, index: int) -> bool:
        lost = self.updates.lost_state()
        if not lost:
            return False
        self.active = False  # `after_update` switches back on
        self.restarted_at.append(index)
        logger.warning(
            "train_step: %d parameter(s) lost their optimizer state before update %d (cleared, or a checkpoint "
            "without it was loaded); torch's step recreates it in this update, the backward updates again after it",
            len(lost),
            index,
        )
        return True

    def eager_first_update(self, ddp: Any) -> bool:
        """Whether update 1 (forward, backward, step) can run as eager DDP: it only creates the optimizer
        state and shows what reaches the gradients, and compiling its variant of the graph (the backward
        that reduces without updating) would serve that one step. Not with clipping (the update needs to
        know every parameter reduced after the backward, learnt from a compiled step), nor static_graph
        (DDP's reducer would see one active step, then idle ones), nor a 16-bit wire asked for by
        `reduce_dtype=` rather than by a comm hook (DDP's reducer would average update 1 in full precision)."""
        reduction = self.reducer.reduction
        wire_of_ours = reduction.in_graph and reduction.wire_dtype is not None and reduction.hook is None
        return (
            self.reason is None
            and not self.active
            and self.updates.clip_max_norm is None
            and not getattr(ddp, "static_graph", False)
            and not wire_of_ours
        )

    def after_update(self, index: int, *, ran_eagerly: bool = False) -> None:
        """After update `index` ran the normal path: switch to in-backward updates when it can. After an
        eager step the compiled graphs are not known yet: each graph's compile decides (a graph break,
        no state: no update in that graph) and `applied()` switches off if none updated."""
        if self.reason is not None or self.active:
            return
        self.reason = self._blocker(self.reducer.step_outcome(), compiled=not ran_eagerly)
        if self.reason is not None:
            return
        self.updates.prepare()
        self.active = True
        if self.from_update is None:
            self.from_update = index + 1

    def _blocker(self, outcome: StepOutcome, *, compiled: bool = True) -> str | None:
        """Why the model, as the first update showed it, cannot update inside its backward."""
        if not outcome.in_graph:
            return f"the compiled backward does not reduce: {outcome.not_in_graph_reason}"
        if not compiled:
            return None
        if outcome.graphs != 1:
            return (
                f"the model ran as {outcome.graphs} compiled graph(s); updates inside the backward "
                "need the model in one graph"
            )
        after = sorted(set(outcome.reduced_after))
        if self.updates.clip_max_norm is not None and (after or outcome.ignored):
            kept = after or sorted(outcome.ignored)
            return (
                f"clipping needs the global norm of every gradient inside the backward, but {kept[:5]} "
                "are reduced after it (or not reduced: ignored by DDP)"
            )
        return None

    def applied(self) -> bool:
        """Whether the backward just run updated the parameters (then the optimizer step is skipped)."""
        if not self.active:
            return False
        outcome = self.reducer.step_outcome()
        if outcome.hook_ran:
            self.updates.advance_steps(outcome.used_up)
            self.updates_in_backward += 1
            if outcome.stop_reason is not None:
                self._stop(outcome.stop_reason)  # this update is done (the rest by the normal step); not the next
            return True
        if not outcome.in_graph:  # DDP's reducer reduced this step (inside ddp.join(): ddp/in_graph/join.py)
            self._stop(f"the compiled backward does not reduce: {outcome.not_in_graph_reason}")
        elif outcome.hook_reason is None and outcome.graphs == 0:
            # torch 2.11: a graph break inside the loop over the blocks, and Dynamo compiled no frame of the model
            self._stop("no compiled graph ran in the forward (Dynamo ran the model eagerly); the update stays after it")
        else:
            self._stop(outcome.hook_reason or "the compiled graph did not update the parameters")
        return False

    def _stop(self, reason: str) -> None:
        self.reason = reason
        self.active = False

    def to_dict(self, requested: bool) -> dict[str, Any]:
        outcome = self.reducer.step_outcome()
        return {
            "requested": requested,
            "active": self.active,
            "from_update": self.from_update,
            "updates_in_backward": self.updates_in_backward,
            "restarted_after_lost_state": list(self.restarted_at),
            "grads_kept_last_backward": outcome.grads_kept,
            "not_updated_in_backward": list(outcome.skipped),
            "fused_kernel_groups": self.updates.fused_groups(),
            "update_graph_groups": self.updates.update_graph_groups(),
            "recompiled_for_changed_constants": list(self.recompiled_for),
            "clip": None
            if self.updates.clip_max_norm is None
            else "global norm of all reduced gradients, after the last all-reduce, inside the backward",
            "reason": self.reason,
        }
