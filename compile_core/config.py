"""`CompileConfig`: every knob of `compile_core.compile`, validated before any compile work."""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Mapping

from inductor import InductorSettings

BACKENDS = ("inductor", "aot_eager", "eager")
"""Backends by name; each adds one layer: eager = Dynamo only, aot_eager = + AOTAutograd, inductor = + codegen."""
DDP_MODES = ("split", "none", "torch")
"""split: bucket-aligned pieces; none: one graph, all-reduce after backward; torch: PyTorch's DDPOptimizer."""
FALLBACK_CHAIN = {"inductor": ("inductor", "aot_eager", "eager"), "aot_eager": ("aot_eager", "eager"), "eager": ("eager",)}
"""What a piece falls back to when its backend fails to compile it."""


def _check_cap(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number of MiB (e.g. 25 or 0.5), or None for DDP's value")
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0 MiB (e.g. 25 or 0.5), or None for DDP's value")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """How `compile_core.compile` compiles a model."""

    backend: str | Callable[..., Any] = "inductor"
    """'inductor', 'aot_eager', 'eager', or a Dynamo backend callable (gm, example_inputs) -> callable."""
    ddp: str | None = None
    """'split', 'none' or 'torch'; None = 'split' (which compiles whole graphs for a non-DDP model)."""
    bucket_cap_mb: float | None = None
    """Bucket cap in MiB; None = the DDP object's own cap."""
    first_bucket_cap_mb: float | None = None
    """Cap of the first bucket in MiB; None = 1 MiB clamped to the bucket cap."""
    fullgraph: bool = False
    """Make the first graph break an error."""
    dynamic: bool | None = None
    """As for torch.compile: True = symbolic sizes from the start, None = after a size changes."""
    mode: str | None = None
    """A torch.compile mode name (Inductor only)."""
    options: Mapping[str, Any] | None = None
    """Inductor config overrides (Inductor only)."""

    def __post_init__(self) -> None:
        if isinstance(self.backend, str):
            if self.backend not in BACKENDS:
                raise ValueError(
                    f"backend={self.backend!r} is unknown; use one of {BACKENDS} or pass a Dynamo backend callable"
                )
        elif not callable(self.backend):
            raise TypeError(f"backend must be a name from {BACKENDS} or a callable, got {type(self.backend).__name__}")
        if self.ddp is not None and self.ddp not in DDP_MODES:
            raise ValueError(f"ddp={self.ddp!r} is unknown; use one of {DDP_MODES}")
        _check_cap("bucket_cap_mb", self.bucket_cap_mb)
        _check_cap("first_bucket_cap_mb", self.first_bucket_cap_mb)
        if (
            self.bucket_cap_mb is not None
            and self.first_bucket_cap_mb is not None
            and self.first_bucket_cap_mb > self.bucket_cap_mb
        ):
            raise ValueError(
                f"first_bucket_cap_mb={self.first_bucket_cap_mb} is larger than bucket_cap_mb={self.bucket_cap_mb}; "
                "the first bucket may only be smaller: lower first_bucket_cap_mb or raise bucket_cap_mb"
            )
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph={self.fullgraph!r} must be True or False")
        if self.dynamic not in (None, True, False):
            raise TypeError(f"dynamic={self.dynamic!r} must be True, False or None")
        if (self.mode is not None or self.options) and self.backend != "inductor":
            raise ValueError(
                f"mode={self.mode!r}/options={self.options!r} only apply to backend='inductor' "
                f"(backend={self.backend!r}); drop them or use the inductor backend"
            )
        # Validates mode/options names now rather than at the first compile.
        self.inductor_settings()

    def inductor_settings(self) -> InductorSettings:
        return InductorSettings(mode=self.mode, options=self.options, dynamic=self.dynamic)

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")

    def fallback_chain(self) -> tuple[str, ...]:
        if isinstance(self.backend, str):
            return FALLBACK_CHAIN[self.backend]
        return ("custom", "eager")
