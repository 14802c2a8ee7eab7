"""`CompileReport`: what was compiled, how it was split, and everything that went differently."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from aot import GraphPair
from aot.torch_dynamo_cache import AotCache
from compile_core.events import CompileEvents
from ddp.bucketing import MiB


@dataclasses.dataclass
class GraphEntry:
    """One Dynamo graph as compiled."""

    name: str
    """`graph_0`, `graph_1`, ... in compile order."""
    pieces: int
    """Pieces it was compiled as (1 = not split)."""
    buckets: list[dict]
    """`{"params": [user names], "bytes": int}` in backward order (the planned buckets)."""
    seconds: float
    """Wall time spent compiling it (all pieces)."""
    step: int
    """Which call of the compiled model compiled it (1 = first)."""
    variant: str | None = None
    """ddp='in_graph' only: local (no collective), reduce, or reduce_acc (with accumulated gradients)."""
    bucket_caps: dict | None = None
    """Requested caps next to the planned bucket bytes: `requested_bytes`, `requested_first_bytes`,
    `planned_bytes` (backward order), `aligned_to` (repeated blocks the cuts kept to)."""
    restrided: list[int] | None = None
    """Per piece, outputs copied at run time into the layout the next piece was compiled for."""
    grad: bool = True
    """Compiled in a forward with gradients enabled (False: an evaluation graph, which reduces nothing)."""


class CompileLog:
    """What the compile path fills in while compiling (graphs, fallbacks, pairs, notes).

    Timing, graph breaks and recompiles live in `CompileEvents`; the reducer swap's state lives in
    `ddp.alignment.ReducerAlignment`; `snapshot()` joins all three into a `CompileReport`.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.graphs: list[GraphEntry] = []
        self.fallbacks: list[dict] = []
        self.pairs: list[GraphPair] = []
        self.notes: list[str] = []
        self.auto_cap: dict | None = None
        """`bucket_cap_mb="auto"`: the measured link and the cap chosen (ddp/bucketing/auto_cap.py)."""
        self.pieces: list = []
        """`PieceRecord` per compiled or reused graph/piece (compile_core/reuse/compile_once.py)."""

    def snapshot(
        self,
        *,
        mode: str,
        backend: str,
        events: CompileEvents,
        alignment: dict,
        observed_alignment: dict | None,
        notes: list[str] = (),
        rank_differences: list[dict] = (),
        in_graph: dict | None = None,
    ) -> "CompileReport":
        with self.lock, events.lock:
            return CompileReport(
                mode=mode,
                backend=backend,
                graphs=[dataclasses.replace(g) for g in self.graphs],
                graph_breaks=[dict(x) for x in events.graph_breaks],
                recompiles=[dict(x) for x in events.recompiles],
                fallbacks=[dict(x) for x in self.fallbacks],
                pairs=list(self.pairs),
                piece_compiles=[r.to_dict() for r in self.pieces],
                notes=list(self.notes) + list(notes),
                alignment=dict(alignment),
                observed_alignment=observed_alignment,
                compile_seconds=events.compile_seconds,
                rank_differences=[dict(d) for d in rank_differences],
                bucket_cap_auto=None if self.auto_cap is None else dict(self.auto_cap),
                in_graph=in_graph,
            )


