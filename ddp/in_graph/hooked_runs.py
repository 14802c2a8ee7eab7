"""When a graph compiled with the step's hook (its backward updates its parameters) must run uncompiled.

Only for a graph that cannot be compiled again outside Dynamo's call (symbolic shapes, CUDA graphs: Note
[A graph per variant, where Dynamo does not guard], ddp/in_graph/dispatch.py); any other gets a compile of
its own for the run instead. Two runs of such a graph would apply updates that are not the step's
(`HookedRuns.may_run_compiled`):
  * a run with other parameters than those it was compiled for. Dynamo compiles one graph for the frame of
    every repeated block (or layer) when a graph break inside the block's loop makes it skip the loop's
    frame, and runs it for each block with that block's parameters; its backward would update them with
    the optimizer state of the first. That run is uncompiled, and the updates leave the backward after
    this step (`stop_reason`, read by the controller through `StepOutcome`);
  * a run in a step of another variant (the updates left the backward, or their hook changed): a frame
    compiled on its own below a skipped one never read the variant (`guard_variant_in` reads it in module
    pre-hooks, which then run outside the compiled frame), so Dynamo does not compile it again.
An uncompiled run's gradients are reduced after the backward (no graph covers them) and the normal
optimizer step updates them, as for a graph that fell back to eager.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

log = logging.getLogger(__name__)


class HookedRuns:
    """Per model: whether each run of a graph compiled with the step's hook may run compiled."""

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        """Why no synchronising step may have the hook again (None: nothing stops it)."""
        self._warned: set[str] = set()

    def may_run_compiled(
        self,
        name: str,
        *,
        compiled_in: str,
        variant: str,
        args: Sequence[object],
        compiled_for: Sequence[tuple[int, torch.Tensor]],
    ) -> bool:
        """Whether graph `name`, compiled in variant `compiled_in` for the parameters `compiled_for`
        ((input index, parameter)), may run compiled on `args` in a step of `variant`."""
        if variant != compiled_in:
            if name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "compile_core: ddp='in_graph': %s was compiled for %s and runs in a %s step (a frame compiled "
                    "on its own does not see the step's variant): it runs uncompiled from now on",
                    name,
                    compiled_in,
                    variant,
                )
            return False
        if all(args[i] is p for i, p in compiled_for):
            return True
        if self.stop_reason is None:
            self.stop_reason = (
                f"{name} runs for the parameters of several modules (a graph break inside a repeated block "
                "gives one graph for all of them); its backward can update only those it was compiled for"
            )
            log.warning("compile_core: ddp='in_graph': %s; the update goes after the backward", self.stop_reason)
        return False
