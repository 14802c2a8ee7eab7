"""Lightning strategies that hand the DDP model to `compile_core.compile` (needs the [lightning] extra).

    Trainer(strategy=DDPCompileStrategy(compile_config={"backend": "inductor", "ddp": "split"}),
            accelerator="cpu", devices=2)
    Fabric(strategy=FabricDDPCompileStrategy(compile_config=...), accelerator="cpu", devices=2)

Both subclass Lightning's own DDP strategies, so launching, process groups, samplers, DDP keyword
arguments (`bucket_cap_mb=`, `find_unused_parameters=`, ...) and checkpoints are Lightning's. What
changes is the model: after DDP wraps it, `compile_core.compile` compiles it with `compile_config`.

Trainer: Lightning runs `training_step` through DDP's forward (so DDP's reducer sees the step). Here
DDP wraps a `TrainingStepModule`, whose forward is the LightningModule's `training_step` and which
holds the LightningModule's submodules, parameters and buffers under their own names. The compiled
region is therefore `training_step` with every `self(...)` inside it (as with Lightning's own
`torch.compile` switch), while DDP's bookkeeping stays eager. Validation, test and predict steps run
the LightningModule eagerly, outside DDP. Manual optimization is refused.

Fabric: DDP wraps the module itself; `model(x)` runs its compiled forward.

The report: `strategy.compile_report()`; it is also logged (INFO, logger
`compile_core.integrations.lightning`, rank 0) once, when the first optimizer step is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import compile_core
from compile_core.config import CompileConfig
from compile_core.integrations.common import (
    FirstStepLog,
    as_compile_config,
    compile_kwargs,
    missing_extra,
)
from compile_core.report import CompileReport

try:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as err:  # pragma: no cover - exercised by a test that hides lightning
    raise missing_extra("lightning", err) from err

__all__ = ["DDPCompileStrategy", "FabricDDPCompileStrategy", "TrainingStepModule"]

log = logging.getLogger(__name__)

CompileOptions = CompileConfig | Mapping[str, Any] | None


class TrainingStepModule(torch.nn.Module):
    """What DDP wraps under `DDPCompileStrategy`: a LightningModule's parts, with `training_step` as forward."""

    def __init__(self, lightning_module: pl.LightningModule) -> None:
        super().__init__()
        # Kept out of the module tree: as a child, every parameter would be renamed
        # "lightning_module.<name>" in DDP and in the report. Its children, own parameters and own
        # buffers are registered here instead, under their own names (the same tensors).
        self.__dict__["lightning_module"] = lightning_module
        for name, child in lightning_module.named_children():
            self.add_module(name, child)
        for name, param in lightning_module.named_parameters(recurse=False):
            self.register_parameter(name, param)
        persistent = {k for k in lightning_module.state_dict(keep_vars=True) if "." not in k}
        for name, buf in lightning_module.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name in persistent)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.lightning_module.training_step(*args, **kwargs)

    def train(self, mode: bool = True) -> TrainingStepModule:
        # Lightning's loops switch train/eval through `trainer.model` (DDP around this module): the
        # LightningModule's own flag must follow, not only the submodules it shares with us.
        super().train(mode)
        self.lightning_module.train(mode)
        return self


def _refuse_torch_compiled(module: torch.nn.Module) -> None:
    # Mirrors lightning/pytorch/utilities/compile.py: `trainer.fit(torch.compile(model))` unwraps the
    # OptimizedModule and records the compile in the LightningModule's `_compiler_ctx` (its step
    # methods would then be compiled by Dynamo twice, inside our compiled region). The one Lightning
    # private attribute this module reads; tests/single/test_integrations.py has its canary.
    if getattr(module, "_compiler_ctx", None) is not None:
        raise ValueError(
            f"{type(module).__name__} was passed to the Trainer through torch.compile(...): "
            "DDPCompileStrategy compiles the model itself; pass the uncompiled LightningModule"
        )


