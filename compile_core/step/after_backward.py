"""The update paths that run after the backward: compiled (`CompiledPath`), eager (`EagerPath`), torch's fused
step (`FusedStepPath`: the user's `fused=True`, or a multi-tensor SGD/Adam/AdamW run fused, compile_core/step/fused.py),
with a GradScaler (`ScalerPath`). Each is an `UpdatePath` (compile_core/step/update_path.py).

`CompiledPath` compiles clip + step at its first update, per repeated block (`ChunkedUpdate`, for SGD,
Adam and AdamW) or as one `optimizer.step()` (`CompiledUpdate`, any optimizer; the hyperparameters pinned
as tensors, compile_core/step/hyperparams.py), and builds it again when the param groups change. "Compiled"
is checked, not assumed (see train.py's Note): when the compile fails, or Dynamo captured no graph that
updates the parameters, the path hands over to an `EagerPath` for good and the report keeps the reason.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from aot.torch_dynamo import DynamoError, cause_chain
from compile_core.reuse.compile_once import job_rank
from compile_core.step.chunked_update import ChunkedUpdate
from compile_core.step.fused import FusedWhileStepping
from compile_core.step.update import CompiledUpdate, chunking_blocker, clip_and_step
from compile_core.step.update_path import NOT_IN_BACKWARD, EagerMicroBatch, UpdateContext, optimizer_report
from inductor.torch_inductor import disk_caches_enabled

logger = logging.getLogger(__name__)

UPDATE_OFFER = "optimizer update (ahead of update 1)"
"""The name of the offer `CompiledPath` makes to the model's `IdleWork` (compile_core/reuse/idle_work.py)."""


class EagerPath:
    """clip + `optimizer.step()`, eagerly; `reason`: why not compiled (the report's `fallback_error`)."""

    def __init__(self, ctx: UpdateContext, reason: str) -> None:
        self.ctx = ctx
        self.reason = reason

    def before_forward(self, index: int, *, sync: bool, first: bool) -> EagerMicroBatch | None:
        return None

    def apply(self, index: int) -> torch.Tensor | None:
        return clip_and_step(self.ctx.params, self.ctx.config.clip_grad_norm, self.ctx.optimizer)()

    def mode(self) -> str:
        return "eager"

    def params_changed(self) -> None:
        pass

    def report_fields(self) -> dict[str, Any]:
        return {"optimizer": optimizer_report(self.ctx, fallback=self.reason), "optimizer_in_backward": NOT_IN_BACKWARD}


class FusedStepPath(EagerPath):
    """clip + torch's fused `optimizer.step()`, uncompiled by choice (`reason`: `fused_step`'s, or
    `fused_instead`'s with `while_stepping` setting the groups to fused while the step runs)."""

    def __init__(self, ctx: UpdateContext, reason: str, while_stepping: FusedWhileStepping | None = None) -> None:
        super().__init__(ctx, reason)
        self._while_stepping = while_stepping

    def apply(self, index: int) -> torch.Tensor | None:
        if self._while_stepping is None:
            return super().apply(index)
        with self._while_stepping.applied():
            return super().apply(index)

    def mode(self) -> str:
        return "eager (fused)"

    def report_fields(self) -> dict[str, Any]:
        report = optimizer_report(self.ctx, fallback=None, as_is=self.reason)
        return {"optimizer": report, "optimizer_in_backward": NOT_IN_BACKWARD}


class ScalerPath(EagerPath):
    """With a GradScaler: unscale (when clipping), clip, `grad_scaler.step(optimizer)`, `update()`, eagerly."""

    def __init__(self, ctx: UpdateContext) -> None:
        super().__init__(
            ctx,
            "a GradScaler skips updates whose gradients hold inf/nan, which needs a host "
            "check per update: grad_scaler.step(optimizer) runs eagerly",
        )

    def apply(self, index: int) -> torch.Tensor | None:
        ctx, norm = self.ctx, None
        if ctx.config.clip_grad_norm is not None:
            ctx.grad_scaler.unscale_(ctx.optimizer)  # clip the true gradients, as torch's AMP recipe does
            norm = torch.nn.utils.clip_grad_norm_(ctx.params, ctx.config.clip_grad_norm)
        ctx.grad_scaler.step(ctx.optimizer)
        ctx.grad_scaler.update()
        return norm


