"""What the framework integrations share: compile options, the missing-extra error, the first-step log.

Imports no framework: `compile_core.integrations.lightning` and `.accelerate` import their own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from compile_core.config import CompileConfig
from compile_core.report import CompileReport

_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CompileConfig))


def missing_extra(extra: str, err: ImportError) -> ImportError:
    """The ImportError to raise when a framework's own import fails: names the extra that installs it."""
    return ImportError(
        f"compile_core.integrations.{extra} needs the [{extra}] extra, which is not installed or does not "
        f'import ({err}); install it with: pip install -e ".[{extra}]"'
    )


def as_compile_config(value: CompileConfig | Mapping[str, Any] | None, *, argument: str) -> CompileConfig:
    """A validated `CompileConfig` from a config, a mapping of `compile_core.compile` keywords, or None (defaults)."""
    if value is None:
        return CompileConfig()
    if isinstance(value, CompileConfig):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_OPTION_NAMES))
        if unknown:
            raise TypeError(
                f"{argument}: unknown compile option(s) {unknown}; the options of compile_core.compile are "
                f"{list(_OPTION_NAMES)}"
            )
        return CompileConfig(**value)  # validates the values (ValueError/TypeError naming the fix)
    raise TypeError(
        f"{argument} must be a compile_core.CompileConfig, a dict of compile_core.compile options or None, "
        f"got {type(value).__name__}"
    )


def compile_kwargs(config: CompileConfig) -> dict[str, Any]:
    """`config` as keyword arguments of `compile_core.compile`."""
    return {name: getattr(config, name) for name in _OPTION_NAMES}


def summary_line(report: CompileReport, where: str) -> str:
    """One line: what the first training step compiled (the report itself follows it in the log)."""
    return (
        f"compile_core: first training step done under {where}: {len(report.graphs)} graph(s), "
        f"{report.pieces} piece(s), {len(report.graph_breaks)} graph break(s), {len(report.recompiles)} "
        f"recompile(s), {len(report.fallbacks)} fallback(s), {report.compile_seconds:.2f} s compiling "
        f"(backend={report.backend}, ddp={report.mode})"
    )


class FirstStepLog:
    """Logs a compiled model's report once, on global rank 0, when its first training step is done."""

    def __init__(self, logger: logging.Logger, where: str) -> None:
        self.logger = logger
        self.where = where
        self.done = False

    def step_done(self, report: CompileReport, *, global_rank: int) -> None:
        if self.done:
            return
        self.done = True
        if global_rank != 0:
            return
        self.logger.info("%s\n%s", summary_line(report, self.where), report)
        if not report.graphs:
            # Our backend never ran: the most common reason is a second compiler around ours.
            self.logger.warning(
                "compile_core: the first training step compiled nothing under %s; if the model was also "
                "wrapped in torch.compile, pass the uncompiled model (the strategy compiles it)",
                self.where,
            )
