"""Every private piece of Dynamo this project relies on, in one place: how a function is compiled (the guard
hook, backends by name), what a compile raised and broke on, and what this torch offers of Dynamo, AOTAutograd
and the graph internals (`capabilities`, `blocker`). AOTAutograd's switches and fake modes are in
`aot/torch_aot.py`.

The layers above (`ddp`, `compile_core`) reach Dynamo's and AOTAutograd's internals only through
these functions and those of the other `aot/torch_*.py` homes. Each says which torch 2.13 file it mirrors;
`tests/single/test_torch_internals_dynamo.py` has one canary per function, failing with a message that names the
function when torch changes. Public routes (`torch.compile`, `torch.compiler.reset`, `functorch.compile`) are
used where torch 2.13 has one; what is here has none. The graphs Dynamo and AOTAutograd hand a backend
(nested compile regions, gradient outputs, saved values) and the compiled autograd node are read and rewritten
in `aot/torch_graphs.py`, torch's eager objects (a module's compiled call, pytree, the optimizer's step hooks)
in `aot/torch_eager.py`, and what the compile caches did is watched in `aot/torch_dynamo_cache.py`
(re-exported here).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx

from aot.torch_aot import aot_autograd_backend, outside_any_compile
from aot.torch_dynamo_cache import AotCache, CacheOutcome, watch_caches  # noqa: F401 - the caches' home, re-exported

RestartAnalysis = torch._dynamo.exc.RestartAnalysis
"""Dynamo's own control flow (`_dynamo/exc.py`): "trace this frame again"; never a compile failure."""

DynamoError = torch._dynamo.exc.TorchDynamoException
"""Base of every error Dynamo raises while capturing or compiling (`_dynamo/exc.py`)."""


def cause_chain(err: BaseException) -> list[BaseException]:
    """`err`, then what caused it, and so on: the last entry is the root cause.

    Dynamo wraps what a backend raises in `BackendCompilerFailed` and keeps it in `inner_exception`
    (`_dynamo/exc.py`), besides Python's own `__cause__`.
    """
    chain: list[BaseException] = []
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        chain.append(err)
        seen.add(id(err))
        err = getattr(err, "inner_exception", None) or err.__cause__
    return chain


def root_cause(err: BaseException, kind: type) -> BaseException | None:
    """The first exception of type `kind` inside `err`'s chain of causes (`cause_chain`).

    An error we raise on purpose inside our backend should reach the user as is.
    """
    return next((e for e in cause_chain(err) if isinstance(e, kind)), None)


def compile_with_guard_hook(
    fn: Callable[..., Any],
    backend: Callable[..., Any],
    *,
    on_guard_fail: Callable[[str, str], None],
    fullgraph: bool = False,
    dynamic: bool | None = None,
    isolate_recompiles: bool = False,
    guard_module_hooks: bool = False,
) -> Callable[..., Any]:
    """`torch.compile(fn, backend=...)` plus a callback per failed guard: `on_guard_fail(reason, where)`.

    Mirrors `torch._dynamo.optimize(..., guard_fail_fn=, isolate_recompiles=)` (`_dynamo/eval_frame.py`);
    `torch.compile` has no route to the guard failures, which are the reasons of every recompile.
    Dynamo calls the hook once per cached entry that failed, just before it compiles again.
    `isolate_recompiles` gives `fn` a cache of its own even when several wrappers share its code.
    Dynamo holds `backend` and what it compiles weakly (`_WeakBackend`); the returned function holds them.
    `guard_module_hooks`: a module hook registered or removed after a compile compiles again, as eager runs
    it (`_dynamo/config.py: skip_nnmodule_hook_guards`, True by default, leaves the first-compiled hooks
    running: plain `torch.compile` ignores a forward hook added after its first call).
    """

    hold = _Hold(lookup_backend(backend), on_guard_fail)
    weak_hold = weakref.ref(hold)  # Dynamo's guards keep this hook (see `_WeakBackend`)

    def guard_fail_fn(failure: Any) -> None:  # a `GuardFail(reason, orig_code)` (`_dynamo/types.py`)
        code = getattr(failure, "orig_code", None)
        where = f"{code.co_filename}:{code.co_firstlineno} {code.co_name}" if code is not None else ""
        alive = weak_hold()
        if alive is not None:
            alive.on_guard_fail(str(getattr(failure, "reason", failure)), where)

    # isolate_recompiles came with torch 2.13. Without it (2.11, the GPU machines' torch) every wrapper of one
    # code object shares that code's cache: the per-block optimizer update compiles one function per distinct
    # block, and each new block then failed the guards of the others (reported as recompiles), checked all of
    # their guards at every call, and counted against one recompile limit (past 8, Dynamo runs it uncompiled).
    # There a wrapper gets a copy of the function on a code object of its own: a cache of its own.
    isolation = {"isolate_recompiles": isolate_recompiles} if _TAKES_ISOLATE_RECOMPILES else {}
    if isolate_recompiles and not _TAKES_ISOLATE_RECOMPILES:
        fn = _on_own_code(fn)
    compiled = torch._dynamo.optimize(
        _WeakBackend(hold),
        nopython=fullgraph,
        dynamic=dynamic,
        guard_fail_fn=guard_fail_fn,
        **isolation,
    )(fn)
    unskipped = []
    if guards_follow_requires_grad() is not True:
        unskipped.append("skip_tensor_guards_with_matching_dict_tags")
    if guard_module_hooks:
        unskipped.append("skip_nnmodule_hook_guards")
    result = _with_guards_unskipped(compiled, unskipped) if unskipped else compiled
    result._ddp_compile_hold = hold  # the backend and its graphs live as long as the function that compiles
    return result


