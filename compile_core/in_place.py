"""Compiling a model in place: the model handed to `compile_core.compile` is the model handed back.

A script that wrapped its DDP model in `torch.compile` reads and writes attributes of what it got back
(`model.module` for checkpoints, `model.require_backward_grad_sync` for accumulation, `no_sync()`, `join()`),
checks `isinstance(model, DistributedDataParallel)` and saves `state_dict()`. So we do not hand back a
wrapper: the model's class becomes a subclass of its own class with `CompiledModel` mixed in (same name,
same behaviour, plus `report()` and `compile_state`), and what the compile keeps is one `CompileState`
stored on the instance. A DDP model's `join_hook` (what `ddp.join()` asks for) passes through its mode. Its
`compile()` (torch's `nn.Module.compile`, unless the class has its own) refuses:
it would install torch's compiled call in place of ours (without DDP nothing of ours would run again) or
around ours (DDP's call, with PyTorch's DDPOptimizer). A copy of the model (`copy.deepcopy`, pickling) is
the plain eager model again: its class is the user's, and what we attached to its modules (the compiled call,
our forward hooks) copies as nothing (`Detached`).
"""

from __future__ import annotations

import copyreg
import logging
from typing import Any, Callable

import torch

from compile_core.report import CompileReport

log = logging.getLogger(__name__)


class CompiledModel:
    """What `compile_core.compile` mixes into the class of the model it compiles in place.

    `isinstance(model, compile_core.CompiledModel)` tells whether a model is compiled by us; every other
    attribute is the model's own (`.module` of a DDP model is the user's module, DDP's flags are DDP's)."""

    __slots__ = ()

    @property
    def compile_state(self) -> Any:  # compile_core.api.CompileState (api imports this module)
        """What compiling this model keeps: the mode, the compiled entry, the log behind `report()`."""
        state = self.__dict__.get(_STATE_ATTR)
        if state is None:  # a class swapped by hand, or a state lost in a copy
            raise RuntimeError(f"this {type(self).__name__} has no compile state: compile it with compile_core.compile")
        return state

    def report(self) -> CompileReport:
        """How the model was compiled: graphs, pieces, buckets (user names), breaks, fallbacks."""
        return self.compile_state.report()


_STATE_ATTR = "_compile_core_state"
_COMPILED_CLASSES: dict[type, type] = {}


def compile_in_place(model: torch.nn.Module, state: Any) -> None:
    """Attach `state` to `model` and mix `CompiledModel` into its class (see the module docstring)."""
    base = type(model)
    cls = _COMPILED_CLASSES.get(base)
    if cls is None:
        # The user's class comes first: a method of theirs named `report` keeps its meaning (the report is
        # then `model.compile_state.report()`). Same name and module, so reprs and logs read as before.
        namespace: dict[str, Any] = {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__reduce_ex__": _reduce_as_base,
        }
        if getattr(base, "compile", None) is torch.nn.Module.compile:
            namespace["compile"] = _refuse_module_compile
        if issubclass(base, torch.nn.parallel.DistributedDataParallel):
            namespace["join_hook"] = _join_hook
        cls = type(base.__name__, (base, CompiledModel), namespace)
        _COMPILED_CLASSES[base] = cls
    if getattr(base, "report", None) is not None:
        log.warning(
            "compile_core: %s has its own `report`; the compile report is model.compile_state.report()", base.__name__
        )
    model.__dict__[_STATE_ATTR] = state
    model.__class__ = cls


def uncompile_in_place(model: torch.nn.Module) -> None:
    """Undo `compile_in_place`: the model's class is the user's again, and it holds no state of ours."""
    model.__dict__.pop(_STATE_ATTR, None)
    model.__class__ = _user_class(type(model))


def _user_class(cls: type) -> type:
    return next(c for c in cls.__mro__ if c is not CompiledModel and not issubclass(c, CompiledModel))


def _join_hook(self: Any, **kwargs: Any) -> Any:
    # `ddp.join()` asks for it on every rank as the context is entered: the mode may need DDP's reducer back.
    return self.compile_state.join_hook(_user_class(type(self)).join_hook(self, **kwargs))


def _refuse_module_compile(self: Any, *args: Any, **kwargs: Any) -> None:
    raise ValueError(
        f"this {type(self).__name__} model is already compiled by compile_core.compile: remove the module.compile() "
        "call (torch's compiled call would take the place of ours); torch.compile's backend, mode and options go "
        "to compile_core.compile"
    )


def _reduce_as_base(self: Any, protocol: int) -> Any:
    # copy.deepcopy and pickle rebuild the user's own class without our state: a copy is the eager model
    # (its module's compiled call and our hooks copy as nothing, see `Detached`).
    rv = list(object.__reduce_ex__(self, protocol))
    base = _user_class(type(self))
    if len(rv) > 1 and rv[1] and rv[1][0] is type(self):
        rv[1] = (base, *rv[1][1:])
        # pickle refuses copyreg's __newobj__ with a class other than the object's own: rebuild through
        # an equivalent of ours (copy.deepcopy does not check, and takes either)
        rv[0] = {copyreg.__newobj__: _new_object, copyreg.__newobj_ex__: _new_object_ex}.get(rv[0], rv[0])
    if len(rv) > 2 and isinstance(rv[2], dict):
        rv[2] = {k: v for k, v in rv[2].items() if k != _STATE_ATTR}
    return tuple(rv)


class Detached:
    """A callable we attach to the user's modules (the compiled call, forward hooks). A copy of the module
    gets `copied_as` in its place (None: no compiled call; a no-op hook), never our state.

    A `torch.compile` the script puts around the compiled model (`torch.compile(compile_core.compile(ddp))`)
    stops at each call of one (a graph break) instead of tracing our runtime, frame by frame: what we
    compiled runs as compiled, and the outer compile keeps only DDP's code around it."""

    def __init__(self, fn: Callable[..., Any], *, copied_as: Callable[..., Any] | None) -> None:
        self.fn = fn
        self.copied_as = copied_as

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        return self.copied_as

    def __reduce__(self) -> Any:
        return (_return, (self.copied_as,))


def _new_object(cls: type, *args: Any) -> Any:
    return cls.__new__(cls, *args)


def _new_object_ex(cls: type, args: tuple, kwargs: dict) -> Any:
    return cls.__new__(cls, *args, **kwargs)


def _return(value: Any) -> Any:
    return value


def _no_op_hook(*args: Any) -> None:
    return None


def detached_hook(fn: Callable[..., Any]) -> Detached:
    """`fn` as a module hook that a copy of the module drops (a no-op there)."""
    return Detached(fn, copied_as=_no_op_hook)
