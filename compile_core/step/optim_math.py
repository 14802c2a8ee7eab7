"""SGD, Adam and AdamW as elementwise math on one parameter, fed with scalars computed on the host.

Note [The compiled optimizer math]
----------------------------------
Background: torch's eager single-tensor step computes everything that depends only on the step
count and the hyperparameters (bias corrections, step size, decay factor) in Python, in double
precision, once per parameter, and hands the results to its kernels, which round them to the
parameter's dtype. A compiled update that reads the learning rate and betas as tensors (so that
schedulers cause no recompile) instead computes `beta2 ** step` and its square root inside every
iteration of the fused elementwise loop, in double when the tensors are float64: on the CPU that
made AdamW 1.8x slower than `torch.compile(optimizer.step)` (72 vs 40 ms for 13.8M parameters).

Algorithm: `scalars(...)` computes, per parameter and update, the same Python doubles eager torch
computes (from the step count the update will reach), as one small float32 vector; the compiled
functions below (`adam_math`, `sgd_math`) read only that vector and the tensors, in torch's order of
operations (non-capturable single-tensor path: weight decay, first and second moments, bias
corrections, the step). The vector is a graph input: any schedule of lr, betas, momentum or weight
decay changes values, never the graph.

Notes: each `x + a * b` that torch's step computes as one kernel with a scalar (`add(alpha=)`,
`addcmul_(value=)`, `lerp_`) is an `addcmul` here, which rounds once as those do (a `mul` then an `add`
rounds twice); `addcdiv_(value=)` rounds as `value * a / b` then the add, which is how the step is
written. So the captured math run eagerly gives torch's eager CPU step bit for bit where the capture
keeps `addcmul` (torch 2.13, 2.14; 2.11's capture decomposes it: within a rounding there). Compiled, the
fused kernel evaluates the same expressions to rounding, as eager's foreach and fused variants do.
Complex parameters are not covered (`covers()` says so: they keep torch's own `optimizer.step()`);
`support()` says why an optimizer is not.
"""

from __future__ import annotations

import operator
from array import array
from typing import Any, Sequence

import torch

from aot.torch_eager import add_to_each, version_of, versions_of

ADAM_SCALARS = (
    "weight_decay_or_decay",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "bias_correction2_sqrt",
    "neg_step_size",
    "eps",
    "lr",
    "step",
)
"""The layout of an Adam/AdamW scalar vector (the last two are what torch's fused kernel reads instead of the
others: the learning rate and the step count the update reaches)."""
SGD_SCALARS = ("weight_decay", "momentum", "one_minus_dampening", "neg_lr", "lr")
"""The layout of an SGD scalar vector (the last is the learning rate torch's fused kernel reads)."""


def is_adam(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def decoupled(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))


class StateWatch:
    """Notices an optimizer state mapping the user replaced (`load_state_dict`) or shrank (`state.clear()`,
    `del optimizer.state[p]`) since `mark()`: then some parameter may have lost the state a compiled update
    reads, and torch's own step must recreate it. One id and one length compared per update."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._seen: tuple[int, int] = (0, 0)

    def mark(self) -> None:
        self._seen = (id(self.optimizer.state), len(self.optimizer.state))

    def changed(self) -> bool:
        state = self.optimizer.state
        return id(state) != self._seen[0] or len(state) < self._seen[1]


def covers(params: Sequence[torch.Tensor]) -> bool:
    """Whether this math can update these parameters (real, floating point)."""
    return all(p.is_floating_point() for p in params)


SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""The optimizer classes this math stands in for (exactly these, any of their options)."""


