"""How each benchmark mode builds its training step (runs inside a rank process).

Every builder gets the same DDP model and optimizer and returns a `Step`: `step(x, y)` runs forward, loss,
backward, optimizer step and zero_grad, and returns the loss (detached). `info()` reports what the mode
could tell about itself (graph pieces, the compile report, planned buckets). What a builder gets and returns is
in benchmarks/mode_context.py, PyTorch's builders in benchmarks/modes_torch.py, ours in benchmarks/modes_ours.py;
here are the optimizer and the Dynamo settings every mode of a run starts from, and the builders by name.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks import modes_ours, modes_torch
from benchmarks.mode_context import ModeContext, Step


def make_optimizer(name: str, params, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer every mode of a run uses (names and arguments: benchmarks.config.OPTIMIZERS)."""
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
    if name not in classes:
        raise ValueError(f"optimizer {name!r}: choose from {sorted(classes)}")
    return classes[name](params, **kwargs)


def configure_dynamo(mode: str) -> None:
    """Global Dynamo settings a mode needs; must run BEFORE DDP is constructed (DDP reads them in __init__)."""
    import torch._dynamo

    if mode == "torch_nosplit":
        torch._dynamo.config.optimize_ddp = False
    elif mode in ("torch_python_reducer", "torch_reducer_overlap"):
        torch._dynamo.config.optimize_ddp = "python_reducer"
        # torch 2.13 recommends the config flag over compiled_autograd._enable(): backward calls made
        # inside a torch.compile'd function are then traced by compiled autograd.
        torch._dynamo.config.compiled_autograd = True
    else:
        torch._dynamo.config.optimize_ddp = True


BUILDERS: dict[str, Callable[[ModeContext], Step]] = {
    "eager": modes_torch.build_eager,
    "torch_ddpopt": modes_torch.build_torch_ddpopt,
    "torch_nosplit": modes_torch.build_torch_nosplit,
    "torch_python_reducer": modes_torch.build_torch_python_reducer,
    "torch_savvy": modes_torch.build_torch_savvy,
    "torch_fused": modes_torch.build_torch_fused,
    "torch_reducer_overlap": modes_torch.build_torch_reducer_overlap,
    "torch_savvy_one_rank": modes_torch.build_torch_savvy_one_rank,
    "torch_savvy_megacache": modes_torch.build_torch_savvy_megacache,
    "ours_compile": modes_ours.build_ours_compile,
    "ours_in_graph": modes_ours.build_ours_in_graph,
    "ours_step": modes_ours.build_ours_step,
    "ours_step_in_graph": modes_ours.build_ours_step_in_graph,
    "ours_step_in_graph_auto": modes_ours.build_ours_step_in_graph_auto,
    "ours_step_in_backward": modes_ours.build_ours_step_in_backward,
    "ours_step_in_graph_unfused": modes_ours.build_ours_step_in_graph_unfused,
    "ours_step_in_backward_unfused": modes_ours.build_ours_step_in_backward_unfused,
    "ours_step_in_backward_cpp": modes_ours.build_ours_step_in_backward_cpp,
}
