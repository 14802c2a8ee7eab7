"""Gradients accumulated over micro-batches while the compiled graphs run as CUDA graphs (`GradsOutOfGraphPool`).

A CUDA-graphed backward writes its gradients into the CUDA graphs' memory pool, and autograd hands the first
micro-batch's gradient to `.grad` as it is. The next micro-batch's compiled call starts a new generation of
CUDA graph runs, whose replays may reuse that memory: the accumulated `.grad` is then overwritten, and torch
stops the next read of it ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
run"; torch 2.13 words it for gradients and asks for `.grad` buffers allocated outside the graphs). Our GPU run
with `accum_steps=2` under `mode="reduce-overhead"` stopped so (H100, torch 2.11, session 61). So after each
backward that accumulates (every micro-batch but the update's last), a `.grad` the step has not copied yet is
copied out of the pool, once per update: the next micro-batches add into that copy in place, as autograd adds
into any `.grad` it finds.
"""

from __future__ import annotations

from typing import Iterable

import torch

from compile_core.step.config import TrainStepConfig
from inductor import InductorSettings


def accumulates_under_cuda_graphs(config: TrainStepConfig, device_type: str) -> bool:
    """Whether the step accumulates micro-batches (`accum_steps > 1`) on CUDA with the model's graphs run as CUDA
    graphs (Inductor with `mode="reduce-overhead"`/`"max-autotune"` or `options={"triton.cudagraphs": True}`)."""
    if config.accum_steps <= 1 or config.backend != "inductor" or device_type != "cuda":
        return False
    kw = config.compile_kwargs
    return InductorSettings(mode=kw.get("mode"), options=kw.get("options"), dynamic=kw.get("dynamic")).cuda_graphs


class GradsOutOfGraphPool:
    """Keeps accumulated `.grad` tensors out of the CUDA graphs' memory pool (see the module docstring)."""

    def __init__(self) -> None:
        self._copied: dict[int, torch.Tensor] = {}
        """id(param) -> the copy this update's `.grad` holds (the next micro-batches add into it in place)."""

    def after_accumulating_backward(self, params: Iterable[torch.nn.Parameter]) -> int:
        """After the backward of a micro-batch that is not the update's last: each `.grad` not copied yet this
        update is replaced by a copy of itself. Returns how many were copied."""
        copied = 0
        for p in params:
            grad = p.grad
            if grad is not None and self._copied.get(id(p)) is not grad:
                p.grad = self._copied[id(p)] = grad.clone()
                copied += 1
        return copied

    def after_update(self) -> None:
        """The update consumed the gradients (and `zero_grad` dropped them)."""
        self._copied.clear()
