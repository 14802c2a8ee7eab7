"""The optimizer side of the update inside the backward: which optimizers, their math as graphs, their state.

`OptimizerInBackward` chooses each parameter's update when a backward is compiled (see Note [Optimizer
update inside the backward] in compile_core/in_backward/__init__.py): torch's fused SGD/Adam/AdamW kernel where
it applies (`FusedKernel`), else an update graph captured once per (param group, dtype, device)
(`UpdateTemplate`). It hands out, per update, each parameter's live state tensors and its row in its group's
table of scalars (compile_core/step/optim_math.py); after a backward that updated, it advances the step counts.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from aot.torch_dynamo import capture_functional
from aot.torch_eager import fused_adam_kernel, fused_kernel_devices, fused_sgd_kernel
from compile_core.in_backward.splice import FusedKernel, UpdateTemplate
from compile_core.step import optim_math
from inductor.torch_inductor import decompositions


class OptimizerInBackward:
    """Templates and per-call inputs for the updates the compiled backward applies (read by
    compile_core/in_backward/graph_inputs.py for each graph compiled with the updates)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip_max_norm: float | None = None,
        half_on_kernel: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.clip_max_norm = clip_max_norm
        """With clipping, every bucket is updated after the last all-reduce (global norm first)."""
        self.half_on_kernel = half_on_kernel
        """Whether bf16/fp16 parameters of any group take torch's fused kernel (`_fusable`): the backend compiles
        the update graph into kernels that compute in fp32 and round once per update, as that kernel does
        (Inductor), so the graph would only cost its compile."""
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), None)
        self.norm = torch.zeros((), dtype=torch.float32, device=device) if clip_max_norm is not None else None
        """Receives the total gradient norm (before clipping) from the backward."""
        self._templates: dict[tuple[int, torch.dtype, torch.device], UpdateTemplate] = {}
        self._group_of: dict[int, int] = {}
        self._baked: list[tuple] = []
        self._values_at_prepare: list[tuple] = []
        self._fused: dict[int, FusedKernel] = {}
        """param group index -> the fused kernel a compiled backward bakes its values into."""
        self._values_move: set[int] = set()
        """param groups whose fused-kernel constants changed since update 1 (`moved_constants`): the update graph
        from then on."""
        self.generation = 0
        """Bumped when a compiled backward's updates no longer fit and the next one must compile anew
        (`BackwardHook.generation`, ddp/in_graph/hooks.py)."""
        self._members: dict[tuple[int, torch.device], list[torch.nn.Parameter]] = {}
        """Per (group, device): its parameters as `prepare` first saw them, in group order (a row each)."""
        self._member_ids: dict[tuple[int, torch.device], list[int]] = {}
        """`_members` as ids (the keys of `_state_of`)."""
        self._slot: dict[int, tuple[tuple[int, torch.device], int]] = {}  # param id -> (table key, row)
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}  # this update's scalar rows, per key
        self._state_of: dict[int, dict] = {}
        """id(param) -> its optimizer state, read at `refresh`: the per-call lookups of every state tensor go
        through ints, not through `Tensor.__hash__` (a Python call per lookup, hundreds per update)."""
        self._with_state: list[torch.nn.Parameter] = []  # the parameters that had optimizer state at `prepare`
        self._state_watch = optim_math.StateWatch(optimizer)  # marked at `prepare` and while nothing is lost
        self._steps = optim_math.KnownSteps()  # the step counts as the host last read or advanced them

    def prepare(self) -> None:
        """After update 1 (which created the optimizer state; plain SGD keeps none): note the groups' options,
        give each parameter its row, and capture the update graph of each (group, dtype, device) that has a
        parameter with state the fused kernel cannot take (here, not inside a compile). Each update is chosen
        when a backward compiles (`update_for`)."""
        self._baked = [_flags(self.optimizer, g) for g in self.optimizer.param_groups]
        self._values_at_prepare = [_kernel_values(self.optimizer, g) for g in self.optimizer.param_groups]
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = index
                if id(p) not in self._slot:  # rows never move: a graph compiled earlier reads them by index
                    members = self._members.setdefault((index, p.device), [])
                    self._slot[id(p)] = ((index, p.device), len(members))
                    members.append(p)
                    self._member_ids.setdefault((index, p.device), []).append(id(p))
                if not self._fusable(index, p):
                    self.template_for(p)
        self._with_state = [p for g in self.optimizer.param_groups for p in g["params"] if self._ready(p, g)]
        self._state_watch.mark()
        self.refresh()

    def lost_state(self) -> list[torch.nn.Parameter]:
        """The parameters that had optimizer state at `prepare` and have none now: the user cleared it
        (`optimizer.state.clear()`, `del optimizer.state[p]`) or loaded a checkpoint without it
        (`load_state_dict`, which replaces the mapping). Their update must create it, as torch's step does
        (step 0, zero moments); the compiled backward reads it. A dict lookup per update while the mapping
        is the same and did not shrink."""
        if not self._state_watch.changed():
            return []
        groups = self.optimizer.param_groups
        lost = [p for p in self._with_state if not self._ready(p, groups[self._group_of[id(p)]])]
        if not lost:
            self._state_watch.mark()
        return lost

    def refresh(self) -> None:
        """This update's table of scalars per (group, device), a row per parameter (before its forward).

        One table per group and device, not a row per parameter: every row is an input of the compiled
        graph, and each input costs host time at every call (a producer, a size check, AOT's wrapper).
        A parameter without state (no update here) gets the row of step 1, unread."""
        adam = optim_math.is_adam(self.optimizer)
        self._state_of = state_of = {id(p): state for p, state in self.optimizer.state.items()}
        for key, members in self._members.items():
            group, ids = self.optimizer.param_groups[key[0]], self._member_ids[key]
            if not adam:
                steps = [0.0] * len(members)
            elif all("step" in state_of.get(i, ()) for i in ids):
                steps = self._steps.next_steps_of(key, ids, [state_of[i]["step"] for i in ids])  # the usual case
            else:
                counted = [i for i, p in enumerate(members) if "step" in state_of.get(id(p), ())]
                known = self._steps.next_steps([(id(members[i]), state_of[id(members[i])]["step"]) for i in counted])
                steps = [1.0] * len(members)
                for i, s in zip(counted, known):
                    steps[i] = s
            self._tables[key] = optim_math.scalars(self.optimizer, group, steps, key[1])

    def advance_steps(self, updated: frozenset[int]) -> None:
        """After a backward that updated the parameters with these ids: their step counts + 1, as torch's
        step does, in one foreach op (on the host, not in the graph: as graph inputs the counts, 0-dim CPU
        tensors, cost an input each at every call, and a CPU kernel beside a GPU graph's). The host keeps
        what it wrote (`KnownSteps`): the next update reads back only counts someone else changed."""
        if not optim_math.is_adam(self.optimizer) or not updated:
            return
        state_of = self._state_of
        counts = [(i, state_of[i]["step"]) for i in updated if "step" in state_of.get(i, ())]
        if counts:
            self._steps.advance(counts)

    def _ready(self, param: torch.nn.Parameter, group: dict) -> bool:
        """Whether `param` has the optimizer state its update reads (a parameter that never had a
        gradient has none: the normal step creates it, as torch does)."""
        if isinstance(self.optimizer, torch.optim.SGD) and group["momentum"] == 0:
            return True
        return param in self.optimizer.state and bool(self.optimizer.state[param])

    def changed_hyperparameters(self) -> str | None:
        """A structural option changed since `prepare` (momentum turned on or off, nesterov, maximize,
        amsgrad): the compiled updates no longer fit. Values never stop it (`moved_constants`)."""
        for index, (group, baked) in enumerate(zip(self.optimizer.param_groups, self._baked)):
            now = _flags(self.optimizer, group)
            if now != baked:
                changed = [k for (k, a), (_, b) in zip(baked, now) if a != b]
                return f"param group {index} changed {changed} after the update graphs were captured"
        return None

    def moved_constants(self) -> list[str]:
        """Before a synchronising forward: the groups whose constants of torch's fused kernel (betas, weight decay,
        eps; SGD's momentum, dampening) changed since update 1 take the update graph (which reads them as values)
        from now on; its graphs are captured here. A schedule that moves them at every update (OneCycleLR's
        beta1 or momentum) is seen before update 2 compiles. Where a compiled backward already holds them, it
        must compile once more (`generation`): one description per such group, empty when none."""
        groups, moved = self.optimizer.param_groups, []
        for index, before in enumerate(self._values_at_prepare):
            if index in self._values_move:
                continue
            kernel = self._fused.get(index)
            baked = dict(kernel.options if kernel is not None else before)
            now = _kernel_values(self.optimizer, groups[index])
            changed = [f"{k} {baked[k]} -> {v}" for k, v in now if baked[k] != v]
            if not changed:
                continue
            self._values_move.add(index)
            for p in groups[index]["params"]:
                self.template_for(p)
            if kernel is not None:
                del self._fused[index]
                moved.append(f"param group {index} changed {', '.join(changed)}")
        if moved:
            self.generation += 1
        return moved

    def update_for(self, param: torch.nn.Parameter) -> UpdateTemplate | FusedKernel | None:
        """The update a backward compiled now applies to `param` (None: none, the step after the backward
        updates it): torch's fused kernel when it can take the parameter and the values it takes as numbers
        (betas, weight decay, eps; SGD's momentum, dampening, weight decay) stayed as update 1 left them (they
        become constants of the graph), else the captured update graph of its group, dtype and device."""
        index = self._group_of.get(id(param))
        if index is None:
            return None
        group = self.optimizer.param_groups[index]
        if not self._ready(param, group):
            return None
        kernel = self._fused_kernel(index, group, param)
        # a graph captured earlier (`prepare`, `moved_constants`): a capture inside this compile would nest
        return kernel if kernel is not None else self._templates.get((index, param.dtype, param.device))

    def template_for(self, param: torch.nn.Parameter) -> UpdateTemplate | None:
        """The update graph of the parameter's group, dtype and device (captured on first request; not from
        inside a compile)."""
        index = self._group_of.get(id(param))
        if index is None or not self._ready(param, self.optimizer.param_groups[index]):
            return None
        key = (index, param.dtype, param.device)
        if key not in self._templates:
            self._templates[key] = self._capture(self.optimizer.param_groups[index], param)
        return self._templates[key]

    def fused_groups(self) -> list[int]:
        """The param groups whose compiled update is torch's fused kernel."""
        return sorted(self._fused)

    def update_graph_groups(self) -> list[dict[str, Any]]:
        """The (param group, dtype, device) whose update graph was captured (a parameter there the kernel cannot
        take, or the group's values moved), with how many parameters of that dtype and device the group holds:
        the part of the update that costs compile time."""
        out = []
        for index, dtype, device in sorted(self._templates, key=lambda k: (k[0], str(k[1]), str(k[2]))):
            group = self.optimizer.param_groups[index]
            count = sum(p.dtype == dtype and p.device == device for p in group["params"])
            out.append(
                {"group": index, "dtype": str(dtype).removeprefix("torch."), "device": str(device), "params": count}
            )
        return out

    def _fusable(self, index: int, param: torch.nn.Parameter) -> bool:
        """Whether torch's fused kernel can update `param` (contiguous and not empty: on CUDA the kernel refuses
        other strides than the gradient's, and an empty tensor last in a list) with its group's values as
        constants (none moved since update 1: `moved_constants`), in a group that does not say `fused=False`
        (the user's word that their step is not that kernel: the update graph, compiled by the backend, as the
        step after the backward is compiled for such a group; on one H100 Inductor's AdamW kernels took 1.3 ms
        a step less GPU time than torch's fused one, GPT-2 small, at a compile's cost).

        A bf16/fp16 parameter where the user's own step is that kernel (`fused=True`) or the backend rounds the
        update graph as it does (`half_on_kernel`): the kernel rounds once per update where eager's other steps
        round per op, a unit in the last place apart at every update (SGD on bf16 N(0, 1) weights, CPU: up to
        0.019 apart after one update), which training carries on; the update graph run op by op rounds as eager
        does."""
        wide = param.dtype in (torch.float32, torch.float64)
        half = param.dtype in (torch.bfloat16, torch.float16)
        fused = self.optimizer.param_groups[index].get("fused")
        rounds_once = self.half_on_kernel or bool(fused)
        return (
            index not in self._values_move
            and fused is not False
            and (wide or (half and rounds_once))
            and param.is_contiguous()
            and param.numel() > 0
            and param.device.type in fused_kernel_devices()
        )

    def _fused_kernel(self, index: int, group: dict, param: torch.nn.Parameter) -> FusedKernel | None:
        if not self._fusable(index, param):
            return None
        # a kernel kept here holds the group's current values: `moved_constants`, before every synchronising
        # forward, drops the one whose values moved
        kernel = self._fused.get(index)
        if kernel is None:
            kernel = self._fused[index] = _fused_kernel_of(self.optimizer, group, _kernel_values(self.optimizer, group))
        return kernel

    def state_tensors(self, wanted: Sequence[tuple[torch.nn.Parameter, str]]) -> list[torch.Tensor]:
        """The live state tensors named by (parameter, key), in order: looked up at every call (the producer of a
        graph's state inputs, once per run for all of them), in the state mapping as the last `refresh` found it
        (`load_state_dict` replaces them), else, for a parameter that refresh did not see, in the optimizer's."""
        state_of, state = self._state_of, self.optimizer.state
        return [(s if (s := state_of.get(id(p))) is not None else state[p])[key] for p, key in wanted]

    def state_producer(self, wanted: Sequence[tuple[torch.nn.Parameter, str]]) -> Callable[[], list[torch.Tensor]]:
        """`state_tensors(wanted)` as a call without arguments, run before every forward of the graph (where the
        GPU waits for the host): the ids are taken once, and a parameter that `refresh` did not see (a KeyError)
        takes the general lookup."""
        keyed = [(id(p), key) for p, key in wanted]

        def produce() -> list[torch.Tensor]:
            state_of = self._state_of
            try:
                return [state_of[i][key] for i, key in keyed]
            except KeyError:
                return self.state_tensors(wanted)

        return produce

    def scalar_table(self, param: torch.nn.Parameter) -> tuple[Any, torch.Tensor, int]:
        """(key, table, row): this update's scalar table of the parameter's group and device, and the
        parameter's row in it (compile_core/step/optim_math.py); parameters sharing a key share the table."""
        key, row = self._slot[id(param)]
        return key, self._tables[key], row

    # -- capture -----------------------------------------------------------------------------------

    def _capture(self, group: dict, param: torch.nn.Parameter) -> UpdateTemplate:
        state = self.optimizer.state.get(param, {})
        state_keys = tuple(k for k in _state_keys(self.optimizer, group) if k in state)
        # A small stand-in with the same dtype/device: the update is elementwise.
        tiny = lambda t: t.detach().reshape(-1)[:4].clone() if t.dim() else t.detach().clone()  # noqa: E731
        row = optim_math.scalars(self.optimizer, group, [1.0], param.device)[0]
        args = [tiny(param), tiny(param)] + [tiny(state[k]) for k in state_keys] + [row]
        fn = _update_function(self.optimizer, group, state_keys)
        # In Inductor's terms (what a graph spliced after partitioning must be), fine for aot_eager too.
        graph, positions = capture_functional(fn, args, decompositions=decompositions())
        return UpdateTemplate(graph=graph, positions=tuple(positions), state_keys=state_keys)


