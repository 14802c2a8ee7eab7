"""A multi-tensor SGD, Adam or AdamW step run as torch's fused step, uncompiled (`fused_instead`,
`FusedWhileStepping`).

Compiled whole (`CompiledUpdate`), a foreach `optimizer.step()` is the largest compile of a train step: on
one H100 (torch 2.11, GPT-2-small, 149 parameters, 14 cold jobs side by side) the in-graph step's AdamW update
graph took 58.6 s of its 101 s to the end of step 2, the whole model 23.8 s; on the 2-core CPU (torch 2.13, a
12-block GPT of 149 parameters) a foreach SGD with momentum compiled twice (update 1 creates its momentum
buffers), 73.8 s against the model's 85.0 s. torch's fused SGD/Adam/AdamW kernel does the same update with
one launch per device and dtype (a few for many tensors) and compiles nothing.
So when every param group of an SGD, Adam or AdamW would take the multi-tensor step (`foreach=True`, or torch's
default on CUDA) on devices with fused kernels, and none says `fused=False`, the update is torch's fused
step: the groups say `fused=True, foreach=False` only while it runs, and hold the user's flags before and
after, so `optimizer.state_dict()`, a direct `optimizer.step()` and a second optimizer see what plain
PyTorch gives.

Adam's fused kernel reads each parameter's step count on the parameter's device (float32; the foreach step
keeps it on the host): a count found elsewhere (update 1 creates them there already; a state loaded with
the user's flags puts them back on the host) is moved once, as torch itself does when it loads a fused
optimizer's state. The foreach step reads counts on either device, so the user's own step still runs.

Not done with `optimizer_in_backward=True` (whose backward calls the fused kernel itself, per bucket, with
the step counts of its own scalar table): the update inside the backward reads back, on the host, every
step count something else advanced (`KnownSteps`, compile_core/step/optim_math.py), and torch's own step
advances those of the parameters the backward leaves to it at every update: with the counts on the device,
each such read would wait for the GPU's stream.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from aot.torch_eager import fused_kernel_devices
from compile_core.step.update import multi_tensor_group

FUSED_INSTEAD = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""The optimizers whose multi-tensor step runs fused (exactly these classes)."""


def fused_instead(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the update runs as torch's fused step instead of compiled (see the module docstring), or None: not
    an SGD/Adam/AdamW, or a param group that is not multi-tensor or that the fused kernel cannot take."""
    if type(optimizer) not in FUSED_INSTEAD or not optimizer.param_groups:
        return None
    devices = fused_kernel_devices()
    why = None
    for i, group in enumerate(optimizer.param_groups):
        if not _fusable(group, devices):
            return None
        if group.get("fused"):
            continue
        multi = multi_tensor_group(group)
        if multi is None:
            return None
        why = why or f"param group {i} {multi}"
    if why is None:
        return None  # every group is fused already: torch's step as it is (`fused_step`)
    return (
        f"{why}: runs as torch's fused step (fused=True while it steps; the groups keep their flags), "
        "a launch per device and dtype and nothing to compile"
    )


def _fusable(group: dict, devices: list[str]) -> bool:
    """Whether torch's fused kernel can step this group (what `fused=True` checks, and no differentiable),
    and the user did not say `fused=False` (torch's default is None: left to choose)."""
    if group.get("differentiable") or group.get("fused") is False:
        return False
    return all(
        p.device.type in devices and p.is_floating_point() and not p.is_sparse and not p.is_complex() and _dense(p)
        for p in group["params"]
    )


def _dense(p: torch.Tensor) -> bool:
    """Contiguous in some memory format: on CUDA the fused kernel refuses a parameter whose gradient and state
    do not share its strides, which autograd and `zeros_like` only promise for a dense layout; a parameter
    that is a strided view keeps the compiled step."""
    if p.is_contiguous():
        return True
    if p.dim() == 4:
        return p.is_contiguous(memory_format=torch.channels_last)
    return p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d)


class FusedWhileStepping:
    """`applied()`: the optimizer's groups set to torch's fused step while the update runs (module docstring).

    A param group added later that the fused kernel cannot take (or that loops over its parameters) keeps
    its flags: torch steps it its own way inside the same `optimizer.step()`. So does an SGD group with a
    sparse gradient (`nn.Embedding(sparse=True)`, which `ddp="split"` reduces), which torch's fused SGD
    refuses and its foreach step takes."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._sparse_grads_allowed = isinstance(optimizer, torch.optim.SGD)
        self._devices = fused_kernel_devices()
        self._placed: dict[int, torch.Tensor] = {}
        """id(param) -> its step count, seen on the parameter's device as float32."""
        self._groups: dict[int, tuple[tuple, bool]] = {}
        """id(group) -> (its shape: parameter count and flags, whether it steps fused): decided once per shape."""

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        saved = []
        for group in self._optimizer.param_groups:
            if not self._steps_fused(group) or (self._sparse_grads_allowed and _has_sparse_grad(group)):
                continue
            saved.append((group, group.get("foreach"), group.get("fused")))
            group["foreach"], group["fused"] = False, True
            self._place_steps(group["params"])
        try:
            yield
        finally:
            for group, foreach, fused in saved:
                group["foreach"], group["fused"] = foreach, fused

    def _steps_fused(self, group: dict) -> bool:
        shape = (len(group["params"]), group.get("foreach"), group.get("fused"), group.get("differentiable"))
        known = self._groups.get(id(group))
        if known is None or known[0] != shape:
            multi = bool(group.get("fused")) or multi_tensor_group(group) is not None
            fused = multi and _fusable(group, self._devices)
            known = self._groups[id(group)] = (shape, fused)
        return known[1]

    def _place_steps(self, params: list[torch.Tensor]) -> None:
        state, placed = self._optimizer.state, self._placed
        for p in params:
            p_state = state.get(p)
            if not p_state:
                continue  # no state yet: the fused step creates its count on the device
            step = p_state.get("step")
            if step is None or step is placed.get(id(p)):
                continue
            if not isinstance(step, torch.Tensor):
                step = torch.tensor(float(step), dtype=torch.float32, device=p.device)
            elif step.device != p.device or step.dtype != torch.float32:
                step = step.to(device=p.device, dtype=torch.float32)
            p_state["step"] = step
            placed[id(p)] = step


def _has_sparse_grad(group: dict) -> bool:
    return any(p.grad is not None and p.grad.is_sparse for p in group["params"])
