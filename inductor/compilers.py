"""Forward/backward compilers over Inductor: C++/OpenMP on CPU, Triton on GPU.

Inductor's entry point (`compile_fx`) runs AOTAutograd itself, with Inductor's decomposition table
and the min-cut partitioner, then compiles the forward and the backward graph with `compile_fx_inner`.
We call that entry point and wrap its inner compiler, so the graphs Inductor compiles can be recorded
by the caller (as forward/backward pairs) without this module knowing what a pair or a bucket is.
`mode` and `options` mean what they mean for `torch.compile`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import torch.fx as fx

from aot.torch_graphs import nested_region_calls
from inductor.torch_inductor import compile_fx_with, mode_names, mode_options, option_names, partitioner_patch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class InductorSettings:
    """How Inductor compiles; validated on construction."""

    mode: str | None = None
    """A `torch.compile` mode name, or None for the default."""
    options: Mapping[str, Any] | None = None
    """Inductor config overrides (`torch._inductor.config` names), applied on top of the mode."""
    dynamic: bool | None = None
    """Passed to the mode's option table (some modes differ for dynamic shapes)."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in mode_names():
            raise ValueError(f"mode={self.mode!r} is not a torch.compile mode; use one of {mode_names()} or None")
        if self.options is not None:
            if not isinstance(self.options, Mapping):
                raise TypeError(f"options must be a dict of Inductor config names, got {type(self.options).__name__}")
            known = option_names()
            unknown = [k for k in self.options if k not in known]
            if unknown:
                raise ValueError(f"options {unknown} are not Inductor config names; see torch._inductor.list_options()")

    def config_patches(self) -> dict[str, Any]:
        patches = mode_options(self.mode, self.dynamic) if self.mode else {}
        patches.update(self.options or {})
        return patches

    @property
    def cuda_graphs(self) -> bool:
        """Whether compiled graphs are captured as CUDA graphs (`reduce-overhead`, `max-autotune`, or the
        `triton.cudagraphs` option)."""
        return bool(self.config_patches().get("triton.cudagraphs"))


def inductor_compile(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    settings: InductorSettings,
    on_graph: Callable[[fx.GraphModule, bool], None] = lambda gm, is_backward: None,
    partitioner: Any = None,
) -> Callable[..., Any]:
    """Compile `gm` with Inductor; `on_graph(graph, is_backward)` sees each graph Inductor compiles.

    `partitioner` (a callable with a `uuid()`, taking `base=`: the user's own partitioner or None
    for min-cut) replaces the partition step, after Inductor's own joint-graph passes; its
    `inductor_requirements()`, if it has them, are options the graph is wrong without: they win, with a
    WARNING when they overrule the user's.
    """
    patches = settings.config_patches()
    _no_buffer_reuse_for_repeated_regions(gm, patches)
    if partitioner is not None:
        patches.update(partitioner_patch(partitioner, partitioner.uuid(), patches))
        for name, value in getattr(partitioner, "inductor_requirements", dict)().items():
            if name in patches and patches[name] != value:
                log.warning(
                    "compile_core: Inductor option %s=%r is overruled by %r for this graph: its in-graph "
                    "reduction needs it (see the partitioner's inductor_requirements)",
                    name,
                    patches[name],
                    value,
                )
            patches[name] = value
    return compile_fx_with(gm, example_inputs, on_graph=on_graph, config_patches=patches)


def _no_buffer_reuse_for_repeated_regions(gm: fx.GraphModule, patches: dict[str, Any]) -> None:
    """Turn Inductor's buffer reuse off for a graph that calls nested compile regions twice or more.

    Why: torch 2.13's Inductor, on the CPU, computed our GPT block's parameter gradients up to 65% off
    eager's once the block was a `torch.compiler.nested_compile_region` called twice or more (plain
    `torch.compile`, one process, no DDP); with `allow_buffer_reuse=False` they match eager to 7e-7
    (tests/single/test_aot_inductor.py). The cost is memory: no dead buffer is handed on to a later kernel.
    A user who set `allow_buffer_reuse=True` keeps it, with a warning.
    """
    calls = nested_region_calls(gm)
    if calls < 2:
        return
    if patches.get("allow_buffer_reuse") is True:
        log.warning(
            "compile_core: a graph calls nested_compile_region subgraphs %d times and options set "
            "allow_buffer_reuse=True: torch 2.13's Inductor computed wrong gradients that way (README, 'Limits "
            "we know of'); leave the option out and we turn buffer reuse off for such graphs",
            calls,
        )
        return
    patches["allow_buffer_reuse"] = False
