"""`compile_core.train_step`: one compiled training step per micro-batch (see `train.py`'s Note).

* `train.py` -- `train_step`, `TrainStep`: forward + loss, backward, accumulation, one update object
  (`make_update_path` chooses it);
* `accumulation.py` -- accumulated `.grad` kept out of the CUDA graphs' memory pool (`GradsOutOfGraphPool`);
* `update_path.py` -- `UpdatePath`, the one interface of the update, and `UpdateContext`, what it works with;
* `after_backward.py` -- the paths after the backward: compiled (`CompiledPath`, handing over to
  `EagerPath` when its compile fails), eager, torch's fused step (`FusedStepPath`), GradScaler (`ScalerPath`);
* `config.py`, `report.py`, `checks.py` -- its configuration, report and input checks;
* `update.py` -- the optimizer update after the backward compiled whole, and its capture check;
* `fused.py` -- a multi-tensor SGD/Adam/AdamW step run as torch's fused step instead (nothing to compile);
* `chunked_update.py` -- the same update compiled once per repeated block (SGD, Adam, AdamW);
* `chunk_plan.py` -- the chunks: each param group cut per repeated block;
* `chunk_math.py` -- the function a chunk's update runs, and its arguments;
* `stand_ins.py` -- copies and torch-made optimizer state, to compile the update before update 1;
* `optim_math.py` -- SGD/Adam/AdamW math per parameter, with host-computed scalars; `StateWatch`;
* `hyperparams.py` -- lr/betas as tensors while a whole `optimizer.step()` runs compiled.

The update inside the compiled backward (`optimizer_in_backward=True`) is its own package,
compile_core/in_backward/.
"""

from compile_core.step.config import TrainStepConfig
from compile_core.step.report import OptimizerReport, TrainStepReport
from compile_core.step.train import TrainStep, train_step

__all__ = ["OptimizerReport", "TrainStep", "TrainStepConfig", "TrainStepReport", "train_step"]