class DDPCompileStrategy(DDPStrategy):
    """Lightning's `ddp` strategy, with the DDP model compiled by `compile_core.compile`."""

    def __init__(self, *, compile_config: CompileOptions = None, **kwargs: Any) -> None:
        """`compile_config`: options of `compile_core.compile` (a `CompileConfig` or a dict); every other
        keyword goes to Lightning's `DDPStrategy` (and from there to DDP)."""
        self.compile_config = as_compile_config(compile_config, argument="DDPCompileStrategy(compile_config=...)")
        super().__init__(**kwargs)
        self._compiled: compile_core.CompiledModel | None = None
        self._first_step: FirstStepLog | None = None

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Lightning's private hook: `DDPStrategy.configure_ddp` (lightning/pytorch/strategies/ddp.py)
        # sets `self.model = self._setup_model(self.model)` when fitting, after layer sync and moving
        # the model to its device. Overriding it keeps the rest of configure_ddp (comm hooks) Lightning's.
        # Canary: tests/single/test_integrations.py.
        if not isinstance(model, pl.LightningModule):
            raise TypeError(f"DDPCompileStrategy needs a LightningModule, got {type(model).__name__}")
        _refuse_torch_compiled(model)
        if not model.automatic_optimization:
            raise ValueError(
                f"{type(model).__name__} uses manual optimization (automatic_optimization=False), which "
                "DDPCompileStrategy does not support; use strategy='ddp', or automatic optimization"
            )
        ddp_model = super()._setup_model(TrainingStepModule(model))
        self._compiled = compile_core.compile(ddp_model, **compile_kwargs(self.compile_config))
        self._first_step = FirstStepLog(log, type(self).__name__)
        return ddp_model

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            raise RuntimeError("DDPCompileStrategy.training_step ran before the strategy set up the model")
        with self.precision_plugin.train_step_context():
            return self._compiled(*args, **kwargs)  # DDP's forward, then the compiled training_step

    # Evaluation: eager, on the LightningModule itself (no gradients to reduce, no compile to pay).
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._first_step is not None and self._compiled is not None:
            self._first_step.step_done(self._compiled.report(), global_rank=self.global_rank)
        return out

    @property
    def compiled_model(self) -> compile_core.CompiledModel | None:
        """The DDP model of the latest fit, compiled in place (None before the first fit sets the model up)."""
        return self._compiled

    def compile_report(self) -> CompileReport:
        """The compile report of the model this strategy compiled (from the first training step on)."""
        if self._compiled is None:
            raise RuntimeError(
                "no model compiled yet: compile_report() works once trainer.fit(...) has set up the model"
            )
        return self._compiled.report()


class FabricDDPCompileStrategy(FabricDDPStrategy):
    """Fabric's `ddp` strategy, with each module it sets up compiled by `compile_core.compile`."""

    def __init__(self, *, compile_config: CompileOptions = None, **kwargs: Any) -> None:
        """`compile_config`: options of `compile_core.compile` (a `CompileConfig` or a dict); every other
        keyword goes to Fabric's `DDPStrategy` (and from there to DDP)."""
        self.compile_config = as_compile_config(compile_config, argument="FabricDDPCompileStrategy(compile_config=...)")
        super().__init__(**kwargs)
        self._compiled: list[compile_core.CompiledModel] = []
        self._first_step = FirstStepLog(log, type(self).__name__)

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        ddp_model = super().setup_module(module)
        self._compiled.append(compile_core.compile(ddp_model, **compile_kwargs(self.compile_config)))
        return ddp_model

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        if self._compiled:
            self._first_step.step_done(self._compiled[-1].report(), global_rank=self.global_rank)
        return out

    @property
    def compiled_models(self) -> list[compile_core.CompiledModel]:
        """Each DDP model set up through `fabric.setup`, compiled in place, in order."""
        return list(self._compiled)

    def compile_report(self) -> CompileReport:
        """The compile report of the module set up last (see `compiled_models` for the others)."""
        if not self._compiled:
            raise RuntimeError("no module compiled yet: compile_report() works once fabric.setup(model, ...) has run")
        return self._compiled[-1].report()
