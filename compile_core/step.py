"""One call per micro-batch: compiled forward + loss, backward, and a compiled optimizer update.

    step = train_step(ddp_model, optimizer, loss_fn, backend="inductor", accum_steps=4,
                      clip_grad_norm=1.0, lr_scheduler=sched)
    for inputs, target in loader:
        loss = step(inputs, target)      # detached; nothing here forces a host sync

Note (design):
    The step has three parts, each captured where it can be and reported separately.

    1. Forward + loss. The model goes through `compile_core.compile` (bucket-aligned graph pieces,
       AOT-paired backward); `loss_fn` runs on its output under the optional autocast, and
       `loss / accum_steps` is back-propagated. DDP's reducer is left in charge of the all-reduce, so
       accumulation uses DDP's own `no_sync()`, which has to cover forward *and* backward: DDP decides
       in the forward whether the coming backward will reduce.
    2. Gradient accumulation. Each call consumes ONE micro-batch, as in a hand-written PyTorch loop;
       the optimizer steps on every `accum_steps`-th call (`step.applied` tells which). The first
       k-1 micro-batches run under `no_sync()`, the k-th synchronises, and every micro-batch loss is
       scaled by 1/k, so the update equals eager DDP doing the same accumulation. The returned loss
       is the micro-batch's own (unscaled) loss, what one logs.
    3. Optimizer update. `clip_grad_norm_` (optional) and `optimizer.step()` form one function that
       Dynamo compiles with the same backend as the model. A scheduler that
       writes a new Python float into `param_groups` every step would make Dynamo recompile every
       step (it guards on the value), so before the first compile the learning rate (and Adam's
       beta1, which OneCycleLR/CyclicLR cycle) is replaced by a 0-dim tensor that we own; before
       every update we copy whatever the scheduler wrote into that tensor and put the tensor back.
       The compiled graph reads the tensor, so new values never invalidate it. (SGD's momentum,
       which OneCycleLR also cycles, stays a float: torch's SGD branches on `momentum != 0`, and
       Dynamo passes that float in as a graph input without recompiling. SGD does recompile once,
       at update 2, because it creates its momentum buffers in update 1.) A post-hook on
       `optimizer.state_dict()` turns those tensors back into floats (and restores flags we had
       to change), so checkpoints stay in the user's format and load into a plain eager optimizer.
       If the update cannot be compiled, it runs eagerly from then on and the report says why.

    What Dynamo makes of `optimizer.step()` (torch 2.13): torch's optimizers break the graph on
    purpose around the update (so AOTAutograd sees a no-grad graph), and a scheduler's wrapper
    around `optimizer.step` is a skipped frame; the update itself is then captured in the nested
    frame. Dynamo never fails loudly on what it cannot trace, it runs it eagerly, so "compiled" is
    checked, not assumed: after the first update, if no compiled graph read the parameters, the
    update counts as not compiled (reason: Dynamo's graph-break messages) and runs eagerly.

    Recompiles are counted, not assumed: the optimizer update is compiled with a counting backend
    (every graph handed to the backend is counted) and Dynamo's guard-failure hook supplies the
    reason of each recompile.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

__all__ = ["TrainStep", "TrainStepConfig", "TrainStepReport", "OptimizerReport", "train_step"]

_DDP_MODES = ("split", "none", "torch", None)
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
# Hyperparameters that LR schedulers rewrite every step; each becomes a 0-dim tensor we own.
_PINNED_SCALARS = ("lr",)
_PINNED_BETA = "betas"  # only beta1 is cycled (OneCycleLR/CyclicLR), but torch wants both as tensors


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStepConfig:
    """How a train step is captured; validated on construction."""

    backend: str | Callable[..., Any] = "inductor"
    """Dynamo backend for the model and the optimizer update ("inductor", "aot_eager", "eager", ...)."""
    ddp: str | None = "split"
    """How compile_core handles DDP: "split", "none", "torch", or None for compile_core's default."""
    accum_steps: int = 1
    """Micro-batches per optimizer update; each call of the step consumes one micro-batch."""
    clip_grad_norm: float | None = None
    """Max global L2 norm of the (all-reduced) gradients before the update; None disables clipping."""
    autocast: torch.dtype | None = None
    """Autocast dtype for forward + loss (torch.bfloat16 or torch.float16); None runs in full precision."""
    compile_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments for compile_core.compile (bucket_cap_mb, fullgraph, mode, ...)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(
                f"backend={self.backend!r}: expected a backend name such as 'inductor' or 'aot_eager', "
                "or a Dynamo backend callable"
            )
        if self.ddp not in _DDP_MODES:
            raise ValueError(f"ddp={self.ddp!r}: expected one of {', '.join(map(repr, _DDP_MODES))}")
        if isinstance(self.accum_steps, bool) or not isinstance(self.accum_steps, int):
            raise TypeError(f"accum_steps={self.accum_steps!r}: expected an int >= 1 (micro-batches per update)")
        if self.accum_steps < 1:
            raise ValueError(
                f"accum_steps={self.accum_steps}: must be >= 1; use 1 for no accumulation, "
                "k to update once every k calls"
            )
        if self.clip_grad_norm is not None:
            bad_type = isinstance(self.clip_grad_norm, bool) or not isinstance(self.clip_grad_norm, (int, float))
            if bad_type or not math.isfinite(self.clip_grad_norm) or self.clip_grad_norm <= 0:
                raise ValueError(
                    f"clip_grad_norm={self.clip_grad_norm!r}: must be a finite number > 0 (e.g. 1.0), "
                    "or None to disable clipping"
                )
        if self.autocast is not None and self.autocast not in _AUTOCAST_DTYPES:
            raise ValueError(
                f"autocast={self.autocast!r}: expected torch.bfloat16, torch.float16 or None "
                "(None runs forward and loss in full precision)"
            )
        if not isinstance(self.compile_kwargs, Mapping):
            raise TypeError(f"compile_kwargs={self.compile_kwargs!r}: expected a mapping of keyword arguments")


