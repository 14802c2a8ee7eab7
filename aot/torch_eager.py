"""The private parts of torch's eager objects that the compile stack reads, in one place (a home of private
torch internals, like `aot/torch_dynamo.py`): a module's compiled call, operator overloads, pytree's
flattening, the optimizer's step hooks, its choice of implementation, the devices of its fused kernels and
the fused SGD/Adam/AdamW kernels themselves, a tensor's version counter, and the wrapper `torch.compile(module)`
returns.

These are how `nn.Module`, `torch._ops`, `torch.utils._pytree` and `torch.optim` work when nothing compiles;
Dynamo's and AOTAutograd's own internals are in `aot/torch_dynamo.py` and `aot/torch_graphs.py`. Each
function says which torch 2.13 file it mirrors; `tests/single/test_torch_internals_dynamo.py` has one canary per
function.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree


def installed_compiled_call(module: torch.nn.Module) -> Callable[..., Any] | None:
    """What `module.compile()` installed as the module's call (None: the module is not compiled).

    Mirrors `nn.Module._compiled_call_impl` (`torch/nn/modules/module.py`): `Module.compile()` stores
    the compiled `_call_impl` there and `Module.__call__` (`_wrapped_call_impl`) runs it instead.
    """
    return getattr(module, "_compiled_call_impl", None)


def install_compiled_call(module: torch.nn.Module, fn: Callable[..., Any]) -> None:
    """Make every call of `module` run `fn`, as `module.compile()` does (see `installed_compiled_call`)."""
    module._compiled_call_impl = fn


def uninstall_compiled_call(module: torch.nn.Module) -> None:
    """Undo `module.compile()`: calls of `module` run its own `_call_impl` again (see `installed_compiled_call`)."""
    module._compiled_call_impl = None


def call_uncompiled(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call `module` the way `nn.Module.__call__` does without a compiled call: hooks, then `forward`.

    Mirrors `nn.Module._call_impl` (`torch/nn/modules/module.py`). Dynamo traces through it (and
    inlines torch.nn code, `nn.Sequential` included) when called from a frame it compiles.
    """
    return module._call_impl(*args, **kwargs)