def _flags(optimizer: torch.optim.Optimizer, group: dict) -> tuple:
    """The options that decide the update's graph (every number is an input instead)."""
    # Weight decay is always in the graph: a decay of 0 multiplies by exactly 1 (AdamW) or adds exactly 0
    # (Adam, SGD), so a decay schedule that starts at 0 never changes the graph.
    keys = {"weight_decay": True, "maximize": bool(group.get("maximize"))}
    if isinstance(optimizer, torch.optim.SGD):
        keys.update(momentum=group["momentum"] != 0, nesterov=bool(group["nesterov"]))
    else:
        keys.update(amsgrad=bool(group.get("amsgrad")), decoupled=optim_math.decoupled(optimizer, group))
        keys.update(low_lerp=abs(1 - float(group["betas"][0])) < 0.5)  # lerp's formula for the first moment
    return tuple(sorted(keys.items()))


def _kernel_values(optimizer: torch.optim.Optimizer, group: dict) -> tuple[tuple[str, float], ...]:
    """The values torch's fused kernel takes as numbers (baked into the compiled backward); the learning rate
    it reads from a tensor."""
    if not optim_math.is_adam(optimizer):
        names = ("weight_decay", "momentum", "dampening")
        return tuple((k, float(group[k])) for k in names)
    beta1, beta2 = (float(b) for b in group["betas"])
    return (
        ("beta1", beta1),
        ("beta2", beta2),
        ("weight_decay", float(group["weight_decay"])),
        ("eps", float(group["eps"])),
    )


