"""`compile(trainer, ...)`: compile_core for the model a Hugging Face `transformers.Trainer` trains (needs the
[transformers] extra: transformers and accelerate).

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)  # torch_compile left False
    compiled = compile_core.integrations.transformers.compile(trainer, backend="inductor", ddp="split")
    trainer.train()
    print(compiled.report())

The Trainer wraps the model in DistributedDataParallel (through accelerate) inside `train()`, and no user
code runs between that and the first step except the callbacks. So `compile` adds a callback to the trainer
(`TrainerCompile`) whose `on_train_begin` compiles the wrapped model (`trainer.model_wrapped`) in place with
`compile_core.integrations.accelerate.compile`: the Trainer's own loop then runs the compiled model, and
everything else stays the Trainer's (accumulation under `no_sync`, clipping, the optimizer and scheduler it
builds, checkpoints, whose keys are unchanged). Evaluation runs the unwrapped model eagerly, as the Trainer
does (it does not evaluate through DDP). A second `train()` keeps the compiled model; a Trainer that wraps a
new one later (`auto_find_batch_size`, after running out of memory) gets that one compiled (untested: it needs
a GPU running out of memory). One process: the model itself is compiled in place.
The report is logged (INFO, logger `compile_core.integrations.transformers`, rank 0) after the first step.

Refused, with the fix named: `TrainingArguments(torch_compile=True)` or an accelerate dynamo backend (either
compiles DDP's own forward around ours), FSDP and DeepSpeed (not DDP).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import compile_core
from compile_core.config import CompileConfig
from compile_core.integrations.common import FirstStepLog, as_compile_config, compile_kwargs, missing_extra
from compile_core.report import CompileReport

try:
    from transformers import Trainer, TrainerCallback

    import compile_core.integrations.accelerate as accelerate_integration
except ImportError as err:  # pragma: no cover - exercised by a test that hides transformers
    raise missing_extra("transformers", err) from err

__all__ = ["TrainerCompile", "compile"]

log = logging.getLogger(__name__)


class TrainerCompile(TrainerCallback):
    """The callback `compile` adds: compiles the Trainer's wrapped model when training begins (module doc)."""

    def __init__(self, trainer: Trainer, config: CompileConfig) -> None:
        self.config = config
        # The trainer holds this callback; a weak reference back keeps the two out of a reference cycle.
        self._trainer = weakref.ref(trainer)
        self._compiled: compile_core.CompiledModel | None = None
        self._first_step = FirstStepLog(log, "transformers.Trainer")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None:  # pragma: no cover - the Trainer calling us is alive
            return
        wrapped = trainer.model_wrapped
        if wrapped is self._compiled:  # a second train(): the Trainer kept its wrapped model
            return
        if self._compiled is not None:
            log.info("compile_core: the Trainer wrapped a new model (%s); compiling it", type(wrapped).__name__)
        self._compiled = accelerate_integration.compile(trainer.accelerator, wrapped, **compile_kwargs(self.config))
        self._first_step = FirstStepLog(log, "transformers.Trainer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._compiled is not None:
            self._first_step.step_done(self._compiled.report(), global_rank=args.process_index)

    @property
    def model(self) -> compile_core.CompiledModel | None:
        """The Trainer's wrapped model, compiled in place (None before `trainer.train()` begins)."""
        return self._compiled

    def report(self) -> CompileReport:
        """The compile report of the model the Trainer trains (from its first training step on)."""
        if self._compiled is None:
            raise RuntimeError("no model compiled yet: trainer.train() compiles the model it wraps when it begins")
        return self._compiled.report()


def compile(trainer: Trainer, **options: Any) -> TrainerCompile:
    """Have `trainer.train()` run its model compiled by `compile_core.compile(**options)` (see the module doc);
    returns the callback added to `trainer`, whose `report()` holds the compile report."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    config = as_compile_config(options, argument="compile_core.integrations.transformers.compile(...)")
    if trainer.args.torch_compile:
        raise ValueError(
            "TrainingArguments(torch_compile=True) makes the Trainer torch.compile the DDP wrapper itself, "
            "around DDP's own forward; set torch_compile=False so that compile_core compiles the model"
        )
    accelerate_integration.refuse_self_compiling(
        trainer.accelerator, fix="unset ACCELERATE_DYNAMO_BACKEND (or the accelerate config's dynamo backend)"
    )
    for flag, name in (("is_fsdp_enabled", "FSDP"), ("is_deepspeed_enabled", "DeepSpeed")):
        if getattr(trainer, flag, False):
            raise ValueError(
                f"the Trainer is set up for {name}; compile_core compiles DistributedDataParallel models only: "
                f"drop the {name} arguments (the Trainer then uses DDP on several processes)"
            )
    if any(isinstance(cb, TrainerCompile) for cb in trainer.callback_handler.callbacks):
        raise ValueError(
            "this Trainer already has a compile_core callback (compile was called on it before); call compile "
            "once per Trainer, or trainer.remove_callback(TrainerCompile) first"
        )
    callback = TrainerCompile(trainer, config)
    trainer.add_callback(callback)
    return callback
