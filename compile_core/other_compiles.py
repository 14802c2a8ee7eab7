"""Other compiles of the model we compile: the script's own (`torch.compile`, `module.compile()`) and an earlier
one of ours. Ours takes their place, whichever came first (docs/design.md, the drop-in contract).

Before ours (`take_their_place`, when `compile_core.compile` starts): torch.compile's wrapper of the DDP model
(its call then runs the DDP model, ours), `ddp.compile()` (torch's compile of DDP's own call would run around ours,
with PyTorch's DDPOptimizer), and, below DDP, nanoGPT's `compile=True` (`torch.compile(model)` before DDP wraps
it), `model.compile()`, or `compile_core.compile(model)` before DDP wrapped it (that compile gives way: its graphs
were whole). None of them runs again, not even in an eager forward of ours (update 1 of the in-backward step).

After ours: the compiled class's own `compile()` refuses at the call (compile_core/in_place.py); what it cannot
see, `refuse_module_compile_after_ours` refuses at the DDP model's next forward, before DDP's (so no collective
waits for this rank). A plain module compiled by us and wrapped in DDP afterwards trains as eager DDP does but
without buckets: `ddp_wrapper_note` says so at its first forward inside DDP.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from aot.torch_eager import (
    install_compiled_call,
    installed_compiled_call,
    uncompile_torch_wrapper,
    uninstall_compiled_call,
)
from compile_core.in_place import CompiledModel
from ddp import torch_ddp


def take_their_place(handed: torch.nn.Module, model: torch.nn.Module, inner: torch.nn.Module) -> list[str]:
    """Undo the compiles of `model` (what `compile_core.compile` compiles; `handed`: what the script handed in)
    and of `inner` (the module DDP wraps, or `model`) that ours replaces; one note per compile undone."""
    notes = []
    unused = "the backend and options given to torch.compile are not used"
    compiles = f"compile_core compiles it; {unused}"
    if handed is not model:
        uncompile_torch_wrapper(handed)
        notes.append(
            f"the model handed in is torch.compile's wrapper of {type(model).__name__}: compile_core compiles the "
            f"{type(model).__name__} model inside and returns it (the wrapper's call runs it too); {unused}"
        )
    elif model is not inner and installed_compiled_call(model) is not None:
        uninstall_compiled_call(model)
        notes.append(f"the {type(model).__name__} model was compiled by module.compile(): {compiles}")
    if isinstance(inner, CompiledModel):
        inner.compile_state.give_way()
        notes.append(
            f"the {type(inner).__name__} module was compiled by compile_core.compile before DDP wrapped it: "
            f"compile_core compiles the {type(model).__name__} model in its place, with this call's arguments"
        )
    original = uncompile_torch_wrapper(inner)
    if original is not None:
        notes.append(f"the module is torch.compile's wrapper of {type(original).__name__}: {compiles}")
    elif installed_compiled_call(inner) is not None:  # ours replaces it when it is installed
        notes.append(f"the module is {type(inner).__name__}, compiled by module.compile(): {compiles}")
    return notes


def refuse_module_compile_after_ours(ddp: torch.nn.Module, inner: torch.nn.Module, ours: Callable[..., Any]) -> None:
    """At the DDP model's forward: a `module.compile()` after ours that the compiled class's `compile` did not
    refuse (`ddp.module.compile()`: DDP's forward would call torch's compiled module, not ours;
    `nn.Module.compile(ddp)`: torch's compile of DDP's call around ours) is undone, and this forward refused."""
    on_ddp = installed_compiled_call(ddp)
    if on_ddp is None and installed_compiled_call(inner) is ours:
        return
    which = ddp if on_ddp is not None else inner
    uninstall_compiled_call(ddp)
    install_compiled_call(inner, ours)
    raise ValueError(
        f"the {type(which).__name__} model was compiled again with module.compile() after compile_core.compile, "
        "which already compiles it: remove the module.compile() call (undone now; this forward did not run)"
    )


def ddp_wrapper_note(inner: torch.nn.Module) -> str | None:
    """At a forward of a module we compiled without DDP: a note if a DDP model that wraps it is running it."""
    ddp = torch_ddp.active_ddp_module()
    if ddp is None or ddp.module is not inner:
        return None
    return (
        f"the {type(inner).__name__} model compiled by compile_core.compile runs inside DistributedDataParallel, "
        "which wrapped it after: its graphs are compiled whole, without DDP's buckets, so the all-reduces wait for "
        "the whole compiled backward; compile the DDP model instead, compile_core.compile(DDP(model)) (handed that "
        "DDP model, compile_core.compile replaces this compile)"
    )