@dataclasses.dataclass
class OptimizerReport:
    """What happened to the optimizer update (clip + optimizer.step)."""

    optimizer: str
    """Class name of the optimizer."""
    compiled: bool = True
    """False once the update fell back to eager (see fallback_error)."""
    graphs: int = 0
    """Graphs handed to the backend for the update, over all compiles."""
    recompiles: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One {"reason", "update"} per compile after the first; "update" is the 1-based update index."""
    compile_seconds: float = 0.0
    """Wall time of the updates that compiled something (Dynamo tracing + backend)."""
    fallback_error: str | None = None
    """Why the update runs eagerly, or None."""
    graph_breaks: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """Graph breaks Dynamo reported while capturing the first update ({"reason"})."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "compiled": self.compiled,
            "graphs": self.graphs,
            "recompiles": [dict(r) for r in self.recompiles],
            "compile_seconds": round(self.compile_seconds, 4),
            "fallback_error": self.fallback_error,
            "graph_breaks": [dict(b) for b in self.graph_breaks],
        }


@dataclasses.dataclass
class TrainStepReport:
    """The model's compile report plus the optimizer part and the step counters."""

    model: Any
    """compile_core's CompileReport for forward/backward (None if the compiled model has no report)."""
    optimizer: OptimizerReport
    """The optimizer part."""
    backend: str
    """Backend name used for both parts."""
    accum_steps: int
    """Micro-batches per update."""
    micro_batches: int
    """Calls so far."""
    updates: int
    """Optimizer updates applied so far."""

    def _model_dict(self) -> dict[str, Any]:
        if self.model is None:
            return {"graphs": [], "graph_breaks": [], "recompiles": [], "fallbacks": [], "compile_seconds": 0.0}
        return dict(self.model.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the compile report's keys cover every part, "parts" splits them per part."""
        model = self._model_dict()
        opt = self.optimizer.to_dict()
        model_recompiles = [{**r, "part": "model"} for r in model.get("recompiles", [])]
        opt_recompiles = [{**r, "part": "optimizer"} for r in opt["recompiles"]]
        fallbacks = list(model.get("fallbacks", []))
        if opt["fallback_error"] is not None:
            fallbacks.append(
                {"piece": "optimizer.step", "from": self.backend, "to": "eager", "error": opt["fallback_error"]}
            )
        model_seconds = float(model.get("compile_seconds", 0.0))
        out = dict(model)
        out.update(
            recompiles=model_recompiles + opt_recompiles,
            fallbacks=fallbacks,
            compile_seconds=round(model_seconds + opt["compile_seconds"], 4),
            optimizer=opt,
            parts={
                "model": {"compile_seconds": round(model_seconds, 4), "recompiles": model_recompiles},
                "optimizer": {"compile_seconds": opt["compile_seconds"], "recompiles": opt_recompiles},
            },
            backend=self.backend,
            accum_steps=self.accum_steps,
            micro_batches=self.micro_batches,
            updates=self.updates,
        )
        return out

    def __str__(self) -> str:
        d = self.to_dict()
        opt = d["optimizer"]
        status = "compiled" if opt["compiled"] else f"EAGER (fallback: {opt['fallback_error']})"
        rows = [
            ("part", "compile s", "graphs", "recompiles"),
            ("model", f"{d['parts']['model']['compile_seconds']:.2f}",
             str(sum(int(g.get("pieces", 1)) for g in d.get("graphs", []))),
             str(len(d["parts"]["model"]["recompiles"]))),
            ("optimizer", f"{opt['compile_seconds']:.2f}", str(opt["graphs"]), str(len(opt["recompiles"]))),
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"train_step: backend={self.backend} accum_steps={self.accum_steps} "
                 f"micro_batches={self.micro_batches} updates={self.updates}"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(f"  optimizer {opt['optimizer']}: {status}")
        for b in opt["graph_breaks"]:
            lines.append(f"  optimizer graph break: {b['reason']}")
        for r in d["recompiles"]:
            where = f" (update {r['update']})" if "update" in r else ""
            lines.append(f"  recompile [{r['part']}]{where}: {r.get('reason', '?')}")
        if self.model is not None:
            lines.append("model compile report:")
            lines.append(str(self.model))
        return "\n".join(lines)


class _HyperparamPins:
    """Owns the 0-dim tensors that stand in for scheduler-driven hyperparameters in param_groups."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._tensors: list[dict[str, Any]] = []
        self._restore: list[dict[str, Any]] = []  # flags we changed, with the user's values
        self._forced: list[dict[str, Any]] = []  # ... and the values we need them to have
        self._hook = None

    def install(self) -> None:
        """Swap floats for tensors (before the first compile) and hook state_dict."""
        for group in self._optimizer.param_groups:
            owned: dict[str, Any] = {}
            restore: dict[str, Any] = {}
            # A value the user already gave as a tensor is theirs: schedulers fill it in place.
            for key in _PINNED_SCALARS:
                if key in group and not isinstance(group[key], torch.Tensor):
                    owned[key] = _scalar_tensor(group[key])
            betas = group.get(_PINNED_BETA)
            if isinstance(betas, tuple) and not any(isinstance(b, torch.Tensor) for b in betas):
                owned[_PINNED_BETA] = tuple(_scalar_tensor(b) for b in betas)
            # torch rejects a tensor lr with foreach=True unless capturable=True (both work on CPU and GPU).
            if owned and group.get("foreach") and not group.get("capturable", True):
                restore["capturable"] = group["capturable"]
            self._tensors.append(owned)
            self._restore.append(restore)
            self._forced.append({key: True for key in restore})
        self.sync()
        if self._hook is None:
            self._hook = self._optimizer.register_state_dict_post_hook(self._user_format)

    def sync(self) -> None:
        """Copy whatever a scheduler (or load_state_dict) wrote into our tensors; put them back."""
        for group, owned, forced in zip(self._optimizer.param_groups, self._tensors, self._forced):
            group.update(forced)  # load_state_dict brings back the user's flags
            for key, mine in owned.items():
                current = group[key]
                if key == _PINNED_BETA:
                    if not all(c is m for c, m in zip(current, mine)):
                        for c, m in zip(current, mine):
                            if c is not m:
                                m.fill_(c)  # float or tensor; fill_ never allocates
                        group[key] = mine
                elif current is not mine:
                    mine.fill_(current)
                    group[key] = mine

    def uninstall(self) -> None:
        """Back to plain floats and the user's flags (used when the update falls back to eager)."""
        for group, owned, restore in zip(self._optimizer.param_groups, self._tensors, self._restore):
            for key in owned:
                group[key] = _to_float(group[key])
            group.update(restore)
        self._tensors, self._restore, self._forced = [], [], []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _user_format(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        # state_dict() builds new group dicts, so editing them leaves the live groups alone.
        for group, owned, restore in zip(state["param_groups"], self._tensors, self._restore):
            # initial_lr: a scheduler built after the swap clones our lr tensor into it.
            for key in (*owned, "initial_lr") if "lr" in owned else owned:
                if key in group:
                    group[key] = _to_float(group[key])
            group.update(restore)
        return state


def _scalar_tensor(value: Any) -> torch.Tensor:
    # float64 on the CPU: holds a Python float exactly (so checkpoints round-trip bit for bit and
    # schedulers compute in double as they do eagerly); a 0-dim tensor does not promote the
    # float32 parameters it multiplies, and CPU scalars are what torch's compiled-optimizer recipe uses.
    return torch.tensor(float(value), dtype=torch.float64)


def _to_float(value: Any) -> Any:
    """0-dim tensors (and tuples of them) to Python floats; ours live on the CPU, so no GPU wait."""
    if isinstance(value, tuple):
        return tuple(_to_float(v) for v in value)
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return value


class _CompiledUpdate:
    """clip_grad_norm_ + optimizer.step() as one Dynamo-compiled function, with counted compiles.

    Dynamo does not fail on what it cannot trace: it breaks the graph or runs a whole frame eagerly,
    silently. So the first update also records which tensors the compiled graphs touch and the graph
    breaks Dynamo counted, and `uncaptured()` says which parameters were updated outside any graph.
    """

    def __init__(self, update: Callable[[], Any], backend: str | Callable[..., Any], report: OptimizerReport) -> None:
        self._report = report
        self._graphs_this_call = 0
        self._guard_failures: list[str] = []
        self._calls = 0
        self._touched: set[int] = set()  # data_ptr of every tensor a graph of the first update reads
        inner = _optimizer_backend(backend)

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            compiled = inner(gm, example_inputs)
            # Counted once compiled: a backend error makes Dynamo retry the same graph (seen on a
            # cold Inductor cache), which is not a second graph.
            self._graphs_this_call += 1
            if self._calls == 0:
                self._touched.update(_graph_tensor_ptrs(gm, example_inputs))
            return compiled

        def on_guard_fail(failure: Any) -> None:
            self._guard_failures.append(str(getattr(failure, "reason", failure)))

        try:
            # isolate_recompiles: several TrainSteps share the update's code object; without it they
            # would share (and evict) one cache and count each other's compiles as recompiles.
            self._fn = torch._dynamo.optimize(
                counting_backend, guard_fail_fn=on_guard_fail, isolate_recompiles=True
            )(update)
        except TypeError:  # an older Dynamo without these options: still counted, reasons unknown
            self._fn = torch.compile(update, backend=counting_backend)

    def __call__(self, update_index: int) -> Any:
        self._graphs_this_call = 0
        self._guard_failures.clear()
        breaks_before = _dynamo_break_counts() if self._calls == 0 else None
        start = time.perf_counter()
        out = self._fn()
        if self._graphs_this_call:
            self._report.compile_seconds += time.perf_counter() - start
            self._report.graphs += self._graphs_this_call
            if self._calls > 0:
                reason = "; ".join(dict.fromkeys(self._guard_failures)) or "unknown (no guard failure reported)"
                self._report.recompiles.append({"reason": reason, "update": update_index})
        if breaks_before is not None:
            self._report.graph_breaks = _new_breaks(breaks_before, _dynamo_break_counts())
        self._calls += 1
        return out

    def uncaptured(self, params: list[torch.Tensor]) -> list[int]:
        """Indices of `params` that no graph of the first update read (so they were updated eagerly)."""
        return [i for i, p in enumerate(params) if p.data_ptr() not in self._touched]


def _optimizer_backend(backend: str | Callable[..., Any]) -> Callable[..., Any]:
    """The backend the optimizer update is compiled with: the model's backend, by name or callable."""
    return torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend


def _graph_tensor_ptrs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> set[int]:
    # Dynamo lifts optimizer parameters and state into the graph as attributes (get_attr), grads as inputs.
    ptrs = {t.data_ptr() for t in example_inputs if isinstance(t, torch.Tensor)}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                ptrs.add(value.data_ptr())
    return ptrs


def _dynamo_break_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {**counters["unimplemented"], **counters["graph_break"]}


def _new_breaks(before: dict[str, int], after: dict[str, int]) -> list[dict[str, str]]:
    """Graph breaks Dynamo counted in between, first line of each reason (they are long)."""
    return [
        {"reason": reason.strip().splitlines()[0] + _debug_context(reason)}
        for reason, count in after.items()
        if count > before.get(reason, 0)
    ]


def _debug_context(reason: str) -> str:
    # Dynamo's first line says what kind of break it was; the debug context says where/what exactly.
    for line in reason.splitlines():
        if "Developer debug context:" in line:
            return " (" + line.split("Developer debug context:", 1)[1].strip()[:200] + ")"
    return ""


class TrainStep:
    """Callable training step; build it with `train_step(...)`. See the module Note for the design."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        config: TrainStepConfig,
        lr_scheduler: Any = None,
    ) -> None:
        _check_inputs(model, optimizer, loss_fn, lr_scheduler)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.compiled_model = _compile_model(model, config)
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self._device_type = _device_type(model)
        self._opt_report = OptimizerReport(optimizer=type(optimizer).__name__)
        self._pins = _HyperparamPins(optimizer)
        self._update: _CompiledUpdate | None = None
        self._micro = 0
        self._micro_batches = 0
        self._updates = 0
        self.applied = False
        """True when the last call applied an optimizer update."""
        self.last_grad_norm: torch.Tensor | None = None
        """Total gradient norm before clipping at the last update (a tensor; None without clipping)."""

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, *args: Any, target: Any = None) -> torch.Tensor:
        """`step(*inputs, target)` or `step(*inputs, target=target)`: one micro-batch."""
        inputs, target = _split_args(args, target)
        sync = self._micro == self.config.accum_steps - 1
        loss = self._forward_backward(inputs, target, sync=sync)
        self._micro_batches += 1
        self._micro = (self._micro + 1) % self.config.accum_steps
        self.applied = sync
        if sync:
            self._apply_update()
        return loss

    def _forward_backward(self, inputs: tuple[Any, ...], target: Any, *, sync: bool) -> torch.Tensor:
        # no_sync must cover the forward too: DDP arms the reducer for the next backward there.
        skip_sync = self._ddp.no_sync() if (self._ddp is not None and not sync) else contextlib.nullcontext()
        with skip_sync:
            with self._autocast():
                loss = self.loss_fn(self.compiled_model(*inputs), target)
            _check_loss(loss)
            scaled = loss / self.config.accum_steps if self.config.accum_steps > 1 else loss
            scaled.backward()
        return loss.detach()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, dtype=self.config.autocast)

    def _apply_update(self) -> None:
        index = self._updates + 1
        if self._update is None and self._opt_report.compiled:
            self._update = self._build_update()
        if self._update is not None:
            self._pins.sync()
            try:
                norm = self._update(index)
            except torch._dynamo.exc.TorchDynamoException as err:
                # Dynamo/backend could not capture or compile the update; nothing of the failing
                # graph ran. Other exceptions come from running the update and would recur eagerly.
                self._fall_back(_describe(err))
                norm = self._eager_update()
            else:
                if index == 1:
                    self._check_captured()
        else:
            norm = self._eager_update()
        self.last_grad_norm = None if norm is None else norm.detach()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
            _last_lr_as_floats(self.lr_scheduler)
        self._updates = index
        logger.info(
            "train_step: update %d applied after %d micro-batch(es) (optimizer %s, %s)",
            index, self.config.accum_steps, type(self.optimizer).__name__,
            "compiled" if self._opt_report.compiled else "eager",
        )

    def _update_fn(self) -> Callable[[], torch.Tensor | None]:
        params, max_norm, optimizer = self._params, self.config.clip_grad_norm, self.optimizer

        def update() -> torch.Tensor | None:
            norm = None
            if max_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
            return norm

        return update

    def _build_update(self) -> _CompiledUpdate:
        self._pins.install()
        return _CompiledUpdate(self._update_fn(), self.config.backend, self._opt_report)

    def _eager_update(self) -> torch.Tensor | None:
        return self._update_fn()()

    def _check_captured(self) -> None:
        """After the first update: if Dynamo ran the whole update eagerly, say so and stop trying."""
        assert self._update is not None
        missing = self._update.uncaptured(self._params)
        if len(missing) < len(self._params):
            return  # compiled (partly, at worst: the graph breaks are in the report)
        breaks = "; ".join(b["reason"] for b in self._opt_report.graph_breaks) or "no graph break reported"
        self._fall_back(f"Dynamo captured no graph that updates the parameters ({breaks})")

    def _fall_back(self, message: str) -> None:
        logger.warning("train_step: optimizer update could not be compiled, running eagerly: %s", message)
        self._opt_report.compiled = False
        self._opt_report.fallback_error = message
        self._update = None
        self._pins.uninstall()

    # -- introspection ----------------------------------------------------------------------------
    def report(self) -> TrainStepReport:
        model_report = self.compiled_model.report() if hasattr(self.compiled_model, "report") else None
        backend = self.config.backend if isinstance(self.config.backend, str) else getattr(
            self.config.backend, "__name__", repr(self.config.backend)
        )
        return TrainStepReport(
            model=model_report,
            optimizer=dataclasses.replace(self._opt_report, recompiles=list(self._opt_report.recompiles)),
            backend=backend,
            accum_steps=self.config.accum_steps,
            micro_batches=self._micro_batches,
            updates=self._updates,
        )

    @property
    def updates(self) -> int:
        """Optimizer updates applied so far."""
        return self._updates

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last update (0 right after an update)."""
        return self._micro


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    *,
    backend: str | Callable[..., Any] = "inductor",
    ddp: str | None = "split",
    accum_steps: int = 1,
    clip_grad_norm: float | None = None,
    autocast: torch.dtype | None = None,
    lr_scheduler: Any = None,
    **compile_kwargs: Any,
) -> TrainStep:
    """Build a compiled training step: `loss = step(*inputs, target)`.

    Each call runs one micro-batch (compiled forward, `loss_fn(output, target)`, backward of
    `loss / accum_steps`); every `accum_steps`-th call also clips (if `clip_grad_norm`), runs the
    compiled `optimizer.step()`, `optimizer.zero_grad(set_to_none=True)` and `lr_scheduler.step()`
    (if given). Returns the micro-batch loss, detached. `compile_kwargs` go to `compile_core.compile`.
    Raises TypeError/ValueError for bad arguments before any compile work.
    """
    config = TrainStepConfig(
        backend=backend,
        ddp=ddp,
        accum_steps=accum_steps,
        clip_grad_norm=clip_grad_norm,
        autocast=autocast,
        compile_kwargs=dict(compile_kwargs),
    )
    return TrainStep(model, optimizer, loss_fn, config, lr_scheduler=lr_scheduler)


# -- helpers ---------------------------------------------------------------------------------------
def _check_inputs(model: Any, optimizer: Any, loss_fn: Any, lr_scheduler: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__}: expected an nn.Module (e.g. your DDP-wrapped model)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer, "
            "e.g. torch.optim.AdamW(model.parameters())"
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn={loss_fn!r} is not callable: pass a function (output, target) -> scalar loss, "
            "e.g. torch.nn.functional.cross_entropy"
        )
    model_params = {id(p) for p in model.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(
            f"optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(shapes {shapes}{', ...' if len(foreign) > 3 else ''}): build the optimizer from "
            "model.parameters() of the same model passed to train_step"
        )
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            f"lr_scheduler={type(lr_scheduler).__name__} does not drive this optimizer: "
            "create it from the optimizer passed to train_step"
        )


def _compile_model(model: nn.Module, config: TrainStepConfig) -> Any:
    # Imported here, not at module import: compile_core/__init__ imports this module.
    from compile_core.api import compile as compile_model

    return compile_model(model, backend=config.backend, ddp=config.ddp, **dict(config.compile_kwargs))


def _last_lr_as_floats(scheduler: Any) -> None:
    # The scheduler records the (now tensor) LRs it set; get_last_lr() and its state_dict should keep
    # giving floats. Our tensors live on the CPU, so .item() reads host memory and never waits on a GPU.
    last = getattr(scheduler, "_last_lr", None)
    if isinstance(last, list) and any(isinstance(v, torch.Tensor) for v in last):
        scheduler._last_lr = [_to_float(v) for v in last]


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _split_args(args: tuple[Any, ...], target: Any) -> tuple[tuple[Any, ...], Any]:
    if target is not None:
        if not args:
            raise TypeError("step(*inputs, target): no inputs given")
        return args, target
    if len(args) < 2:
        raise TypeError(
            f"step(*inputs, target): got {len(args)} positional argument(s); pass the model inputs "
            "followed by the target, e.g. step(x, y) or step(x, target=y)"
        )
    return args[:-1], args[-1]


def _describe(err: BaseException) -> str:
    """`Type: first line`, plus the root cause (Dynamo wraps backend errors in BackendCompilerFailed)."""
    root, seen = err, {id(err)}
    while True:
        nxt = getattr(root, "inner_exception", None) or root.__cause__
        if nxt is None or id(nxt) in seen:
            break
        root = nxt
        seen.add(id(root))

    def one(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip()

    return one(err) if root is err else f"{one(err)} caused by {one(root)}"


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn returned {shape}: expected a scalar tensor; reduce it (e.g. .mean()) "
            "or use a loss with reduction='mean'"
        )
