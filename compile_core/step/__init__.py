"""`compile_core.train_step`: one compiled training step per micro-batch (see `train.py`'s Note).

* `train.py` -- `train_step`, `TrainStep`: forward + loss, backward, accumulation, the update;
* `config.py`, `report.py`, `checks.py` -- its configuration, report and input checks;
* `update.py` -- the optimizer update after the backward compiled whole, and its capture check;
* `chunked_update.py` -- the same update compiled once per repeated block (SGD, Adam, AdamW);
* `chunk_math.py` -- the function a chunk's update runs, and its arguments;
* `stand_ins.py` -- copies and torch-made optimizer state, to compile the update before update 1;
* `optim_math.py` -- SGD/Adam/AdamW math per parameter, with host-computed scalars; `StateWatch`;
* `in_backward.py` -- the update inside the compiled backward (`optimizer_in_backward=True`);
* `in_backward_controller.py` -- when the update runs there, and why not (stops, pauses, restarts);
* `hyperparams.py` -- lr/betas as tensors while a whole `optimizer.step()` runs compiled.
"""

from compile_core.step.config import TrainStepConfig
from compile_core.step.report import OptimizerReport, TrainStepReport
from compile_core.step.train import TrainStep, train_step

__all__ = ["OptimizerReport", "TrainStep", "TrainStepConfig", "TrainStepReport", "train_step"]
