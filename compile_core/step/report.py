"""What `TrainStep.report()` returns: the model's compile report plus the optimizer part."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class OptimizerReport:
    """What happened to the optimizer update (clip + optimizer.step)."""

    optimizer: str
    """Class name of the optimizer."""
    compiled: bool = True
    """False when the update runs eagerly: fallen back (see fallback_error) or by choice (see as_is)."""
    graphs: int = 0
    """Graphs handed to the backend for the update, over all compiles."""
    recompiles: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One {"reason", "update"} per compile after the first; "update" is the 1-based update index."""
    compile_seconds: float = 0.0
    """Wall time of the updates that compiled something (Dynamo tracing + backend)."""
    fallback_error: str | None = None
    """Why the update runs eagerly, or None."""
    graph_breaks: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """Graph breaks Dynamo reported while capturing the first update ({"reason"})."""
    per_block: bool = False
    """True: compiled per repeated block, one graph per distinct block (compile_core/step/chunked_update.py)."""
    whole_step_reason: str | None = None
    """Why the update is compiled as one `optimizer.step()` instead (None when per block)."""
    graph_compiles: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One per compiled or reused update graph: `name`, `cache`, `seconds`, `reused_from`, and (per block)
    `ahead`: compiled before update 1, on stand-ins, while this rank waited for another's compile."""
    as_is: str | None = None
    """Why the update is torch's own `optimizer.step()`, not compiled by choice (`fused=True`), or None."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "compiled": self.compiled,
            "graphs": self.graphs,
            "recompiles": [dict(r) for r in self.recompiles],
            "compile_seconds": round(self.compile_seconds, 4),
            "fallback_error": self.fallback_error,
            "graph_breaks": [dict(b) for b in self.graph_breaks],
            "per_block": self.per_block,
            "whole_step_reason": self.whole_step_reason,
            "graph_compiles": [{**r, "seconds": round(r["seconds"], 4)} for r in self.graph_compiles],
            "as_is": self.as_is,
        }


@dataclasses.dataclass
class TrainStepReport:
    """The model's compile report plus the optimizer part and the step counters."""

    model: Any
    """compile_core's CompileReport for forward/backward (None if the compiled model has no report)."""
    optimizer: OptimizerReport
    """The optimizer part."""
    backend: str
    """Backend name used for both parts."""
    accum_steps: int
    """Micro-batches per update."""
    micro_batches: int
    """Calls so far."""
    updates: int
    """Optimizer updates applied so far."""
    optimizer_in_backward: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"requested": False, "active": False}
    )
    """requested, active, from_update, updates_in_backward, clip (how), reason (why not)."""

    def _model_dict(self) -> dict[str, Any]:
        if self.model is None:
            return {"graphs": [], "graph_breaks": [], "recompiles": [], "fallbacks": [], "compile_seconds": 0.0}
        return dict(self.model.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the compile report's keys cover every part, "parts" splits them per part."""
        model = self._model_dict()
        opt = self.optimizer.to_dict()
        model_recompiles = [{**r, "part": "model"} for r in model.get("recompiles", [])]
        opt_recompiles = [{**r, "part": "optimizer"} for r in opt["recompiles"]]
        fallbacks = list(model.get("fallbacks", []))
        if opt["fallback_error"] is not None:
            fallbacks.append(
                {"piece": "optimizer.step", "from": self.backend, "to": "eager", "error": opt["fallback_error"]}
            )
        model_seconds = float(model.get("compile_seconds", 0.0))
        out = dict(model)
        out.update(
            recompiles=model_recompiles + opt_recompiles,
            fallbacks=fallbacks,
            compile_seconds=round(model_seconds + opt["compile_seconds"], 4),
            optimizer=opt,
            parts={
                "model": {"compile_seconds": round(model_seconds, 4), "recompiles": model_recompiles},
                "optimizer": {"compile_seconds": opt["compile_seconds"], "recompiles": opt_recompiles},
            },
            backend=self.backend,
            accum_steps=self.accum_steps,
            micro_batches=self.micro_batches,
            updates=self.updates,
            optimizer_in_backward=dict(self.optimizer_in_backward),
        )
        return out

    def __str__(self) -> str:
        d = self.to_dict()
        opt = d["optimizer"]
        status = "compiled" if opt["compiled"] else f"EAGER (fallback: {opt['fallback_error']})"
        if opt["as_is"] is not None:
            status = f"torch's own step ({opt['as_is']})"
        rows = [
            ("part", "compile s", "graphs", "recompiles"),
            (
                "model",
                f"{d['parts']['model']['compile_seconds']:.2f}",
                str(sum(int(g.get("pieces", 1)) for g in d.get("graphs", []))),
                str(len(d["parts"]["model"]["recompiles"])),
            ),
            ("optimizer", f"{opt['compile_seconds']:.2f}", str(opt["graphs"]), str(len(opt["recompiles"]))),
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"train_step: backend={self.backend} accum_steps={self.accum_steps} "
            f"micro_batches={self.micro_batches} updates={self.updates}"
        ]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        how = (
            "per block"
            if opt["per_block"]
            else "whole step" + (f" ({opt['whole_step_reason']})" if opt["whole_step_reason"] else "")
        )
        lines.append(f"  optimizer {opt['optimizer']}: {status}, {how}")
        for r in opt["graph_compiles"]:
            if r["reused_from"] is None:
                lines.append(f"    - {r['name']}: {r['cache']}, {r['seconds']:.2f}s")
        reused = sum(1 for r in opt["graph_compiles"] if r["reused_from"] is not None)
        if reused:
            lines.append(f"    - {reused} more chunk(s) reused those graphs")
        iob = self.optimizer_in_backward
        if iob.get("requested"):
            if iob.get("active"):
                lines.append(
                    f"  optimizer in backward: active from update {iob['from_update']}"
                    + (f"; clipping: {iob['clip']}" if iob.get("clip") else "")
                )
            else:
                lines.append(f"  optimizer in backward: not active ({iob.get('reason') or 'from update 2'})")
        for b in opt["graph_breaks"]:
            lines.append(f"  optimizer graph break: {b['reason']}")
        for r in d["recompiles"]:
            where = f" (update {r['update']})" if "update" in r else ""
            place = f" at {r['where']}" if r.get("where") else ""
            lines.append(f"  recompile [{r['part']}]{where}{place}: {r.get('reason', '?')}")
        if self.model is not None:
            lines.append("model compile report:")
            lines.append(str(self.model))
        return "\n".join(lines)
