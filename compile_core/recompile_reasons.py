"""Why a model compiled again, told in the user's terms (pure string work on Dynamo's guard failures).

We compile the model from a frame of our own, `compiled_entry(*args, **kwargs)` (compile_core/api.py), so
that Dynamo traces the wrapped module however it is called. Dynamo's guards are then on that frame's
locals, and a guard failure reads "tensor 'args[0]' size mismatch", "kwargs['scale'] == 2" or
"len(args) == 1", placed at our file, followed by torch's "User stack trace" through our entry, our call
helper and `nn.Module._call_impl`. `torch.compile(model)` starts tracing at the user's `forward` and says
"L['x']", "L['scale'] == 2" at the user's file. `EntryNames` turns the first form into the second: the
user's parameter names, the place of the user's `forward`, one line per failed cache entry, and of the
stack only the innermost frame in the user's code (where the guarded value was used).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any, Callable

_SOURCE_COMMENT = re.compile(r"\s{2,}#.*$")
"""Dynamo pads a failed guard's expression and appends `# <source line>  # <file>:<line> in <function>`."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
"""One frame of the "User stack trace" Dynamo appends to a guard failure."""

_ARGS = r"(?:L\['args'\]|\bargs)"
_KWARGS = r"(?:L\['kwargs'\]|\bkwargs)"
_REWRITES: tuple[tuple[re.Pattern, Callable[[re.Match, tuple[str, ...]], str]], ...] = (
    (re.compile(rf"len\({_ARGS}\) == (\d+)"), lambda m, names: f"number of positional arguments == {m[1]}"),
    (re.compile(rf"len\({_KWARGS}\) == (\d+)"), lambda m, names: f"number of keyword arguments == {m[1]}"),
    (re.compile(rf"\bnot {_KWARGS}(?![\[\w])"), lambda m, names: "no keyword arguments"),
    (
        re.compile(rf"KeyError on {_KWARGS}\[['\"](\w+)['\"]\]"),
        lambda m, names: f"keyword argument {m[1]!r} not passed",
    ),
    (re.compile(rf"{_KWARGS}\[['\"](\w+)['\"]\]"), lambda m, names: m[1]),
    (
        re.compile(rf"{_ARGS}\[(\d+)\]"),
        lambda m, names: names[int(m[1])] if int(m[1]) < len(names) else f"positional argument {m[1]}",
    ),
)


@dataclasses.dataclass(frozen=True)
class EntryNames:
    """How a recompile of the frame `entry_where` (our entry running the user's module) is reported."""

    entry_where: str
    """Our entry's place as the guard hook gives it: `"<file>:<first line> <function>"`."""
    user_where: str
    """The user's `forward`, in the same form: reported as the recompile's place instead."""
    positional: tuple[str, ...]
    """The names of that `forward`'s positional parameters, in order (`args[i]` is `positional[i]`)."""
    library_dirs: tuple[str, ...]
    """Frames under these directories (ours, torch's) are not the user's code."""

    @classmethod
    def of(cls, entry: Callable[..., Any], module: Any) -> EntryNames:
        """The names for `entry`, a function of ours called as `module` is called."""
        code = entry.__code__
        return cls(
            entry_where=f"{code.co_filename}:{code.co_firstlineno} {code.co_name}",
            user_where=_place_of_forward(module),
            positional=_positional_names(module),
            library_dirs=_library_dirs(),
        )

    def translate(self, reason: str, where: str) -> tuple[str, str]:
        """`(reason, where)` of one failed cache entry in the user's terms; unchanged for another frame's."""
        if where != self.entry_where:
            return reason, where
        lines = reason.splitlines() or [reason]
        text = _SOURCE_COMMENT.sub("", lines[0]).rstrip()
        for pattern, rewrite in _REWRITES:
            text = pattern.sub(lambda m, rewrite=rewrite: rewrite(m, self.positional), text)
        users = [f for f in _FRAME.findall(reason) if not self._is_library(f[0])]
        if users:
            path, line, function = users[-1]
            text += f" (used at {path}:{line} in {function})"
        return text, self.user_where

    def _is_library(self, path: str) -> bool:
        return any(path == d or path.startswith(d.rstrip("/") + "/") for d in self.library_dirs)


def _library_dirs() -> tuple[str, ...]:
    import torch

    root = Path(__file__).parent.parent
    packages = [root / name for name in ("compile_core", "aot", "ddp", "inductor")] + [Path(torch.__file__).parent]
    return tuple(dict.fromkeys(str(p) for d in packages for p in (d, d.resolve())))


def _forward_function(module: Any) -> Any:
    forward = getattr(module, "forward", None)
    return getattr(forward, "__func__", forward)


def _place_of_forward(module: Any) -> str:
    function = _forward_function(module)
    code = getattr(function, "__code__", None)
    name = f"{type(module).__name__}.forward"
    return f"{code.co_filename}:{code.co_firstlineno} {name}" if code is not None else name


def _positional_names(module: Any) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):  # a forward without a readable signature: indices stay
        return ()
    names = []
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)
