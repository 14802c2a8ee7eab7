"""Public API: `compile` (a DDP model through bucket-aligned pieces) and `train_step`.

See DESIGN.md for the contract; `CompiledModel.report()` returns a `CompileReport`.
"""
from compile_core.api import CompiledModel, compile
from compile_core.config import BACKENDS, DDP_MODES, CompileConfig
from compile_core.report import CompileReport

try:  # the train step lives in its own module (compile_core/train_step.py)
    from compile_core.train_step import TrainStep, train_step
except ImportError as _exc:  # pragma: no cover - only while that module is missing
    if "compile_core.train_step" not in str(_exc):
        raise

__all__ = ["BACKENDS", "DDP_MODES", "CompileConfig", "CompileReport", "CompiledModel", "compile", "train_step", "TrainStep"]