def torch_compile_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module `torch.compile(original)` was called on, if `module` is the wrapper it returned; else None.
    (`OptimizedModule._orig_mod`, `torch/_dynamo/eval_frame.py`.)"""
    if not isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return None
    return module._orig_mod


def uncompile_torch_wrapper(module: torch.nn.Module) -> torch.nn.Module | None:
    """If `module` is the wrapper `torch.compile(original)` returned, make its call run `original` uncompiled
    and return `original`; else None.

    Mirrors `OptimizedModule._initialize` (`torch/_dynamo/eval_frame.py`): the wrapper's `forward` is its
    compiled call of `original.__call__` (`_forward`, behind a lazy-module check, when `original` is lazy);
    here it becomes `original.__call__` itself, as torch makes it under a disabled context. The wrapper's own
    hooks still run around it; a forward run eagerly then never compiles the model with the script's backend.
    """
    original = torch_compile_original(module)
    if original is None:
        return None
    if hasattr(original, "_initialize_hook"):
        module._forward = original.__call__
    else:
        module.forward = original.__call__
    return original


def is_op_overload(fn: Any) -> bool:
    """True for an ATen/prims operator (`torch.ops.aten.add.Tensor` or `torch.ops.aten.add`).

    Mirrors `OpOverload` / `OpOverloadPacket` (`torch/_ops.py`): they name themselves stably
    (`str(op)` is `aten.add.Tensor`), unlike other callables.
    """
    return isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def tree_leaves(value: Any) -> list[Any]:
    """The leaves of a nested container of tensors (lists, tuples, dicts, dataclasses torch knows).

    Mirrors `torch.utils._pytree.tree_leaves`, the flattening Dynamo and AOTAutograd use for outputs.
    """
    return pytree.tree_leaves(value)


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> int:
    """How many step pre/post hooks (global or on `optimizer`) `optimizer.step()` would call.

    Mirrors `Optimizer._optimizer_step_pre_hooks`/`_optimizer_step_post_hooks` and the module-level
    `_global_optimizer_pre_hooks`/`_global_optimizer_post_hooks` (`torch/optim/optimizer.py`),
    which `Optimizer.profile_hook_step` runs around every `step()`; there is no public count.
    """
    from torch.optim import optimizer as optim_module

    return (
        len(optimizer._optimizer_step_pre_hooks)
        + len(optimizer._optimizer_step_post_hooks)
        + len(optim_module._global_optimizer_pre_hooks)
        + len(optim_module._global_optimizer_post_hooks)
    )


def mark_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Record that `optimizer` took a step, as its own `step()` would have, for an update that ran without it
    (compiled, or inside the backward).

    Mirrors `LRScheduler.__init__`'s wrapper of `optimizer.step` (`torch/optim/lr_scheduler.py`), which sets
    `optimizer._opt_called`; the scheduler's first `step()` warns "Detected call of `lr_scheduler.step()`
    before `optimizer.step()`" when it finds the flag unset.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


def foreach_by_default(params: list[torch.Tensor]) -> bool:
    """Whether torch's SGD, Adam and AdamW, left to choose (`foreach=None`, `fused=None`), take their
    multi-tensor (`_foreach_*`) implementation for `params`: plain tensors all on a device with foreach
    kernels (CUDA and other accelerators; never the CPU).

    Mirrors `_default_to_fused_or_foreach` (`torch/optim/optimizer.py`), which those optimizers' functional
    forms call with `use_fused=False`; there is no public way to ask.
    """
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(list(params), differentiable=False, use_fused=False)[1]


def fused_kernel_devices() -> list[str]:
    """The device types torch has fused optimizer kernels for (`fused=True` of Adam, AdamW, SGD, Adagrad):
    CUDA, the CPU and other accelerators.

    Mirrors `_get_fused_kernels_supported_devices` (`torch/utils/_foreach_utils.py`), which those optimizers
    check their parameters against when `fused=True`; there is no public way to ask.
    """
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def fused_adam_kernel(*, decoupled: bool) -> Any:
    """torch's fused Adam (`decoupled=False`: L2 weight decay) or AdamW kernel, the overload that reads the
    learning rate from a tensor: `op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
    lr, beta1, beta2, weight_decay, eps, amsgrad, maximize)`, every list updated in place (grads only with a
    grad_scale), each step count read as the step this update reaches (float32, on the parameters' device).

    Mirrors what `torch/optim/adam.py: _fused_adam` calls after advancing the counts (`torch._fused_adam_`,
    `torch._fused_adamw_`); the aten ops have meta and CPU kernels, so graphs carrying them compile and run
    on the CPU too."""
    op = torch.ops.aten._fused_adamw_ if decoupled else torch.ops.aten._fused_adam_
    return op.tensor_lr


def fused_sgd_kernel() -> Any:
    """torch's fused SGD kernel, the overload that reads the learning rate from a tensor: `op(params, grads,
    momentum_buffers, *, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step)`, every
    list updated in place (no momentum: an empty buffer list and momentum 0; `is_first_step`: the buffers are
    set to the gradient rather than decayed, as torch's first step creates them).

    Mirrors what `torch/optim/sgd.py: _fused_sgd` calls (`torch._fused_sgd_`); the aten op has meta and CPU
    kernels."""
    return torch.ops.aten._fused_sgd_.tensor_lr


def add_to_each(tensors: list[torch.Tensor], value: float) -> None:
    """`t += value` for every tensor, in one multi-tensor op (`torch._foreach_add_`, what torch's foreach
    optimizers advance their step counts with): one dispatch for the list, not one per tensor.

    The CPU runs a foreach op tensor by tensor, and wraps a number (or one 0-dim tensor) into a new tensor
    for each of them (four more ops each): host tensors get one 0-dim host tensor per tensor instead (the
    list form, which adds it as it is: 3x faster for 149 step counts here)."""
    on_host = [t for t in tensors if t.is_cpu]
    elsewhere = [t for t in tensors if not t.is_cpu]
    if on_host:
        torch._foreach_add_(on_host, [torch.tensor(float(value))] * len(on_host))
    if elsewhere:
        torch._foreach_add_(elsewhere, value)


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter: every in-place write to it (or to a view of it) adds one.

    Mirrors `Tensor._version` (autograd's `VariableVersion`, `c10/core/TensorImpl.h`), which autograd
    checks saved tensors against; read on the host, it costs no dispatch and no device sync."""
    return tensor._version


def versions_of(tensors: "list[torch.Tensor]") -> list[int]:
    """`version_of` of each tensor, in one call (a list compared at C speed: no Python call per tensor)."""
    return [t._version for t in tensors]


def set_version(tensor: torch.Tensor, version: int) -> None:
    """Set the tensor's version counter, so that autograd accepts it as saved at `version` although it was
    written in place since (the values it then reads are the current ones: the caller's intent).

    Mirrors what `torch.autograd._unsafe_preserve_version_counter` does on exit
    (`torch._C._autograd._unsafe_set_version_counter`, which takes a tuple of tensors and one of versions)."""
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))
