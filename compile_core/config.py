"""`CompileConfig`: every knob of `compile_core.compile`, validated before any compile work."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from aot import torch_dynamo
from ddp import torch_ddp
from ddp.bucketing import MiB, caps_from_mb, resolve_caps
from ddp.in_graph.policy import check_reduce_dtype
from inductor import InductorSettings, torch_inductor

DDP_DEFAULT_CAP_BYTES = 25 * MiB
"""DDP's own default `bucket_cap_mb` (25 MiB), for models that are not DDP."""
_UNKNOWN_CAP = 1 << 62
AUTO = "auto"
"""`bucket_cap_mb` value that asks for a cap chosen from a measured all-reduce."""

BACKENDS = ("inductor", "aot_eager", "eager")
"""Backends by name; each adds one layer: eager = Dynamo only, aot_eager = + AOTAutograd, inductor = + codegen."""
DDP_MODES = ("split", "in_graph", "none", "torch")
"""split: bucket-aligned pieces; in_graph: one graph whose backward all-reduces its buckets itself;
none: one graph, all-reduce after backward; torch: PyTorch's DDPOptimizer."""
FALLBACK_CHAIN = {
    "inductor": ("inductor", "aot_eager", "eager"),
    "aot_eager": ("aot_eager", "eager"),
    "eager": ("eager",),
}
"""What a piece falls back to when its backend fails to compile it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """How `compile_core.compile` compiles a model."""

    backend: str | Callable[..., Any] = "inductor"
    """'inductor', 'aot_eager', 'eager', or a Dynamo backend callable (gm, example_inputs) -> callable."""
    ddp: str | None = None
    """'split', 'in_graph', 'none' or 'torch'; None = 'split' (whole graphs for a non-DDP model)."""
    bucket_cap_mb: float | str | None = None
    """Bucket cap in MiB; None = the DDP object's own cap; "auto" = chosen from an all-reduce timed at
    compile time (ddp/bucketing/auto_cap.py)."""
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
    reuse_pieces: bool = True
    """Keep bucket cuts in step with repeated blocks and compile identical pieces once
    (compile_core/reuse/compile_once.py); False: cut by bytes alone and compile every piece."""
    reduce_dtype: torch.dtype | None = None
    """ddp='in_graph' only: the dtype gradients are all-reduced in (cast per bucket, as DDP's
    fp16/bf16 compress hooks do); None = the gradients' own dtype (or the registered hook's)."""
    nested_regions: bool = False
    """ddp='in_graph' only: each repeated block becomes one nested compile region, traced once and called
    per layer (compile_core/regions.py)."""

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
        # Types, signs and first <= cap when both are given; the DDP object's cap is not known yet,
        # so the first cap is checked against it again in `caps()`.
        if isinstance(self.bucket_cap_mb, str):
            if self.bucket_cap_mb != AUTO:
                raise TypeError(
                    f"bucket_cap_mb={self.bucket_cap_mb!r}: give a number of MiB > 0, None (the DDP object's cap) "
                    f"or {AUTO!r} (chosen from a measured all-reduce)"
                )
            if self.ddp in ("none", "torch"):
                raise ValueError(
                    f"bucket_cap_mb='auto' sizes the buckets we plan, and ddp={self.ddp!r} plans none "
                    "(DDP's reducer keeps its own cap): use ddp='split' or 'in_graph', or give DDP bucket_cap_mb"
                )
        caps_from_mb(
            None if self.auto_cap else self.bucket_cap_mb, self.first_bucket_cap_mb, default_cap_bytes=_UNKNOWN_CAP
        )
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"fullgraph={self.fullgraph!r} must be True or False")
        if not isinstance(self.nested_regions, bool):
            raise TypeError(f"nested_regions={self.nested_regions!r} must be True or False")
        if self.nested_regions and self.ddp != "in_graph":
            raise ValueError(
                f"nested_regions=True needs ddp='in_graph' (got ddp={self.ddp!r}): ddp='split' cuts graphs at "
                "bucket boundaries, which can fall inside a block; use ddp='in_graph' or leave nested_regions off"
            )
        if not isinstance(self.reuse_pieces, bool):
            raise TypeError(f"reuse_pieces={self.reuse_pieces!r} must be True or False")
        if self.dynamic not in (None, True, False):
            raise TypeError(f"dynamic={self.dynamic!r} must be True, False or None")
        if (self.mode is not None or self.options) and self.backend != "inductor":
            raise ValueError(
                f"mode={self.mode!r}/options={self.options!r} only apply to backend='inductor' "
                f"(backend={self.backend!r}); drop them or use the inductor backend"
            )
        check_reduce_dtype(self.reduce_dtype)
        if self.reduce_dtype is not None and self.ddp != "in_graph":
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype} only applies to ddp='in_graph' (got ddp={self.ddp!r}); with "
                "ddp='split' register DDP's fp16_compress_hook/bf16_compress_hook on the DDP object instead"
            )
        # Validates mode/options names now rather than at the first compile.
        patches = self.inductor_settings().config_patches() if self.backend == "inductor" else {}
        if self.ddp == "in_graph" and patches.get("fallback_by_default") and patches.get("selective_decompose"):
            raise ValueError(
                f"mode={self.mode!r}/options={self.options!r} with ddp='in_graph': Inductor's lite settings "
                "(fallback_by_default with selective_decompose) compile a backward without our all-reduces (torch "
                "2.13: the ranks' gradients differed after one step); use them with ddp='split', or ddp='in_graph' "
                "without them"
            )
        why = torch_blocker(self.ddp, self.backend_name, nested_regions=self.nested_regions)
        if why is not None:
            others = [m for m in DDP_MODES if m != self.ddp and torch_blocker(m, self.backend_name) is None]
            instead = f", or use ddp={others[0]!r}" if others else ""
            raise ValueError(
                f"ddp={self.ddp or 'split'!r} with backend={self.backend_name!r} cannot run on torch "
                f"{torch.__version__}: {why}. Install a supported torch (2.11 to 2.14; pip install torch==2.13.0 "
                f"is the tested default){instead}; `python -m compile_core.doctor` lists what this torch offers"
            )

    @property
    def auto_cap(self) -> bool:
        """True when the bucket cap is to be chosen from a measured all-reduce."""
        return self.bucket_cap_mb == AUTO

    def caps(self, ddp_cap_bytes: int | None, *, auto_cap_bytes: int | None = None) -> tuple[int, int]:
        """(bucket cap, first-bucket cap) in bytes; unset caps come from the DDP object (`ddp_cap_bytes`);
        with `bucket_cap_mb="auto"` the cap is `auto_cap_bytes` and the first cap is clamped to it."""
        if self.auto_cap:
            if auto_cap_bytes is None:
                raise ValueError("bucket_cap_mb='auto' needs the measured cap (auto_cap_bytes)")
            first = None if self.first_bucket_cap_mb is None else int(self.first_bucket_cap_mb * MiB)
            return resolve_caps(auto_cap_bytes, None if first is None else min(first, auto_cap_bytes))
        default = DDP_DEFAULT_CAP_BYTES if ddp_cap_bytes is None else ddp_cap_bytes
        return caps_from_mb(self.bucket_cap_mb, self.first_bucket_cap_mb, default_cap_bytes=default)

    def inductor_settings(self) -> InductorSettings:
        return InductorSettings(mode=self.mode, options=self.options, dynamic=self.dynamic)

    @property
    def backend_name(self) -> str:
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")

    def fallback_chain(self) -> tuple[str, ...]:
        if isinstance(self.backend, str):
            return FALLBACK_CHAIN[self.backend]
        return ("custom", "eager")


def torch_blocker(ddp: str | None, backend: str, *, nested_regions: bool = False) -> str | None:
    """Why `ddp=` with `backend` cannot work on the installed torch (None when it can), from what each torch
    home finds this torch offers (`ddp/torch_ddp.py`, `aot/torch_dynamo.py`, `inductor/torch_inductor.py`).
    `ddp=None` is checked as "split", the default for the DDP models this library is for."""
    mode = ddp or "split"
    why = [
        text
        for home in (torch_ddp, torch_dynamo, torch_inductor)
        if (text := home.blocker(mode, backend=backend, nested_regions=nested_regions)) is not None
    ]
    return "; ".join(why) or None
