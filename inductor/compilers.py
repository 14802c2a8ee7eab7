"""Forward/backward compilers over Inductor: C++/OpenMP on CPU, Triton on GPU.

Inductor's entry point (`compile_fx`) runs AOTAutograd itself, with Inductor's decomposition table
and the min-cut partitioner, then compiles the forward and the backward graph with `compile_fx_inner`.
We call that entry point and wrap its inner compiler, so the graphs Inductor compiles can be recorded
by the caller (as forward/backward pairs) without this module knowing what a pair or a bucket is.
`mode` and `options` mean what they mean for `torch.compile`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch.fx as fx

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The modes `torch.compile` accepts."""


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
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not a torch.compile mode; use one of {MODES} or None")
        if self.options is not None:
            if not isinstance(self.options, Mapping):
                raise TypeError(f"options must be a dict of Inductor config names, got {type(self.options).__name__}")
            unknown = [k for k in self.options if not _is_inductor_option(k)]
            if unknown:
                raise ValueError(
                    f"options {unknown} are not Inductor config names; see torch._inductor.list_options()"
                )

    def config_patches(self) -> dict[str, Any]:
        import torch._inductor

        patches = dict(torch._inductor.list_mode_options(self.mode, self.dynamic)) if self.mode else {}
        patches.update(self.options or {})
        return patches


def _is_inductor_option(name: str) -> bool:
    import torch._inductor

    return name in set(torch._inductor.list_options())


def inductor_compile(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    settings: InductorSettings,
    on_graph: Callable[[fx.GraphModule, bool], None] = lambda gm, is_backward: None,
) -> Callable[..., Any]:
    """Compile `gm` with Inductor; `on_graph(graph, is_backward)` sees each graph Inductor compiles."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(graph: fx.GraphModule, inputs: list, **kwargs: Any) -> Any:
        on_graph(graph, bool(kwargs.get("is_backward", False)))
        return compile_fx_inner(graph, inputs, **kwargs)

    patches = settings.config_patches()
    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches or None)