class CompiledPath:
    """clip + step after the backward, compiled (see the module docstring)."""

    def __init__(self, ctx: UpdateContext) -> None:
        self.ctx = ctx
        self._engine: CompiledUpdate | ChunkedUpdate | None = None  # built at the first update (or offer)
        self._whole_step_reason: str | None = None  # why the update is not compiled per block
        self._eager: EagerPath | None = None  # what it handed over to, once compiling failed

    def before_forward(self, index: int, *, sync: bool, first: bool) -> EagerMicroBatch | None:
        if first:
            self._offer_compile()
        return None

    def apply(self, index: int) -> torch.Tensor | None:
        self.ctx.compiled.idle_work.withdraw(UPDATE_OFFER)  # not taken by a wait: update 1 compiles it
        if self._eager is not None:
            return self._eager.apply(index)
        if self._engine is None:
            self._engine = self._build()
        try:
            with self.ctx.pins.applied():
                norm = self._engine(index)
        except DynamoError as err:
            # Dynamo/backend could not capture or compile the update; nothing of the failing
            # graph ran. Other exceptions come from running the update and would recur eagerly.
            return self._hand_over(_describe(err)).apply(index)
        failure = getattr(self._engine, "failure", None)
        if failure is not None:  # update 1 was applied; only its compile failed
            self._hand_over(_describe(failure))
        elif index == 1:
            self._check_captured()
        return norm

    def mode(self) -> str:
        return "compiled" if self._eager is None else "eager"

    def params_changed(self) -> None:
        """A param group added since the update was built: it is built again at the next update."""
        if self._engine is None:
            return
        logger.info(
            "train_step: the optimizer now has %d param group(s) and %d parameter(s); its update is built again",
            len(self.ctx.optimizer.param_groups),
            len(self.ctx.params),
        )
        self._engine = None
        self.ctx.pins.uninstall()

    def report_fields(self) -> dict[str, Any]:
        report = optimizer_report(
            self.ctx,
            fallback=None if self._eager is None else self._eager.reason,
            per_block=isinstance(self._engine, ChunkedUpdate),
            whole_step_reason=self._whole_step_reason,
            graph_compiles=getattr(self._engine, "records", []),
        )
        return {"optimizer": report, "optimizer_in_backward": NOT_IN_BACKWARD}

    def _offer_compile(self) -> None:
        """One-graph jobs (`ddp="in_graph"`): one rank compiles the model and the others wait for it; a rank
        about to wait compiles the optimizer update meanwhile, on stand-ins (`compile_core/reuse/idle_work.py`,
        `ChunkedUpdate.compile_ahead`). Withdrawn at update 1 if no wait took it."""
        ctx = self.ctx
        if ctx.config.ddp != "in_graph" or job_rank()[1] < 2:
            return
        if chunking_blocker(ctx.optimizer) is not None:
            return  # a whole `optimizer.step()` is compiled at update 1, as before (its pins installed then)
        if self._engine is None and self._eager is None:
            self._engine = self._build()
        engine = self._engine
        if isinstance(engine, ChunkedUpdate) and engine.shares_compiles:

            def compile_ahead() -> None:
                with ctx.pins.applied():
                    engine.compile_ahead()

            ctx.compiled.idle_work.offer(UPDATE_OFFER, compile_ahead)

    def _build(self) -> CompiledUpdate | ChunkedUpdate:
        ctx = self.ctx
        blocker = chunking_blocker(ctx.optimizer)
        if ctx.config.compile_kwargs.get("reuse_pieces", True) is False:
            blocker = "reuse_pieces=False"
        if blocker is None:
            names = {id(p): n for n, p in ctx.model.named_parameters()}
            return ChunkedUpdate(
                ctx.optimizer,
                names,
                ctx.config.backend,
                ctx.events,
                clip_max_norm=ctx.config.clip_grad_norm,
                claims=ctx.config.backend == "inductor" and disk_caches_enabled(),
            )
        self._whole_step_reason = blocker
        ctx.pins.install()  # optimizer.step() compiled whole reads lr/betas from the groups
        update = clip_and_step(ctx.params, ctx.config.clip_grad_norm, ctx.optimizer)
        return CompiledUpdate(update, ctx.config.backend, ctx.events)

    def _check_captured(self) -> None:
        """After the first update: if Dynamo ran the whole update eagerly, say so and stop trying."""
        assert self._engine is not None
        params = self.ctx.params
        missing = self._engine.uncaptured(params)
        if len(missing) < len(params):
            return  # compiled (partly, at worst: the graph breaks are in the report)
        breaks = "; ".join(b["reason"] for b in self.ctx.events.graph_breaks) or "no graph break reported"
        self._hand_over(f"Dynamo captured no graph that updates the parameters ({breaks})")

    def _hand_over(self, message: str) -> EagerPath:
        logger.warning("train_step: optimizer update could not be compiled, running eagerly: %s", message)
        self._eager = EagerPath(self.ctx, message)
        self._engine = None
        self.ctx.pins.uninstall()
        return self._eager


def _describe(err: BaseException) -> str:
    """`Type: first line`, plus the root cause (Dynamo wraps backend errors in BackendCompilerFailed)."""
    root = cause_chain(err)[-1]

    def one(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip()

    return one(err) if root is err else f"{one(err)} caused by {one(root)}"