def _short_names(names: list[str], keep: int = 8) -> str:
    """A bucket's parameter names for the table; long buckets show their ends (to_dict has them all)."""
    if not names:
        return "(no parameters)"
    if len(names) <= keep:
        return ", ".join(names)
    return f"{', '.join(names[:3])}, ..., {', '.join(names[-2:])} ({len(names)} params)"


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """A snapshot of one compiled model's compile history."""

    mode: str
    backend: str
    graphs: list[GraphEntry]
    graph_breaks: list[dict]
    recompiles: list[dict]
    fallbacks: list[dict]
    pairs: list[GraphPair]
    notes: list[str]
    alignment: dict
    compile_seconds: float
    observed_alignment: dict | None = None
    """Planned pieces vs the buckets an attached `ddp.overlap.OverlapRecorder` saw DDP reduce."""
    rank_differences: list[dict] = dataclasses.field(default_factory=list)
    """`{"rank", "difference"}` per other rank whose compile (graphs, pieces, fallbacks, recompiles,
    breaks) differs from this rank's, as far as it has told so far."""
    in_graph: dict | None = None
    """ddp='in_graph' only: who reduces (compiled backward or DDP's reducer, and why), the comm hook
    and wire dtype, parameters reduced after the backward, graphs whose collectives fell back."""
    bucket_cap_auto: dict | None = None
    """`bucket_cap_mb="auto"` only: `cap_bytes`, `latency_us`, `gbytes_per_s`, `grad_bytes`, `bound`."""
    piece_compiles: list[dict] = dataclasses.field(default_factory=list)
    """One per graph or piece: `name`, `key`, `cache` (reused, or the cache outcome, for people),
    `aot_cache` (its kind: hit, miss, bypass, or "" when AOTAutogradCache was not used), `seconds`,
    `backend`, `reused_from`, and for a piece another rank held: `waited_s`, `waited_for`, `leader`
    (compile_core/reuse/compile_once.py)."""

    def compile_once(self) -> dict[str, Any]:
        """Totals over `piece_compiles`: pieces, compiled here, loaded from the cache, reused."""
        rows = self.piece_compiles
        reused = sum(1 for r in rows if r["reused_from"] is not None)
        hits = sum(1 for r in rows if r["aot_cache"] == AotCache.HIT.value)
        return {
            "pieces": len(rows),
            "reused": reused,
            "cache_hits": hits,
            "compiled": len(rows) - reused - hits,
            "waited_s": round(sum(r.get("waited_s", 0.0) for r in rows), 3),
        }

    @property
    def pieces(self) -> int:
        return sum(g.pieces for g in self.graphs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ddp_mode": self.mode,
            "backend": self.backend,
            "graphs": [
                {
                    "name": g.name,
                    "pieces": g.pieces,
                    "buckets": [dict(b) for b in g.buckets],
                    "compile_seconds": round(g.seconds, 4),
                    "step": g.step,
                    **({"variant": g.variant} if g.variant is not None else {}),
                    **({"bucket_caps": dict(g.bucket_caps)} if g.bucket_caps is not None else {}),
                    **({"restrided": list(g.restrided)} if g.restrided is not None else {}),
                }
                for g in self.graphs
            ],
            "graph_breaks": [dict(x) for x in self.graph_breaks],
            "recompiles": [dict(x) for x in self.recompiles],
            "fallbacks": [dict(x) for x in self.fallbacks],
            "pairs": [p.to_dict() for p in self.pairs],
            "alignment": dict(self.alignment),
            "observed_alignment": self.observed_alignment,
            "notes": list(self.notes),
            "rank_differences": [dict(d) for d in self.rank_differences],
            "compile_seconds": round(self.compile_seconds, 4),
            "piece_compiles": [dict(r) for r in self.piece_compiles],
            "compile_once": self.compile_once(),
            "in_graph": None if self.in_graph is None else dict(self.in_graph),
            "bucket_cap_auto": None if self.bucket_cap_auto is None else dict(self.bucket_cap_auto),
        }

    def __str__(self) -> str:
        out = [
            f"compile report: backend={self.backend} ddp={self.mode} graphs={len(self.graphs)} "
            f"pieces={self.pieces} compile={self.compile_seconds:.2f}s"
        ]
        if self.bucket_cap_auto is not None:
            a = self.bucket_cap_auto
            out.append(
                f"  bucket cap auto: {a['cap_bytes'] / MiB:.3g} MiB ({a['bound']} bound; all-reduce "
                f"{a['latency_us']:.0f} us + {a['gbytes_per_s']:.3g} GB/s, "
                f"{a['grad_bytes'] / MiB:.3g} MiB of gradients)"
            )
        for g in self.graphs:
            variant = f", variant {g.variant}" if g.variant is not None else ""
            out.append(f"  {g.name} (step {g.step}): {g.pieces} piece(s){variant}, {g.seconds:.2f}s")
            if g.bucket_caps is not None and g.bucket_caps["planned_bytes"]:
                caps, planned = g.bucket_caps, g.bucket_caps["planned_bytes"]
                where = (
                    f" at {', '.join(c + '.<i>' if c else '<i>' for c in caps['aligned_to'])} boundaries"
                    if caps["aligned_to"]
                    else ""
                )
                out.append(
                    f"    buckets: requested {caps['requested_bytes'] / MiB:.3g} MiB "
                    f"(first {caps['requested_first_bytes'] / MiB:.3g}), "
                    f"planned {min(planned) / MiB:.3g}-{max(planned) / MiB:.3g} MiB{where}"
                )
            for i, b in enumerate(g.buckets):
                after = f"  [all-reduce after {b['after']}]" if "after" in b else ""
                out.append(f"    bucket {i:>2}  {b['bytes'] / MiB:9.3f} MiB  {_short_names(b['params'])}{after}")
        align = self.alignment
        out.append(
            f"  DDP bucket alignment: {align.get('status')}" + (f" ({align['detail']})" if align.get("detail") else "")
        )
        if self.observed_alignment is not None:
            out.extend(f"  {line}" for line in self.observed_alignment["text"].splitlines())
        if self.in_graph is not None:
            ig = self.in_graph
            wire = f", wire dtype {ig['reduce_dtype']}" if ig.get("reduce_dtype") else ""
            hook = f", comm hook {ig['comm_hook']}" if ig.get("comm_hook") else ""
            out.append(
                f"  in-graph reduction: by the {ig['reducer']}{hook}{wire}"
                + (f" ({ig['reason']})" if ig.get("reason") else "")
            )
            if ig.get("outside_graph"):
                out.append(
                    "    reduced after the backward (gradients from outside one graph): "
                    + ", ".join(ig["outside_graph"])
                )
            if ig.get("gradient_hooks"):
                out.append(
                    "    reduced after the backward (their gradient hooks see the local gradient): "
                    + ", ".join(ig["gradient_hooks"])
                )
            for f in ig.get("fallbacks", ()):
                out.append(f"    {f['graph']}: all-reduced after the backward: {f['reason']}")
        sections = (
            ("graph breaks", self.graph_breaks, lambda x: f"{x['where']}: {x['reason']}"),
            ("recompiles", self.recompiles, lambda x: f"{x['where']}: {x['reason']}"),
            ("fallbacks", self.fallbacks, lambda x: f"{x['piece']}: {x['from']} -> {x['to']} ({x['error']})"),
            ("notes", self.notes, str),
            (
                "other ranks compiled differently",
                self.rank_differences,
                lambda x: f"rank {x['rank']}: {x['difference']}",
            ),
        )
        for title, rows, fmt in sections:
            out.append(f"  {title}: {len(rows) if rows else 'none'}")
            out.extend(f"    - {fmt(r)}" for r in rows)
        if self.piece_compiles:
            totals = self.compile_once()
            out.append(
                f"  piece compiles: {totals['pieces']} ({totals['compiled']} compiled, {totals['cache_hits']} from the "
                f"cache, {totals['reused']} reused)"
            )
            for r in self.piece_compiles:
                how = f"reused from {r['reused_from']}" if r["reused_from"] else r["cache"]
                waited = (
                    f", waited {r['waited_s']:.1f}s for {r['waited_for']} ({r['leader']})"
                    if r.get("waited_for")
                    else ""
                )
                out.append(f"    - {r['name']}: {how}, {r['seconds']:.2f}s{waited}")
        if self.pairs:
            out.append(f"  forward/backward pairs: {len(self.pairs)}")
            out.extend(f"    - {p.describe()}" for p in self.pairs)
        return "\n".join(out)
