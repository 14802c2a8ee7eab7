"""The private pieces of AOTAutograd and of fake tensors this project relies on: the fake mode a graph was
traced in, static example inputs, a tracing context for compiling a captured graph again, AOTAutograd as a
Dynamo backend and its switches (the backward compiled with the forward, saved tensors declared not donated).

Split from `aot/torch_dynamo.py` (Dynamo's guard hook, backends by name, graph breaks, compile errors, and the
capability table of both), which imports what it needs from here. Each function says which torch 2.13 file it
mirrors; `tests/single/test_torch_internals_dynamo.py` has its canary (section "aot/torch_aot.py").
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


def fake_mode_of(example_inputs: list) -> Any:
    """The FakeTensorMode Dynamo traced `example_inputs` with, or a new one (`_dynamo/utils.py`)."""
    return traced_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode()


def traced_fake_mode(example_inputs: list) -> Any:
    """The FakeTensorMode Dynamo traced `example_inputs` with, or None (real inputs: no trace)."""
    from torch._dynamo.utils import detect_fake_mode

    return detect_fake_mode(example_inputs)


def static_example(fake_mode: Any, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as an example input added beside Dynamo's (`fake_mode`: theirs, from `detect_fake_mode`, or
    None): a fake tensor of that mode with static shapes.

    AOTAutograd fakeifies a real example with a fresh size symbol per dimension and no source
    (`_aot_autograd/frontend_utils.py: process_inputs`); a guard on such a symbol (the bound of an index
    into it) then fails when Dynamo builds its guards ("sources must not be empty for symbol"). An added
    input has the same shape at every call, so a static fake is also the truth."""
    if fake_mode is None or isinstance(tensor, torch._subclasses.FakeTensor):
        return tensor
    return fake_mode.from_tensor(tensor, static_shapes=True)


def is_fake(x: Any) -> bool:
    """True for a FakeTensor (`torch/_subclasses/fake_tensor.py`)."""
    return isinstance(x, torch._subclasses.FakeTensor)


@contextlib.contextmanager
def static_tracing() -> Iterator[Callable[[list], list]]:
    """A tracing context for compiling a captured graph again after Dynamo's call returned, on real inputs
    of fixed shapes; yields `fakeify(inputs)`: the compile's example inputs, static fakes of its mode.

    Mirrors what Dynamo sets up around a backend (`torch._guards.tracing(TracingContext(fake_mode))`,
    `_dynamo/output_graph.py`) with a FakeTensorMode of its own that has a ShapeEnv but no symbols:
    AOTAutograd and Inductor bypass their caches without a ShapeEnv ("No shape env"), and would give each
    real input a fresh size symbol per dimension with one (`_aot_autograd/frontend_utils.py:
    process_inputs`), which static fakes do not get."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fakeify(inputs: list) -> list:
        return [static_example(mode, x) if isinstance(x, torch.Tensor) else x for x in inputs]

    with tracing(TracingContext(mode)):
        yield fakeify


@contextlib.contextmanager
def outside_any_compile() -> Iterator[None]:
    """Run as if no compile were in progress: no tracing context (`torch._guards.tracing(None)`) and no
    fake tensor mode (`unset_fake_temporarily`, `torch/_subclasses/fake_tensor.py`). For work a rank does
    while it waits inside a backend: tensors it makes there would otherwise be that compile's fake
    tensors, and a trace would share that compile's ShapeEnv."""
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with tracing(None), unset_fake_temporarily():
        yield


def aot_autograd_backend(**kwargs: Any) -> Callable[..., Any]:
    """A Dynamo backend running AOTAutograd with the given compilers (`_dynamo/backends/common.py`)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


def non_lazy_backward() -> contextlib.AbstractContextManager:
    """AOTAutograd compiles each backward right after its forward, not at the first backward.

    Mirrors `torch._functorch.config.force_non_lazy_backward_lowering` (`_functorch/config.py`,
    read in `_aot_autograd/graph_compile.py`). With it, a graph's cache entry is complete (and
    saved) as soon as its forward is compiled, and a compiled graph needs no per-graph forward
    metadata from the tracing context later: one compiled graph can serve several identical
    pieces, and a rank can load what another rank compiled before any backward runs.
    """
    return torch._functorch.config.patch(force_non_lazy_backward_lowering=True)


def declare_nothing_donated() -> None:
    """Tell AOTAutograd that the backward of the graph now being compiled overwrites no saved tensor.

    For a forward compiler whose backward runs the graph as it is (aot_eager). AOTAutograd lists the
    saved activations that alias no input or output (`fw_metadata.bw_donated_idxs`, filled before the
    compilers run, `_aot_autograd/graph_compile.py`) so that Inductor may reuse their memory, and then
    refuses any backward with `retain_graph=True` (`runtime_wrappers.py`). Lazily compiled, torch leaves
    that list empty when the first backward retains the graph; ours compile with the forward
    (`non_lazy_backward`), so a script whose backward retains the graph failed under aot_eager where
    `torch.compile` runs it. A compiler that reuses no buffer loses nothing by declaring none.
    """
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is not None and getattr(context, "fw_metadata", None) is not None:
        context.fw_metadata.bw_donated_idxs = []