class _Hold:
    """What a compiled function keeps for Dynamo's weak references (`_WeakBackend`): the backend, what it
    compiled, and the hook on failed guards."""

    def __init__(self, backend: Callable[..., Any], on_guard_fail: Callable[[str, str], None]) -> None:
        self.backend = backend
        self.compiled: list[Callable[..., Any]] = []
        self.on_guard_fail = on_guard_fail


class _WeakBackend:
    """The backend as Dynamo is handed it, and what it compiles as Dynamo keeps it: weakly.

    Dynamo keeps every backend it was given in a module-level dict (`cached_backends`, `_dynamo/eval_frame.py`,
    emptied only by `torch._dynamo.reset()`) and every compiled graph in the globals of the module whose frame it
    compiled (`__compiled_fn_*`), for the rest of the process, and a cache entry's guards keep the hook on failed
    guards until the code object goes. Ours reach the model they compile for, so every compiled model stayed alive
    with its parameters, gradients and DDP buckets (plain `torch.compile`'s do not). Dynamo gets weak
    references; the function `compile_with_guard_hook` returns holds the rest (`_Hold`)."""

    def __init__(self, hold: _Hold) -> None:
        self._hold = weakref.ref(hold)
        self.__name__ = getattr(hold.backend, "__name__", type(hold.backend).__name__)  # Dynamo's errors name it

    def __call__(self, gm: Any, example_inputs: list) -> Callable[..., Any]:
        hold = self._hold()
        if hold is None:
            raise RuntimeError("the function this graph was captured for is gone (its compiled wrapper was released)")
        compiled = hold.backend(gm, example_inputs)
        hold.compiled.append(compiled)
        return _WeakCall(compiled)


