"""Scheduler-driven hyperparameters as 0-dim tensors we own, so schedulers never cause recompiles.

A scheduler writes a new Python float into `param_groups` every step; Dynamo guards on that value
and would recompile the optimizer update every step. So the compiled update reads a 0-dim tensor
we own instead of the learning rate (and Adam's betas, whose beta1 OneCycleLR/CyclicLR cycle):
only while our compiled update runs (`HyperparamPins.applied()`) do the groups hold those tensors,
filled from whatever the scheduler wrote; before and after, they hold the user's floats and flags.
So a user who calls `optimizer.step()` directly, reads `scheduler.get_last_lr()`, saves
`optimizer.state_dict()` or builds a second optimizer over the same parameters gets exactly what
plain PyTorch gives. The update inside the backward reads the same tensors (`tensor()`), filled by
`sync()` before each step.
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
    """Our tensors for one param group, and the flags our compiled update needs."""

    owned: dict[str, Any]
    """Key -> our 0-dim tensor (a tuple of two for betas)."""
    flags: dict[str, Any]
    """Flag -> the value our compiled update needs (`capturable=True` for foreach with a tensor lr)."""


class HyperparamPins:
    """Owns the 0-dim tensors that stand in for scheduler-driven hyperparameters (see the module doc)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._groups: list[_GroupPins] | None = None  # one per param group, in param_groups order
        self._saved: list[dict[str, Any]] | None = None  # the user's values while `applied()`

    def install(self) -> None:
        """Create our tensors (idempotent); the groups keep the user's values."""
        if self._groups is not None:
            return
        self._groups = []
        for group in self._optimizer.param_groups:
            owned: dict[str, Any] = {}
            flags: dict[str, Any] = {}
            # A value the user already gave as a tensor is theirs: schedulers fill it in place.
            for key in _PINNED_SCALARS:
                if key in group and not isinstance(group[key], torch.Tensor):
                    owned[key] = _scalar_tensor(group[key])
            betas = group.get(_PINNED_BETA)
            if isinstance(betas, tuple) and not any(isinstance(b, torch.Tensor) for b in betas):
                owned[_PINNED_BETA] = tuple(_scalar_tensor(b) for b in betas)
            # torch rejects a tensor lr with foreach=True unless capturable=True (both work on CPU and GPU).
            if owned and group.get("foreach") and not group.get("capturable", True):
                flags["capturable"] = True
            self._groups.append(_GroupPins(owned=owned, flags=flags))
        self.sync()

    @property
    def installed(self) -> bool:
        return self._groups is not None

    def sync(self) -> None:
        """Copy the groups' current values (what a scheduler or load_state_dict wrote) into our tensors."""
        for group, pins in zip(self._optimizer.param_groups, self._groups or ()):
            for key, mine in pins.owned.items():
                current = group[key]
                if key == _PINNED_BETA:
                    for c, m in zip(current, mine):
                        if c is not m:
                            m.fill_(c)  # float or tensor; fill_ never allocates
                elif current is not mine:
                    mine.fill_(current)

    def tensor(self, group_index: int, key: str) -> torch.Tensor:
        """Our tensor for `key` ("lr", "beta1", "beta2") of param group `group_index`."""
        owned = self._groups[group_index].owned
        if key == "lr":
            return owned["lr"]
        return owned[_PINNED_BETA][0 if key == "beta1" else 1]

    def has(self, group_index: int, key: str) -> bool:
        if self._groups is None:
            return False
        owned = self._groups[group_index].owned
        return key in owned if key == "lr" else _PINNED_BETA in owned

    def uninstall(self) -> None:
        """Forget our tensors (the update falls back to eager)."""
        self._groups = None

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Our tensors and flags in the groups for the block (our compiled update); the user's values after."""
        if self._groups is None or self._saved is not None:
            yield
            return
        self.sync()
        self._saved = [
            self._swap(group, {**pins.owned, **pins.flags})
            for group, pins in zip(self._optimizer.param_groups, self._groups)
        ]
        try:
            yield
        finally:
            for group, values in zip(self._optimizer.param_groups, self._saved):
                group.update(values)
            self._saved = None

    @contextlib.contextmanager
    def user_values(self) -> Iterator[None]:
        """Inside `applied()`: the user's values again for the block (an eager `optimizer.step()`: torch
        refuses a tensor lr with foreach unless capturable, and capturable on the CPU unless compiling)."""
        if self._saved is None:
            yield
            return
        ours = [self._swap(group, values) for group, values in zip(self._optimizer.param_groups, self._saved)]
        try:
            yield
        finally:
            for group, values in zip(self._optimizer.param_groups, ours):
                group.update(values)

    @staticmethod
    def _swap(group: dict, values: dict[str, Any]) -> dict[str, Any]:
        """Put `values` into `group`; return what they replaced."""
        replaced = {k: group[k] for k in values if k in group}
        group.update(values)
        return replaced


def _scalar_tensor(value: Any) -> torch.Tensor:
    # float64 on the CPU: holds a Python float exactly (schedulers compute in double as they do
    # eagerly); a 0-dim tensor does not promote the float32 parameters it multiplies, and CPU scalars
    # are what torch's compiled-optimizer recipe uses.
    return torch.tensor(float(value), dtype=torch.float64)
