"""`TrainStepConfig`: how `compile_core.train_step` captures a step; validated on construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import torch

from compile_core.config import DDP_MODES

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes `autocast=` accepts."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStepConfig:
    """How a train step is captured; validated on construction."""

    backend: str | Callable[..., Any] = "inductor"
    """Dynamo backend for the model and the optimizer update ("inductor", "aot_eager", "eager", ...)."""
    ddp: str | None = "split"
    """How compile_core handles DDP: "split", "none", "torch", or None for compile_core's default."""
    accum_steps: int = 1
    """Micro-batches per optimizer update; each call of the step consumes one micro-batch."""
    clip_grad_norm: float | None = None
    """Max global L2 norm of the (all-reduced) gradients before the update; None disables clipping."""
    autocast: torch.dtype | None = None
    """Autocast dtype for forward + loss (torch.bfloat16 or torch.float16); None runs in full precision."""
    optimizer_in_backward: bool = False
    """Update each bucket's parameters inside the compiled backward (needs ddp="in_graph")."""
    compile_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments for compile_core.compile (bucket_cap_mb, fullgraph, mode, ...)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(
                f"backend={self.backend!r}: expected a backend name such as 'inductor' or 'aot_eager', "
                "or a Dynamo backend callable"
            )
        if self.ddp not in (*DDP_MODES, None):
            raise ValueError(f"ddp={self.ddp!r}: expected one of {', '.join(map(repr, (*DDP_MODES, None)))}")
        if isinstance(self.accum_steps, bool) or not isinstance(self.accum_steps, int):
            raise TypeError(f"accum_steps={self.accum_steps!r}: expected an int >= 1 (micro-batches per update)")
        if self.accum_steps < 1:
            raise ValueError(
                f"accum_steps={self.accum_steps}: must be >= 1; use 1 for no accumulation, "
                "k to update once every k calls"
            )
        if self.clip_grad_norm is not None:
            bad_type = isinstance(self.clip_grad_norm, bool) or not isinstance(self.clip_grad_norm, (int, float))
            if bad_type or not math.isfinite(self.clip_grad_norm) or self.clip_grad_norm <= 0:
                raise ValueError(
                    f"clip_grad_norm={self.clip_grad_norm!r}: must be a finite number > 0 (e.g. 1.0), "
                    "or None to disable clipping"
                )
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"autocast={self.autocast!r}: expected torch.bfloat16, torch.float16 or None "
                "(None runs forward and loss in full precision)"
            )
        if not isinstance(self.optimizer_in_backward, bool):
            raise TypeError(f"optimizer_in_backward={self.optimizer_in_backward!r}: expected True or False")
        if self.optimizer_in_backward and self.ddp != "in_graph":
            raise ValueError(
                f"optimizer_in_backward=True needs ddp='in_graph' (got ddp={self.ddp!r}): the update runs where "
                "the compiled backward all-reduces each bucket"
            )
        if not isinstance(self.compile_kwargs, Mapping):
            raise TypeError(f"compile_kwargs={self.compile_kwargs!r}: expected a mapping of keyword arguments")