class _WeakCall:
    """A compiled graph as Dynamo's bytecode calls it (see `_WeakBackend`)."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self._compiled = weakref.ref(compiled)

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled()
        if compiled is None:
            raise RuntimeError("the function this graph was compiled for is gone (its compiled wrapper was released)")
        return compiled(*args)


_TAKES_ISOLATE_RECOMPILES = "isolate_recompiles" in inspect.signature(torch._dynamo.eval_frame._optimize).parameters


def _on_own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a plain Python function) on a fresh copy of its code object, which Dynamo caches apart (its cache
    hangs off the code object); anything else is returned as it is."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    return copy


_REQUIRES_GRAD_GUARDED: list[bool] = []
"""The answer of `guards_follow_requires_grad`, once known (empty before)."""


class _RequiresGradProbe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def guards_follow_requires_grad() -> bool | None:
    """Whether Dynamo compiles again when a module's parameter is unfrozen in place (`requires_grad_(True)`)
    after the module was compiled with it frozen. None: not known yet (asked while something compiles).

    Mirrors Dynamo's guard fast path for `nn.Module`s (`torch/csrc/dynamo/guards.cpp`, the dict-tag check
    behind `torch._dynamo.config.skip_tensor_guards_with_matching_dict_tags`): when a module's `__dict__`
    is unchanged, its parameters' tensor guards are skipped. torch 2.11 skips the `requires_grad` check
    with them, so the graph traced with the layer frozen keeps running and the unfrozen layer never gets a
    gradient (plain `torch.compile` too); 2.13 and 2.14 compile again (seen here; pytorch/pytorch PR 177158
    proposes that check). Found out once per process by compiling a one-parameter module (0.04-0.09 s
    here once Dynamo is loaded), not from the version: the check lives in C++, with no Python name to ask for.
    """
    if _REQUIRES_GRAD_GUARDED:
        return _REQUIRES_GRAD_GUARDED[0]
    if torch.compiler.is_compiling():
        return None
    graphs: list[int] = []

    def count(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        graphs.append(1)
        return gm.forward

    probe = _RequiresGradProbe()
    with outside_any_compile(), torch._dynamo.config.patch(skip_tensor_guards_with_matching_dict_tags=True):
        compiled = torch._dynamo.optimize(count)(probe)
        x = torch.ones(1)
        compiled(x)
        probe.weight.requires_grad_(True)
        compiled(x)
    if not graphs:  # nothing compiled (Dynamo is off here): ask again later
        return None
    _REQUIRES_GRAD_GUARDED.append(len(graphs) > 1)
    return _REQUIRES_GRAD_GUARDED[0]


def _with_guards_unskipped(compiled: Callable[..., Any], flags: list[str]) -> Callable[..., Any]:
    """`compiled`, whose compiles (they happen inside its calls) build the guards that Dynamo's `flags`
    (`_dynamo/config.py` booleans named `skip_...`) would leave out. A flag is read when a compile builds its
    guards, so each is off for the duration of each call (about 7 us a call for one, measured here on 2.11).

    * `skip_tensor_guards_with_matching_dict_tags`, on a torch whose guards miss an in-place `requires_grad`
      change (`guards_follow_requires_grad`): every parameter's tensor properties are guarded;
    * `skip_nnmodule_hook_guards`: every module's hook dicts are (`compile_with_guard_hook`).
    """
    config = torch._dynamo.config

    def call(*args: Any, **kwargs: Any) -> Any:
        saved = [getattr(config, flag) for flag in flags]
        for flag in flags:
            setattr(config, flag, False)
        try:
            return compiled(*args, **kwargs)
        finally:
            for flag, value in zip(flags, saved):
                setattr(config, flag, value)

    return call


def lookup_backend(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """The Dynamo backend registered as `backend` (`_dynamo/backends/registry.py`); a callable as it is."""
    return torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend


def graph_break_of(gm: fx.GraphModule) -> dict[str, str] | None:
    """`{"reason", "where"}` when Dynamo compiled `gm` because of a graph break, else None.

    Mirrors `OutputGraph.compile_subgraph_reason` (`_dynamo/output_graph.py`), a `GraphCompileReason`
    that Dynamo attaches to every graph module it hands a backend.
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = getattr(reason, "user_stack", None) or []
    where = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "<unknown>"
    return {"reason": str(reason.reason), "where": where}


def break_counters() -> dict[str, int]:
    """Dynamo's running count of graph breaks and unsupported constructs, by message.

    Mirrors `torch._dynamo.utils.counters["unimplemented"]` and `["graph_break"]`: the only record of
    breaks that produce no graph of their own (a skipped frame, a frame run eagerly).
    """
    from torch._dynamo.utils import counters

    return {**counters["unimplemented"], **counters["graph_break"]}


def saved_tensors_hooks_disabled() -> contextlib.AbstractContextManager:
    """Dynamo's guard against user saved-tensor hooks while a backend traces (`_dynamo/utils.py`)."""
    return torch._dynamo.utils._disable_saved_tensors_hooks_during_tracing()


def pytorch_ddp_optimizer() -> contextlib.AbstractContextManager:
    """Dynamo config under which PyTorch's own DDPOptimizer splits DDP graphs (`_dynamo/config.py`)."""
    return torch._dynamo.config.patch(optimize_ddp="ddp_optimizer")


def capture_functional(
    fn: Callable[..., Any], args: list[torch.Tensor], *, decompositions: dict | None = None
) -> tuple[fx.GraphModule, list[int | None]]:
    """`fn(*args)` as an aten graph without in-place ops except the final `copy_` into mutated inputs.

    Runs `fn` once (through Dynamo, on `args`, which it may mutate) and keeps the graph that
    AOTAutograd makes of it for inference with `keep_inference_input_mutations`. Returns the graph
    and, for each arg, its position among the graph's inputs (None when the graph never reads it):
    Dynamo orders a graph's inputs by first use, not by argument order.
    """
    captured: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        order = [id(x) for x in example_inputs]
        captured["positions"] = [order.index(id(a)) if id(a) in order else None for a in args]

        def keep(graph: fx.GraphModule, inputs: list) -> Callable[..., Any]:
            captured["graph"] = graph
            from functorch.compile import make_boxed_func

            return make_boxed_func(graph.forward)

        return aot_autograd_backend(
            fw_compiler=keep, keep_inference_input_mutations=True, decompositions=decompositions or {}
        )(gm, example_inputs)

    compiled = compile_with_guard_hook(
        fn, backend, on_guard_fail=lambda reason, where: None, fullgraph=True, isolate_recompiles=True
    )
    with torch.no_grad():
        compiled(*args)
    return captured["graph"], captured["positions"]