def _fused_kernel_of(optimizer: torch.optim.Optimizer, group: dict, values: tuple) -> FusedKernel:
    maximize = bool(group.get("maximize"))
    if not optim_math.is_adam(optimizer):  # SGD: update 1 created the momentum buffers (no first step here)
        momentum = group["momentum"] != 0
        return FusedKernel(
            op=fused_sgd_kernel(),
            options=values + (("nesterov", bool(group["nesterov"])), ("maximize", maximize), ("is_first_step", False)),
            state_keys=("momentum_buffer",) if momentum else (),
            lr_column=optim_math.SGD_SCALARS.index("lr"),
            step_column=None,
        )
    return FusedKernel(
        op=fused_adam_kernel(decoupled=optim_math.decoupled(optimizer, group)),
        options=values + (("amsgrad", bool(group.get("amsgrad"))), ("maximize", maximize)),
        state_keys=_state_keys(optimizer, group),
        lr_column=optim_math.ADAM_SCALARS.index("lr"),
        step_column=optim_math.ADAM_SCALARS.index("step"),
    )


def _state_keys(optimizer: torch.optim.Optimizer, group: dict) -> tuple[str, ...]:
    if isinstance(optimizer, torch.optim.SGD):
        return ("momentum_buffer",)
    return (
        # not "step": its count is in the scalar row, and `advance_steps` moves it on the host
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
    )


