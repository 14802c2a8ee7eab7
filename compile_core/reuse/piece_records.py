"""What compiling one piece produced and how it went: the records compile_core/reuse/compile_once.py keeps
(Note [Compile once]) and `report()["piece_compiles"]` shows."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.fx as fx

from aot import GraphPair
from aot.torch_dynamo_cache import AotCache, CacheOutcome
from compile_core.reuse.claims import Holder, WaitEnd


@dataclasses.dataclass
class Compiled:
    """What compiling one graph produced (the fallback chain's answer)."""

    fn: Callable[..., Any]
    used_aot: bool
    backend: str
    """The backend that compiled it (after fallbacks)."""
    cache: CacheOutcome
    pair: GraphPair | None = None


@dataclasses.dataclass
class PieceRecord:
    """How one graph or piece came to be compiled (one per piece, reused ones included)."""

    name: str
    key: str | None
    """Structural key (None: never shared)."""
    cache: str
    """`reused`, or the cache outcome (`aot cache hit`, `aot cache miss, fx cache 2 miss`, ...)."""
    seconds: float
    """Wall time to compile or load it (waiting excluded)."""
    backend: str = ""
    reused_from: str | None = None
    waited_s: float = 0.0
    """Time spent waiting for another process's claim."""
    waited_for: str | None = None
    """Who held the claim (`rank 0 (pid 123)`)."""
    leader: str | None = None
    """How the wait ended: done (loaded their compile), failed: <why>, died, or timed out."""
    source: str = "compiled here"
    """Where it came from: `compiled here`, `from rank N` (its compile, shipped or in a shared cache
    dir), `from the local cache` (this node compiled it before), or `reused` (an identical piece)."""
    received_bytes: int = 0
    """Bytes of another rank's compile installed into this node's cache for it."""
    aot_cache: AotCache = AotCache.UNUSED
    """AOTAutogradCache's outcome, the kind behind `cache` (which is for people); unused when reused."""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "key": self.key,
            "cache": self.cache,
            "aot_cache": self.aot_cache.value,
            "seconds": round(self.seconds, 4),
            "backend": self.backend,
            "reused_from": self.reused_from,
            "source": self.source,
        }
        if self.waited_for is not None or self.leader is not None:
            out.update(
                waited_s=round(self.waited_s, 3),
                waited_for=self.waited_for,
                leader=self.leader,
                received_bytes=self.received_bytes,
            )
        return out

    def line(self) -> str:
        if self.reused_from is not None:
            return f"{self.name} reused from {self.reused_from} ({self.seconds:.2f} s)"
        verb = "loaded" if self.aot_cache is AotCache.HIT else "compiled"
        where = "" if self.source == "compiled here" else f", {self.source}"
        text = f"{self.name} {verb} ({self.cache}{where}) {self.seconds:.2f} s"
        if self.waited_for is not None:
            text += f" after waiting {self.waited_s:.1f} s for {self.waited_for} ({self.leader})"
        return text


@dataclasses.dataclass
class Wait:
    """How waiting for another rank's claim ended, whichever kind of claim it was."""

    holder: Holder | None
    end: WaitEnd | None
    """How it ended (decisions read this)."""
    outcome: str
    """The same, for people: done, failed: <why>, died, or timed out."""
    seconds: float
    received_bytes: int = 0
    meta: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, wait: Any) -> Wait:
        return cls(
            holder=wait.holder,
            end=wait.end,
            outcome=wait.outcome,
            seconds=wait.seconds,
            received_bytes=getattr(wait, "installed_bytes", 0),
            meta=getattr(wait, "meta", {}),
        )


@dataclasses.dataclass
class Job:
    gm: fx.GraphModule
    inputs: list
    name: str