# -- what this torch offers (python -m compile_core.doctor; compile-time refusals) ---------------------------


def capabilities(*, run_probes: bool = False) -> dict[str, tuple[bool, str]]:
    """What this torch's Dynamo and AOTAutograd offer the layers above: `{feature: (available, how)}`.

    Each check asks for the names the functions above and those of `aot/torch_graphs.py` use (not the
    torch version); `how` is for people
    (`python -m compile_core.doctor` prints it), decisions read the boolean (`blocker`). `run_probes` adds
    `aot.requires_grad_guards`, which compiles a one-parameter module (`guards_follow_requires_grad`).
    Checked on torch 2.11.0, 2.13.0 and 2.14.1, where every feature is available.
    """
    found = dict(_static_capabilities())
    if run_probes:
        guarded = guards_follow_requires_grad()
        found["aot.requires_grad_guards"] = (
            True,
            "Dynamo compiles again when a parameter is unfrozen in place"
            if guarded
            else "Dynamo's guards miss a parameter unfrozen in place: our compiles guard every parameter's "
            "tensor properties themselves (skip_tensor_guards_with_matching_dict_tags off while they build)",
        )
    return found


@functools.cache
def _static_capabilities() -> dict[str, tuple[bool, str]]:
    found: dict[str, tuple[bool, str]] = {}
    found["aot.isolate_recompiles"] = (
        True,
        "each compiled wrapper keeps its own cache entries"
        if _TAKES_ISOLATE_RECOMPILES
        else "no isolate_recompiles: wrappers of one code object share its cache entries (and recompile limit)",
    )
    try:
        from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput  # noqa: F401

        found["aot.graph_descriptors"] = (True, "AOTAutograd tags which input each gradient output belongs to")
    except ImportError as err:
        found["aot.graph_descriptors"] = (False, f"AOTAutograd's graph descriptors are missing ({err})")
    has_lowering_switch = hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")
    found["aot.non_lazy_backward"] = (
        (True, "each backward is compiled with its forward (one cache entry per piece, shippable at once)")
        if has_lowering_switch
        else (False, "no force_non_lazy_backward_lowering: backwards compile lazily, a piece cannot be shipped whole")
    )
    try:
        from torch._higher_order_ops.invoke_subgraph import invoke_subgraph  # noqa: F401

        regions = hasattr(torch.compiler, "nested_compile_region")
    except ImportError:
        regions = False
    found["aot.nested_regions"] = (
        (True, "torch.compiler.nested_compile_region and invoke_subgraph (the eager fallback inlines region bodies)")
        if regions
        else (False, "no torch.compiler.nested_compile_region/invoke_subgraph")
    )
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer  # noqa: F401

        ddp_optimizer = hasattr(torch._dynamo.config, "optimize_ddp")
    except ImportError:
        ddp_optimizer = False
    found["aot.ddp_optimizer"] = (
        (True, "PyTorch's DDPOptimizer (optimize_ddp='ddp_optimizer')")
        if ddp_optimizer
        else (False, "no DDPOptimizer/optimize_ddp in Dynamo")
    )
    return found


def blocker(ddp_mode: str, *, backend: str = "inductor", nested_regions: bool = False) -> str | None:
    """Why `ddp=ddp_mode` (with `backend`, `nested_regions`) cannot work with this torch's Dynamo and
    AOTAutograd (None when it can); for a compile-time refusal."""
    table = _static_capabilities()
    needed = []
    if backend in ("inductor", "aot_eager"):  # through AOTAutograd (compile_core/pieces.py)
        needed.append("aot.non_lazy_backward")
    if ddp_mode == "in_graph":
        needed.append("aot.graph_descriptors")
    if ddp_mode == "torch":
        needed.append("aot.ddp_optimizer")
    if nested_regions:
        needed.append("aot.nested_regions")
    why = [table[key][1] for key in needed if not table[key][0]]
    return "; ".join(why) or None
