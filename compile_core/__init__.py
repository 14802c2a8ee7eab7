"""Public API: `compile` (a DDP model through bucket-aligned pieces) and `train_step`.

See docs/design.md for the contract: `compile` compiles the model in place and returns it, with `report()`
(a `CompileReport`) and `compile_state` added; `isinstance(model, CompiledModel)` tells a compiled model.
The train step lives in `compile_core.step` (a module name the `train_step` function cannot shadow).
"""

from compile_core.api import CompileState, compile
from compile_core.config import BACKENDS, DDP_MODES, CompileConfig
from compile_core.in_place import CompiledModel
from compile_core.report import CompileReport
from compile_core.step import TrainStep, train_step

__all__ = [
    "BACKENDS",
    "DDP_MODES",
    "CompileConfig",
    "CompileReport",
    "CompiledModel",
    "CompileState",
    "compile",
    "train_step",
    "TrainStep",
]
