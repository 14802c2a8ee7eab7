"""Compile one graph (or one piece of a split graph) along the fallback chain.

A piece that the requested backend cannot compile is not fatal: it falls back along
`CompileConfig.fallback_chain()` (inductor -> aot_eager -> eager), and every fallback is recorded
with the error that caused it. Dynamo's own restart signal is passed through untouched: it means
"trace again", not "this compiler failed".
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch.fx as fx

from aot import GraphPair, aot_compile, nop_compiler
from aot.torch_dynamo import RestartAnalysis
from compile_core.config import CompileConfig
from compile_core.report import CompileLog
from inductor import inductor_compile

log = logging.getLogger(__name__)


class PieceCompiler:
    """`(graph, example_inputs, name) -> (compiled callable, whether AOTAutograd ran)`, with fallbacks."""

    def __init__(self, config: CompileConfig, compile_log: CompileLog) -> None:
        self.config = config
        self.log = compile_log

    def __call__(
        self, gm: fx.GraphModule, example_inputs: list, name: str, *, partitioner: Any = None
    ) -> tuple[Callable[..., Any], bool]:
        """`partitioner` (callable with a `uuid()`) replaces AOTAutograd's min-cut partition step."""
        chain = self.config.fallback_chain()
        first_error: tuple[str, BaseException] | None = None
        for backend in chain:
            try:
                compiled, used_aot = self._compile_with(backend, gm, example_inputs, name, partitioner)
            except RestartAnalysis:
                raise
            except Exception as exc:  # noqa: BLE001 - any compiler failure moves to the next backend
                if backend == chain[-1]:
                    raise
                log.warning("compile_core: %s failed to compile %s: %r; falling back", backend, name, exc,
                            exc_info=log.isEnabledFor(logging.DEBUG))
                if first_error is None:
                    first_error = (backend, exc)
                continue
            if first_error is not None:
                failed, exc = first_error
                with self.log.lock:
                    self.log.fallbacks.append(
                        {"piece": name, "from": failed, "to": backend, "error": f"{type(exc).__name__}: {exc}"[:500]}
                    )
            return compiled, used_aot
        raise AssertionError("unreachable: the last backend either returns or raises")

    def _compile_with(
        self, backend: str, gm: fx.GraphModule, example_inputs: list, name: str, partitioner: Any
    ) -> tuple[Callable[..., Any], bool]:
        if backend == "eager":
            return gm.forward, False
        if backend == "custom":
            return self.config.backend(gm, example_inputs), False
        pair = GraphPair(name=name)
        if backend == "aot_eager":
            compiled = aot_compile(
                gm, example_inputs, fw_compiler=nop_compiler, bw_compiler=nop_compiler, pair=pair,
                partition_fn=partitioner,
            )
        else:
            compiled = inductor_compile(
                gm, example_inputs, settings=self.config.inductor_settings(),
                on_graph=lambda graph, is_backward: pair.record(graph, backward=is_backward),
                partitioner=partitioner,
            )
        with self.log.lock:
            self.log.pairs.append(pair)
        return compiled, True
