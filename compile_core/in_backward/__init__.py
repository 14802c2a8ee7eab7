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
    clipping, static_graph or a `reduce_dtype=` wire, which DDP's reducer would not use), which creates
    the optimizer's state exactly as torch does and compiles nothing: a compiled update 1 needed a
    backward variant of its own (reduce without update) for that single step. Before its backward the
    autograd graph is read for parameters that get gradients from outside the model's outputs
    (`ddp/in_graph/probe.py: eager_outside_producers`); the compiled backward leaves those to the normal
    step. With clipping, static_graph or `reduce_dtype=`, update 1 is compiled (reduce only) and shows
    how the model compiles.
  * From update 2 the compiled backward applies each bucket's update right after its all-reduce lands
    (splice.py, placed by the in-graph graph pass through its hook), on the optimizer's own state
    tensors, updated in place, so `optimizer.state_dict()` is what an eager run gives. The update is
    chosen per parameter when the backward compiles (`OptimizerInBackward.update_for`):
      - A contiguous fp32/fp64 parameter on a device with torch's fused kernels (bf16/fp16 too with
        Inductor, which compiles their update graph into kernels that round once, as the fused kernel does,
        or in a group whose own step is that kernel, `fused=True`): torch's fused kernel
        (`aten._fused_sgd_`/`_fused_adam_`/`_fused_adamw_`, the overloads that read `lr` as a tensor),
        one call per bucket, param group and dtype. Nothing of the update is compiled (the backward
        compiles as in-graph's does) and a bucket updates in a launch or a few. The kernel takes betas,
        weight decay and eps (SGD: momentum, dampening, weight decay) as numbers, constants of the compiled
        graph: a group whose values moved between update 1 and the compile (OneCycleLR's beta1 or
        momentum) takes the graph below instead, and a later change of one
        (a weight decay schedule that starts at update 3) moves its group to that graph for good, at the
        cost of one more compile of the model (the hook's `generation`, a hooked variant of its own:
        ddp/in_graph/variants.py), not one per change.
      - Otherwise (a strided parameter; a bf16/fp16 one of a group that is not `fused=True` under a backend
        that runs the graph op by op, rounding per op as eager's step does; values a schedule moves): the
        update math of
        compile_core/step/optim_math.py (torch's single-tensor step, with its step-dependent scalars
        computed on the host and passed in as one small vector) captured once per param group and
        dtype/device, on one small throwaway parameter, as an aten graph whose only in-place ops are the
        final copies into the parameter and the state (`aot.torch_dynamo.capture_functional`). The math
        is elementwise, so one graph serves every shape; it is spliced in per parameter, so Inductor
        fuses the updates of a bucket with each other and with the gradient's last kernels. On an H100
        (session 43) that backward held 5940 ops against in-graph's 1768 and took 122 s to compile.
    Both read one table of scalars per param group and device, a row per parameter, computed before
    the forward (lr, betas, momentum, weight decay and the step count this update reaches are values,
    so schedules never recompile the graph; the fused kernel reads the row's lr and step count). Each
    extra graph input costs host time at every call (a producer, a size check, AOTAutograd's wrapper: on
    an H100 the in-backward step spent 13 ms before its first kernel, where the in-graph step spent 2),
    hence one table, not a row per parameter; the step counts themselves are no inputs at all: the host
    advances them after the backward (`advance_steps`, one foreach add), as torch's step would have.

Notes: only SGD, Adam and AdamW (exactly these classes, any of their options, foreach and fused
included) are done in the backward; any other optimizer keeps the normal path and the report says why.
With graph breaks, only a graph that does not end at a break updates inside its backward, and only the
parameters it is the sole gradient producer of: not one that a graph run before it in the forward takes
too, nor one that update 1's eager step took in more ops than the graph holds (a layer called on both
sides of a break, as tied embeddings are, also where a submodule's frame compiles on its own and its
caller's graph follows: its gradient is the sum of both backwards; ddp/in_graph/probe.py, Note
[Counting a parameter's uses]). One graph that Dynamo runs for several blocks' parameters (a break in the
loop over the blocks makes it skip the loop's frame and compile each layer's frame once) can only update the
parameters it was compiled for: each other block's run gets the graph compiled with its own update
(ddp/in_graph/dispatch.py); where it cannot be compiled again (dynamic shapes, CUDA graphs) those runs go
uncompiled and the updates leave the backward after that update (ddp/in_graph/hooked_runs.py). Each
bucket's update comes after every read of its parameters by the backward, through views
(`addmm(g, t(weight))`), and its wait is pinned there: the gradient a graph returns for its input reads the
weights and nothing after it needs it soon, so Inductor had scheduled it after the update. A parameter
the backward does not update (reduced after the backward because something outside the graph adds
to its gradient, ignored by DDP, or without optimizer state yet because it had no gradient so far)
keeps its gradient and is updated by the normal `optimizer.step()` right after the backward, in the same
step: torch skips the parameters whose gradient is None, i.e. those already updated. With
clipping, every gradient must be inside the graph (the global norm is taken there), else the whole
update stays on the normal path. Only structural options are baked into the captured graph
(momentum on/off, nesterov, maximize, amsgrad, and whether beta1 is above 0.5, which picks `lerp`'s
formula for the first moment): changing one switches back to the normal path, with the reason.
Weight decay is always in the graph (0 decays by exactly nothing), so it may change freely there (not
under the fused kernel, above).

Debugging: `TrainStep.report()` has an `optimizer_in_backward` entry (active, reason, from which
update, `fused_kernel_groups`: the param groups torch's fused kernel updates, `update_graph_groups`: the
(group, dtype, device) on the per-parameter update graph, with their parameter counts,
`recompiled_for_changed_constants`: which of its constants moved, before which update); `TORCH_LOGS=output_code`
shows the update kernels (or the fused kernel's calls) between the backward's kernels.
"""

from compile_core.in_backward.controller import InBackwardController
from compile_core.in_backward.optimizer import OptimizerInBackward
from compile_core.in_backward.path import InBackwardPath

__all__ = ["InBackwardController", "InBackwardPath", "OptimizerInBackward"]
