"""`train_step(..., ddp="in_graph", optimizer_in_backward=True)`: the optimizer update inside the compiled
backward, each bucket's parameters updated where its all-reduce lands.

* `path.py` -- `InBackwardPath`, the train step's update path (its eager update 1, the step after the
  backward for what the backward left), and why the update stays after the backward from the start;
* `controller.py` -- `InBackwardController`: when the update is inside the backward, paused or stopped, and why;
* `optimizer.py` -- `OptimizerInBackward`: which optimizers, their update captured as graphs, state and
  scalar rows per update;
* `graph_inputs.py` -- `UpdatesHook`, the hook the in-graph reducer is handed: each graph's extra inputs
  (state tensors, scalar rows, the norm);
* `splice.py` -- `SplicedUpdates`: each bucket's wait and its parameters' updates in the backward graph
  (pipelined, or all after the last wait with global-norm clipping).

The feature's whole contact with the in-graph reducer is ddp/in_graph/hooks.py (`begin_step`,
`step_outcome`, the hook); with the rest of the train step, `UpdatePath`
(compile_core/step/update_path.py), chosen in `make_update_path` (compile_core/step/train.py).

Note [Optimizer update inside the backward]
-------------------------------------------
Background: with `ddp="in_graph"` each gradient bucket is all-reduced inside the compiled
backward. The update of a bucket's parameters needs nothing else, so it can run right there,
while the rest of the backward still computes, and the bucket's gradients need never be stored.

Algorithm:
  * Update 1 runs as eager DDP (forward, backward with DDP's reducer, `optimizer.step()`; without
    clipping or static_graph), which creates the optimizer's state exactly as torch does and compiles
    nothing: a compiled update 1 needed a backward variant of its own (reduce without update) for that
    single step. Before its backward the autograd graph is read for parameters that get gradients from
    outside the model's outputs (`ddp/in_graph/probe.py: eager_outside_producers`); the compiled
    backward leaves those to the normal step. With clipping or static_graph, update 1 is compiled
    (reduce only) and shows how the model compiles.
  * Then, per param group and parameter dtype/device, the update math of compile_core/step/optim_math.py
    (torch's single-tensor SGD/Adam/AdamW step, with its step-dependent scalars computed on the host
    per parameter and passed in as one small vector) is captured once, on one small throwaway
    parameter, as an aten graph whose only in-place ops are the final copies into the parameter and
    the state (`aot.torch_dynamo.capture_functional`). The math is elementwise, so one graph serves
    every parameter shape of that group.
  * From update 2 the compiled backward applies that update right after its bucket's all-reduce lands
    (splice.py, placed by the in-graph graph pass through its hook): the graph is spliced in per
    parameter, so Inductor fuses the updates of a bucket with each other and with the gradient's last
    kernels, with that update's scalar vector (computed before the forward: lr, betas, momentum,
    weight decay and the step count are values, so schedules never recompile); the state tensors are
    the optimizer's own, updated in place, so `optimizer.state_dict()` is what an eager run gives.
    Each extra graph input costs host time at every call (a producer, a size check, AOTAutograd's
    wrapper: on an H100 the in-backward step spent 13 ms before its first kernel, where the in-graph
    step spent 2): the vectors of a param group and device come as one table, each parameter's
    update reading its row, and the step counts are no inputs at all: the host advances them after
    the backward (`advance_steps`, one foreach add), as torch's step would have.
    (On the CPU an opaque op per bucket used to call the math compiled once instead, to keep the C++
    compile of the update variant near the reduce variant's: a mechanism only the CPU bed used,
    removed; the update variant compiles longer there.)

Notes: only SGD, Adam and AdamW (exactly these classes, any of their options, foreach and fused
included) are done in the backward; any other optimizer, or a model that does not compile into a
single graph, keeps the normal path and the report says why. A parameter the backward does not
update (reduced after the backward because something outside the graph adds to its gradient,
ignored by DDP, or without optimizer state yet because it had no gradient so far) keeps its
gradient and is updated by the normal `optimizer.step()` right after the backward, in the same
step: torch skips the parameters whose gradient is None, i.e. those already updated. With
clipping, every gradient must be inside the graph (the global norm is taken there), else the whole
update stays on the normal path. Only structural options are baked into the captured graph
(momentum on/off, nesterov, maximize, amsgrad, and whether beta1 is above 0.5, which picks `lerp`'s
formula for the first moment): changing one switches back to the normal path, with the reason.
Weight decay is always in the graph (0 decays by exactly nothing), so it may change freely.

Debugging: `TrainStep.report()` has an `optimizer_in_backward` entry (active, reason, from which
update); `TORCH_LOGS=output_code` shows the update kernels between the backward's kernels.
"""

from compile_core.in_backward.controller import InBackwardController
from compile_core.in_backward.optimizer import OptimizerInBackward
from compile_core.in_backward.path import InBackwardPath

__all__ = ["InBackwardController", "InBackwardPath", "OptimizerInBackward"]