def support(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this math cannot stand in for the optimizer's update, per parameter (None when it can): what the
    per-block update (compile_core/step/chunked_update.py) and the update inside the backward
    (compile_core/in_backward/) both need."""
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        return f"{type(optimizer).__name__} is not one of {names} (its update is not known per parameter)"
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param group {i} has differentiable=True"
        if any(p.is_sparse for p in group["params"]) or group.get("sparse"):
            return f"param group {i} has sparse parameters"
        if not covers(group["params"]):
            return f"param group {i} has complex (or non-floating-point) parameters"
    return None


def next_steps(step_counts: Sequence[torch.Tensor]) -> list[float]:
    """The step each update brings its parameter to (its `state["step"]` + 1), read in one transfer per device
    (one stacked read, not one `.item()` per parameter: on a GPU each would wait for the stream, and even on
    the CPU each is a dispatched op, hundreds per update for a GPT-2-sized model)."""
    steps: list[float | None] = [None] * len(step_counts)
    on_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, count in enumerate(step_counts):
        on_device.setdefault((count.device, count.dtype), []).append(i)
    for indices in on_device.values():
        for i, value in zip(indices, torch.stack([step_counts[i] for i in indices]).tolist()):
            steps[i] = float(value) + 1
    return steps  # type: ignore[return-value]


class KnownSteps:
    """Each parameter's step count as the host last read or advanced it, so that an update reads only the
    counts it cannot vouch for (`next_steps`): on a GPU a count on the device would wait for the stream, and
    every read is a dispatched op per parameter.

    A count is vouched for while it is the same tensor at the version the host left it at: any in-place
    write (torch's own step, a user's `+=`) moves its version (`aot/torch_eager.py: version_of`), and a
    loaded or cleared state brings another tensor.

    `next_steps_of` answers for a whole table at once: the answer the host expects for it (the same count
    tensors at the versions its own `advance` left) is checked by two list comparisons before the forward,
    where the GPU waits for the host; the per-count bookkeeping happens in `advance`, after the backward."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[torch.Tensor, int, float]] = {}
        """key -> (the count tensor, its version then, its value then)."""
        self._expected: dict[Any, tuple[list[torch.Tensor], list[int], list[float]]] = {}
        """table -> (its count tensors, their versions, the steps `next_steps_of` answers while they hold)."""

    def next_steps_of(self, table: Any, keys: Sequence[int], counts: list[torch.Tensor]) -> list[float]:
        """`next_steps` of `zip(keys, counts)`, for the counts of one table (the same keys at every call)."""
        expected = self._expected.get(table)
        if (
            expected is not None
            and len(expected[0]) == len(counts)
            and all(map(operator.is_, counts, expected[0]))
            and versions_of(counts) == expected[1]
        ):
            return list(expected[2])
        steps = self.next_steps(list(zip(keys, counts)))
        self._expected[table] = (counts, versions_of(counts), steps)
        return list(steps)

    def next_steps(self, counts: Sequence[tuple[int, torch.Tensor]]) -> list[float]:
        """For each (key, count tensor): the step the next update brings it to (its value + 1)."""
        known, steps = self._known, [0.0] * len(counts)
        unread: list[int] = []
        for i, (key, count) in enumerate(counts):
            entry = known.get(key)
            if entry is not None and entry[0] is count and version_of(count) == entry[1]:
                steps[i] = entry[2] + 1
            else:
                unread.append(i)
        if unread:
            for i, step in zip(unread, next_steps([counts[i][1] for i in unread])):
                key, count = counts[i]
                known[key] = (count, version_of(count), step - 1)
                steps[i] = step
        return steps

    def advance(self, counts: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Each count + 1 in place (one foreach op per device), still vouched for where it was before; a table
        whose counts all advanced from what it expected expects the next steps (any other write: read again)."""
        before = {id(count): version_of(count) for _, count in counts}
        add_to_each([count for _, count in counts], 1)
        known = self._known
        for key, count in counts:
            entry = known.get(key)
            if entry is not None and entry[0] is count and version_of(count) == entry[1] + 1:
                known[key] = (count, entry[1] + 1, entry[2] + 1)
            else:
                known.pop(key, None)
        for table, (tensors, versions, steps) in list(self._expected.items()):
            if not all(before.get(id(t)) == v and version_of(t) == v + 1 for t, v in zip(tensors, versions)):
                del self._expected[table]
                continue
            self._expected[table] = (tensors, [v + 1 for v in versions], [s + 1 for s in steps])


def scalars(
    optimizer: torch.optim.Optimizer, group: dict, steps: Sequence[float], device: torch.device | None = None
) -> torch.Tensor:
    """One row of scalars per parameter, for an update that brings each to `steps[i]` (float32, on `device`).

    On a GPU the rows travel from page-locked memory without blocking: a copy from ordinary (pageable) host
    memory would first wait for everything already queued on the stream, every update."""
    if is_adam(optimizer):
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        first = (1 - lr * wd) if decoupled(optimizer, group) else wd
        distinct = sorted(set(steps))  # parameters usually share their step count: a row per distinct count
        rows = [
            [first, 1 - beta1, beta2, 1 - beta2, (1 - beta2**s) ** 0.5, -(lr / (1 - beta1**s)), eps, lr, s]
            for s in distinct
        ]
    else:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        momentum, dampening = float(group["momentum"]), float(group["dampening"])
        distinct, rows = [0.0], [[wd, momentum, 1 - dampening, -lr, lr]]
    # One flat buffer of float32, read as a tensor without a copy: the table from Python rows (a list per
    # parameter) converted each number on its own, 0.14 ms an update for 150 parameters against 0.04, and a
    # tensor op would be a kernel of its own on the CPU.
    if not steps:
        host = torch.tensor([], dtype=torch.float32)
    else:
        if len(rows) == 1:
            flat = array("f", rows[0]) * len(steps)  # one row converted, then repeated in C
        else:
            row_of = {s: array("f", row) for s, row in zip(distinct, rows)}
            flat = array("f")
            for s in steps:
                flat.extend(row_of[s])
        host = torch.frombuffer(flat, dtype=torch.float32).view(len(steps), -1)
    if device is None or torch.device(device).type == "cpu":
        return host
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def adam_math(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    step: torch.Tensor | None,
    s: torch.Tensor,
    *,
    decoupled: bool,
    weight_decay: bool,
    maximize: bool,
    low_lerp: bool | None = None,
) -> None:
    """One Adam/AdamW update in place (`s`: a row laid out as `ADAM_SCALARS`, computed for the step count
    this update reaches; `step`, when given, is advanced to it).

    `low_lerp`: which of `lerp`'s two formulas the first moment takes, when the caller knows it (True:
    |1 - beta1| < 0.5, `m + w * (g - m)`; False: `g - (1 - w) * (g - m)`), the same ops `lerp_` with a
    tensor weight decomposes into, without choosing per element at run time (a graph spliced once per
    parameter is then 5 nodes shorter); None: `lerp_` itself."""
    if maximize:
        grad = -grad
    if step is not None:  # None: the caller counts steps itself (the update inside the backward)
        step.add_(1)
    if weight_decay:
        if decoupled:
            param.mul_(s[0])
        else:
            grad = torch.addcmul(grad, param, s[0])
    if low_lerp is None:
        exp_avg.lerp_(grad, s[1])
    elif low_lerp:
        exp_avg.copy_(torch.addcmul(exp_avg, s[1], grad - exp_avg))
    else:
        exp_avg.copy_(torch.addcmul(grad, -(1 - s[1]), grad - exp_avg))
    exp_avg_sq.mul_(s[2]).addcmul_(grad * s[3], grad)
    if max_exp_avg_sq is not None:
        max_exp_avg_sq.copy_(torch.maximum(max_exp_avg_sq, exp_avg_sq))
        denom = max_exp_avg_sq.sqrt() / s[4] + s[6]
    else:
        denom = exp_avg_sq.sqrt() / s[4] + s[6]
    param.add_(s[5] * exp_avg / denom)


def sgd_math(
    param: torch.Tensor,
    grad: torch.Tensor,
    buf: torch.Tensor | None,
    s: torch.Tensor,
    *,
    weight_decay: bool,
    nesterov: bool,
    maximize: bool,
) -> None:
    """One SGD update in place (`s`: a row laid out as `SGD_SCALARS`); `buf` None: no momentum."""
    if maximize:
        grad = -grad
    if weight_decay:
        grad = torch.addcmul(grad, param, s[0])
    if buf is not None:
        buf.mul_(s[1]).addcmul_(grad, s[2])
        grad = torch.addcmul(grad, buf, s[1]) if nesterov else buf
    param.addcmul_(grad, s[3])
