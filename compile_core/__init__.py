"""Public API: `compile` (a DDP model through bucket-aligned pieces) and `train_step`.

See docs/design.md for the contract; `CompiledModel.report()` returns a `CompileReport`.
The train step lives in `compile_core.step` (a module name the `train_step` function cannot shadow).
"""

from compile_core.api import CompiledModel, compile
from compile_core.config import BACKENDS, DDP_MODES, CompileConfig
from compile_core.report import CompileReport
from compile_core.step import TrainStep, train_step

__all__ = [
    "BACKENDS",
    "DDP_MODES",
    "CompileConfig",
    "CompileReport",
    "CompiledModel",
    "compile",
    "train_step",
    "TrainStep",
]
