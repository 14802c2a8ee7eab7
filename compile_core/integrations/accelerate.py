"""`compile(accelerator, model, ...)`: compile_core for a model Hugging Face accelerate prepared (needs the
[accelerate] extra).

    accelerator = Accelerator()                      # without dynamo_backend: that compiles DDP's own forward
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    compiled = compile_core.integrations.accelerate.compile(accelerator, model, backend="inductor")
    ...  loss = loss_fn(model(x), y); accelerator.backward(loss); optimizer.step()  ...
    print(compiled.report())

The prepared model is compiled in place and returned (`compiled is model`): calling it runs the compiled
pieces, and it stays the object accelerate's helpers take (`accumulate`, `no_sync`, `unwrap_model`,
`save_model`, `get_state_dict`; checkpoint keys are unchanged), with `report()` added.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import compile_core
from compile_core.integrations.common import (
    as_compile_config,
    compile_kwargs,
    missing_extra,
)

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, DynamoBackend, is_compiled_module
except ImportError as err:  # pragma: no cover - exercised by a test that hides accelerate
    raise missing_extra("accelerate", err) from err

__all__ = ["compile", "refuse_self_compiling"]

_DDP_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
"""accelerate's distributed types whose `prepare` wraps the model in DistributedDataParallel."""


def refuse_self_compiling(accelerator: Accelerator, *, fix: str) -> None:
    """ValueError when `accelerator` has a dynamo backend: it would torch.compile DDP's wrapper around ours."""
    backend = accelerator.state.dynamo_plugin.backend
    if backend != DynamoBackend.NO:
        raise ValueError(
            f"the Accelerator compiles prepared models itself (dynamo_backend={backend.value!r}), around DDP's "
            f"own forward; {fix} so that compile_core compiles the model"
        )


def compile(accelerator: Accelerator, model: torch.nn.Module, **options: Any) -> compile_core.CompiledModel:
    """Compile `model` (what `accelerator.prepare` returned) in place with `compile_core.compile(**options)`;
    returns `model` itself."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    config = as_compile_config(options, argument="compile_core.integrations.accelerate.compile(...)")
    refuse_self_compiling(accelerator, fix="create it without dynamo_backend (and launch with --dynamo_backend no)")
    if isinstance(model, torch.nn.Module) and is_compiled_module(model):
        raise ValueError(
            "model was wrapped by torch.compile; pass the model accelerator.prepare() returned, uncompiled"
        )
    distributed = accelerator.distributed_type in _DDP_TYPES and accelerator.num_processes > 1
    if distributed and not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"model is a {type(model).__name__}, not the DistributedDataParallel model accelerator.prepare() "
            f"returns with {accelerator.num_processes} processes ({accelerator.distributed_type.value}); "
            "call model = accelerator.prepare(model) first (FSDP, DeepSpeed and other wrappers are not supported)"
        )
    # One process (DistributedType.NO): prepare() leaves the model unwrapped; it is compiled whole.
    return compile_core.compile(model, **compile_kwargs(config))
