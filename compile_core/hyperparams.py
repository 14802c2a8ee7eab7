"""Scheduler-driven hyperparameters as 0-dim tensors we own, so schedulers never cause recompiles.

A scheduler writes a new Python float into `param_groups` every step; Dynamo guards on that value
and would recompile the optimizer update every step. Before the first compile the learning rate
(and Adam's betas, whose beta1 OneCycleLR/CyclicLR cycle) becomes a 0-dim tensor we own; before
every update whatever the scheduler wrote is copied into that tensor and the tensor put back. A
post-hook on `optimizer.state_dict()` turns them back into floats (and restores flags we had to
change), so checkpoints stay in the user's format and load into a plain eager optimizer.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch

# Hyperparameters that LR schedulers rewrite every step; each becomes a 0-dim tensor we own.
_PINNED_SCALARS = ("lr",)
_PINNED_BETA = "betas"  # only beta1 is cycled (OneCycleLR/CyclicLR), but torch wants both as tensors


@dataclasses.dataclass
class _GroupPins:
    """Our tensors for one param group, and the user's values of the flags we had to change."""

    owned: dict[str, Any]
    """Key -> our 0-dim tensor (a tuple of two for betas)."""
    restore: dict[str, Any]
    """Flag -> the user's value; while pinned, each such flag is True (only `capturable` today)."""


class HyperparamPins:
    """Owns the 0-dim tensors that stand in for scheduler-driven hyperparameters in param_groups."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._groups: list[_GroupPins] = []  # one per param group, in param_groups order
        self._hook = None

    def install(self) -> None:
        """Swap floats for tensors (before the first compile) and hook state_dict."""
        for group in self._optimizer.param_groups:
            owned: dict[str, Any] = {}
            restore: dict[str, Any] = {}
            # A value the user already gave as a tensor is theirs: schedulers fill it in place.
            for key in _PINNED_SCALARS:
                if key in group and not isinstance(group[key], torch.Tensor):
                    owned[key] = _scalar_tensor(group[key])
            betas = group.get(_PINNED_BETA)
            if isinstance(betas, tuple) and not any(isinstance(b, torch.Tensor) for b in betas):
                owned[_PINNED_BETA] = tuple(_scalar_tensor(b) for b in betas)
            # torch rejects a tensor lr with foreach=True unless capturable=True (both work on CPU and GPU).
            if owned and group.get("foreach") and not group.get("capturable", True):
                restore["capturable"] = group["capturable"]
            self._groups.append(_GroupPins(owned=owned, restore=restore))
        self.sync()
        if self._hook is None:
            self._hook = self._optimizer.register_state_dict_post_hook(self._user_format)

    def sync(self) -> None:
        """Copy whatever a scheduler (or load_state_dict) wrote into our tensors; put them back."""
        for group, pins in zip(self._optimizer.param_groups, self._groups):
            group.update(dict.fromkeys(pins.restore, True))  # load_state_dict brings back the user's flags
            for key, mine in pins.owned.items():
                current = group[key]
                if key == _PINNED_BETA:
                    if not all(c is m for c, m in zip(current, mine)):
                        for c, m in zip(current, mine):
                            if c is not m:
                                m.fill_(c)  # float or tensor; fill_ never allocates
                        group[key] = mine
                elif current is not mine:
                    mine.fill_(current)
                    group[key] = mine

    def uninstall(self) -> None:
        """Back to plain floats and the user's flags (used when the update falls back to eager)."""
        for group, pins in zip(self._optimizer.param_groups, self._groups):
            for key in pins.owned:
                group[key] = to_float(group[key])
            group.update(pins.restore)
        self._groups = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @contextlib.contextmanager
    def user_values(self) -> Iterator[None]:
        """The user's floats and flags in the groups for the block (an eager `optimizer.step()`:
        torch refuses a tensor lr with foreach unless capturable, and capturable on the CPU unless compiling)."""
        for group, pins in zip(self._optimizer.param_groups, self._groups):
            for key in pins.owned:
                group[key] = to_float(group[key])
            group.update(pins.restore)
        try:
            yield
        finally:
            for group, pins in zip(self._optimizer.param_groups, self._groups):
                group.update(pins.owned)
                group.update(dict.fromkeys(pins.restore, True))

    def _user_format(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        # state_dict() builds new group dicts, so editing them leaves the live groups alone.
        for group, pins in zip(state["param_groups"], self._groups):
            # initial_lr: a scheduler built after the swap clones our lr tensor into it.
            for key in (*pins.owned, "initial_lr") if "lr" in pins.owned else pins.owned:
                if key in group:
                    group[key] = to_float(group[key])
            group.update(pins.restore)
        return state


def _scalar_tensor(value: Any) -> torch.Tensor:
    # float64 on the CPU: holds a Python float exactly (so checkpoints round-trip bit for bit and
    # schedulers compute in double as they do eagerly); a 0-dim tensor does not promote the
    # float32 parameters it multiplies, and CPU scalars are what torch's compiled-optimizer recipe uses.
    return torch.tensor(float(value), dtype=torch.float64)


def to_float(value: Any) -> Any:
    """0-dim tensors (and tuples of them) to Python floats; ours live on the CPU, so no GPU wait."""
    if isinstance(value, tuple):
        return tuple(to_float(v) for v in value)
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return value


def last_lr_as_floats(scheduler: Any) -> None:
    """The scheduler records the (now tensor) LRs it set; `get_last_lr()` and its state_dict keep floats."""
    # Our tensors live on the CPU, so .item() reads host memory and never waits on a GPU.
    last = getattr(scheduler, "_last_lr", None)
    if isinstance(last, list) and any(isinstance(v, torch.Tensor) for v in last):
        scheduler._last_lr = [to_float(v) for v in last]
