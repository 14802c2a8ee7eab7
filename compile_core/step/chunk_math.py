"""What a chunk of parameters runs at each update (`ChunkedUpdate`): the update functions compiled per chunk,
and their arguments (the optimizer's state, the host-computed scalars of compile_core/step/optim_math.py)."""

from __future__ import annotations

from typing import Any

import torch

from compile_core.step import optim_math


def chunk_arguments(optimizer: torch.optim.Optimizer, group_index: int, params: Any, states: Any) -> tuple:
    """(params, grads, state lists..., scalars, flags) for the group's update (compile_core/step/optim_math.py)."""
    group = optimizer.param_groups[group_index]
    params = list(params)
    # At storage offset 0: a gradient shares its bucket's storage, and the compile caches key an input's
    # offset, so the same chunk compiled by another rank on stand-ins (`ChunkedUpdate.compile_ahead`), or
    # with another bucket layout, would not be found.
    grads = [alias_at_offset_zero(p.grad) for p in params]
    # the scalar rows go where the chunk's parameters are (a chunk holds one device): a CUDA kernel
    # reading a CPU tensor fails at launch
    device = params[0].device if params else None
    if isinstance(optimizer, torch.optim.SGD):
        buffers = [s.get("momentum_buffer") if group["momentum"] != 0 else None for s in states]
        flags = {
            "weight_decay": group["weight_decay"] != 0,
            "nesterov": group["nesterov"],
            "maximize": group["maximize"],
        }
        return params, grads, buffers, optim_math.scalars(optimizer, group, [0.0] * len(params), device), flags
    amsgrad = bool(group.get("amsgrad"))
    steps = optim_math.next_steps([s["step"] for s in states])  # the step this update reaches (eager: after += 1)
    flags = {
        "decoupled": optim_math.decoupled(optimizer, group),
        "weight_decay": group["weight_decay"] != 0,
        "maximize": group["maximize"],
    }
    return (
        params,
        grads,
        [s["exp_avg"] for s in states],
        [s["exp_avg_sq"] for s in states],
        [s["max_exp_avg_sq"] for s in states] if amsgrad else [None] * len(params),
        [s["step"] for s in states],
        optim_math.scalars(optimizer, group, steps, device),
        flags,
    )


def sgd_chunk(params: list, grads: list, buffers: list, scalars: torch.Tensor, flags: dict) -> None:
    for i, p in enumerate(params):
        optim_math.sgd_math(p, grads[i], buffers[i], scalars[i], **flags)


def adam_chunk(
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    max_exp_avg_sqs: list,
    steps: list,
    scalars: torch.Tensor,
    flags: dict,
) -> None:
    for i, p in enumerate(params):
        optim_math.adam_math(
            p, grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i], steps[i], scalars[i], **flags
        )


UPDATES = {torch.optim.SGD: sgd_chunk, torch.optim.Adam: adam_chunk, torch.optim.AdamW: adam_chunk}

"""The function a chunk's update runs (and Dynamo compiles), per optimizer class."""


def alias_at_offset_zero(t: torch.Tensor | None, *, flat: bool = False) -> torch.Tensor | None:
    """`t`'s elements as a new tensor over the same memory at storage offset 0, with no view base (`flat`:
    1-D). Writes go to `t`'s memory. Compile caches and Dynamo's dynamic-shape guards read an input's
    storage offset and view base; a gradient in a bucket's storage, or a slice of a vector of scalars,
    would otherwise key (or guard) a compile on where it sits. CPU tensors only (others are returned as
    they are): storage slicing is checked here on the CPU alone."""
    if t is None or t.dim() == 0 or t.device.type != "cpu":
        return t
    shape, stride = ((t.numel(),), (1,)) if flat else (tuple(t.shape), tuple(t.stride()))
    if flat and not t.is_contiguous():
        raise ValueError("alias_at_offset_zero(flat=True) needs a contiguous tensor")
    size = t.element_size()
    start = t.storage_offset() * size
    extent = (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size if t.numel() else 0
    storage = t.untyped_storage()[start : start + extent]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, shape, stride)