def _update_function(optimizer: torch.optim.Optimizer, group: dict, state_keys: tuple[str, ...]) -> Callable[..., None]:
    """`update(param, grad, *states, scalars)`: one parameter's update (compile_core/step/optim_math.py)."""
    flags = dict(_flags(optimizer, group))
    if isinstance(optimizer, torch.optim.SGD):

        def update_sgd(param: torch.Tensor, grad: torch.Tensor, *rest: torch.Tensor) -> None:
            buf = rest[0] if flags["momentum"] else None
            optim_math.sgd_math(
                param,
                grad,
                buf,
                rest[-1],
                weight_decay=flags["weight_decay"],
                nesterov=flags["nesterov"],
                maximize=flags["maximize"],
            )

        return update_sgd

    def update_adam(param: torch.Tensor, grad: torch.Tensor, *rest: torch.Tensor) -> None:
        states = dict(zip(state_keys, rest[:-1]))
        optim_math.adam_math(
            param,
            grad,
            states["exp_avg"],
            states["exp_avg_sq"],
            states.get("max_exp_avg_sq"),
            None,  # the step count moves on the host (`OptimizerInBackward.advance_steps`)
            rest[-1],
            decoupled=flags["decoupled"],
            weight_decay=flags["weight_decay"],
            maximize=flags["maximize"],
            low_lerp=flags["low_lerp"],
        )

    return update_adam
