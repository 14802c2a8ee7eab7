"""Compile graphs (or the pieces of a split graph) along the fallback chain, each distinct one once.

A piece that the requested backend cannot compile is not fatal: it falls back along
`CompileConfig.fallback_chain()` (inductor -> aot_eager -> eager), and every fallback is recorded
with the error that caused it. Dynamo's own restart signal is passed through untouched: it means
"trace again", not "this compiler failed". Which pieces are compiled at all, and by which rank, is
compile_core/reuse/compile_once.py's business (Note [Compile once]).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Sequence

import torch.fx as fx

from aot import GraphPair, aot_compile, nop_compiler, nop_forward_compiler
from aot.structure import reads_tensor_values
from aot.torch_aot import non_lazy_backward
from aot.torch_dynamo import RestartAnalysis
from aot.torch_dynamo_cache import CacheOutcome, aot_cache_off, watch_caches
from aot.torch_graphs import inline_nested_regions
from compile_core.config import CompileConfig
from compile_core.report import CompileLog
from compile_core.reuse.compile_once import Compiled, CompileOnce, Job
from compile_core.reuse.idle_work import IdleWork
from inductor import inductor_compile
from inductor.torch_inductor import disk_caches_enabled

log = logging.getLogger(__name__)


class PieceCompiler:
    """`(graph, example_inputs, name) -> (compiled callable, whether AOTAutograd ran)`, with fallbacks."""

    def __init__(self, config: CompileConfig, compile_log: CompileLog, idle_work: IdleWork | None = None) -> None:
        self.config = config
        self.log = compile_log
        named = isinstance(config.backend, str) and config.backend != "eager"
        self.once = CompileOnce(
            reuse=named and config.reuse_pieces,
            claims=config.backend == "inductor" and disk_caches_enabled(),
            records=compile_log.pieces,
            lock=compile_log.lock,
            idle_work=idle_work,
        )

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list, name: str, *, partitioner: Any = None, reuse: bool = True
    ) -> tuple[Callable[..., Any], bool]:
        """`partitioner` (callable with a `uuid()`) replaces AOTAutograd's min-cut partition step.
        `reuse=False`: never hand back a callable compiled for another graph (PyTorch's DDPOptimizer
        calls each piece's callable once on fake inputs, expecting a fresh compile)."""
        return self.compile_many([(gm, list(example_inputs), name)], partitioner=partitioner, reuse=reuse)[0]

    def compile_many(
        self, items: Sequence[tuple[fx.GraphModule, list, str]], *, partitioner: Any = None, reuse: bool = True
    ) -> list[tuple[Callable[..., Any], bool]]:
        """Compile graphs that run together (a split graph's pieces, in forward order)."""
        jobs = [Job(gm=gm, inputs=list(inputs), name=name) for gm, inputs, name in items]
        extra = (
            self.config.backend_name,
            sorted(self.config.inductor_settings().config_patches().items()),
            None if partitioner is None else partitioner.uuid(),
            self.config.dynamic,
        )
        results = self.once.compile_all(jobs, extra, lambda job: self._compile_chain(job, partitioner), reuse=reuse)
        return [(r.fn, r.used_aot) for r in results]

    def _compile_chain(self, job: Job, partitioner: Any) -> Compiled:
        chain = self.config.fallback_chain()
        first_error: tuple[str, BaseException] | None = None
        for backend in chain:
            try:
                compiled = self._compile_with(backend, job.gm, job.inputs, job.name, partitioner)
            except RestartAnalysis:
                raise
            except Exception as exc:  # noqa: BLE001 - any compiler failure moves to the next backend
                if backend == chain[-1]:
                    raise
                log.warning(
                    "compile_core: %s failed to compile %s: %r; falling back",
                    backend,
                    job.name,
                    exc,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                if first_error is None:
                    first_error = (backend, exc)
                continue
            if first_error is not None:
                failed, exc = first_error
                with self.log.lock:
                    self.log.fallbacks.append(
                        {
                            "piece": job.name,
                            "from": failed,
                            "to": backend,
                            "error": f"{type(exc).__name__}: {exc}"[:500],
                        }
                    )
            return compiled
        raise AssertionError("unreachable: the last backend either returns or raises")

    def _compile_with(
        self, backend: str, gm: fx.GraphModule, example_inputs: list, name: str, partitioner: Any
    ) -> Compiled:
        if backend == "eager":
            return Compiled(fn=inline_nested_regions(gm).forward, used_aot=False, backend=backend, cache=CacheOutcome())
        if backend == "custom":
            return Compiled(
                fn=self.config.backend(gm, example_inputs), used_aot=False, backend=backend, cache=CacheOutcome()
            )
        pair = GraphPair(name=name)
        # The backward is compiled with the forward: the cache entry is complete at once, and one
        # compiled piece can serve several identical pieces (Note [Compile once]). A graph that reads
        # a tensor's value (Note [Structural keys]) stays out of AOTAutograd's cache: on torch 2.13
        # its entry, keyed and guarded without that value, was found again for another value.
        value_bound = aot_cache_off() if reads_tensor_values(gm) else contextlib.nullcontext()
        with non_lazy_backward(), value_bound, watch_caches() as cache:
            if backend == "aot_eager":
                compiled = aot_compile(
                    gm,
                    example_inputs,
                    fw_compiler=nop_forward_compiler,
                    bw_compiler=nop_compiler,
                    pair=pair,
                    partition_fn=partitioner,
                )
            else:
                compiled = inductor_compile(
                    gm,
                    example_inputs,
                    settings=self.config.inductor_settings(),
                    on_graph=lambda graph, is_backward: pair.record(graph, backward=is_backward),
                    partitioner=partitioner,
                )
        with self.log.lock:
            self.log.pairs.append(pair)
        return Compiled(fn=compiled, used_aot=True, backend=backend, cache=cache, pair=pair)
