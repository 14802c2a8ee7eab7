"""A graph's structure as a key: two graphs with equal keys compile to interchangeable code.

Note [Structural keys]
----------------------
Background: a model that repeats a block gives graphs (or graph pieces) that differ only in the
names of their nodes and in *which* parameters they are handed. Parameters are graph inputs
(Dynamo lifts them), so such graphs compile to the same code, and one compiled callable can run
all of them, each call with its own inputs.

Algorithm: `structural_key` hashes
  * the graph with its names removed: one line per node (op, target, arguments with every node
    replaced by its position), plus the node metadata that changes how it is compiled
    (activation-checkpoint tags, renumbered in order of appearance);
  * every input's metadata: tensor type, shape, stride, storage offset, dtype, device, layout,
    requires_grad, which earlier input it shares storage with (symbolic sizes by their expression);
    non-tensor inputs by value;
  * `extra`: whatever else decides the compiled code (backend, compiler options, grad mode), from
    the caller.
It is stable across processes for the same program (no ids, no addresses), so ranks and later runs
name the same graph the same way. What cannot be named stably (a lambda target, a tensor constant
held by the graph) is named by its id: such graphs are never shared, and that is the safe answer.

A graph that reads a tensor's value into a Python number (`.item()`: Dynamo's form of a float it
made dynamic after a recompile, such as stochastic depth's rate) is the exception: AOTAutograd may
bake the number in where an op needs a plain float, behind a guard Dynamo put on the frame, so two
such graphs alike in structure can need different code. `reads_tensor_values` names them; the caller
does not share their compiles.

Notes: knows nothing of DDP or of buckets; used by compile_core/reuse/compile_once.py.

Debugging: `structural_lines(gm, inputs)` returns the text that is hashed.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from aot.torch_eager import is_op_overload

_META_KEYS = ("recompute", "partitioner_tag")
"""Node metadata that changes the partition or the code (selective activation checkpointing)."""


def structural_key(gm: fx.GraphModule, example_inputs: Iterable[Any], extra: Iterable[Any] = ()) -> str:
    """A short hex digest of `structural_lines`; equal keys mean interchangeable compiled code."""
    digest = hashlib.sha256()
    for line in structural_lines(gm, example_inputs, extra):
        digest.update(line.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:24]


_VALUE_READS = ("item", "tolist")
"""Tensor methods that turn a tensor's values into Python numbers."""


def reads_tensor_values(gm: fx.GraphModule) -> bool:
    """Whether `gm` turns a tensor's value into a Python number (see the Note): its compile may
    depend on that value, which its structure does not show."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _VALUE_READS:
            return True
        if node.op == "call_function" and node.target in (torch.Tensor.item, torch.Tensor.tolist):
            return True
    return False


def compiles_statically(gm: fx.GraphModule, example_inputs: Iterable[Any]) -> bool:
    """Whether compiling `gm` with real inputs of the same shapes, outside Dynamo's tracing context, gives the
    code Dynamo's call would: no symbolic size, stride or number among its inputs or in its traced values, and
    no tensor value read into a number (AOTAutograd would bake this run's value into the code)."""
    if reads_tensor_values(gm):
        return False
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for value in example_inputs:
        if isinstance(value, symbolic) or (isinstance(value, torch.Tensor) and _has_symbols(value)):
            return False
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(leaf, symbolic) or (isinstance(leaf, torch.Tensor) and _has_symbols(leaf)):
                return False
    return True


def _has_symbols(t: torch.Tensor) -> bool:
    if t.layout != torch.strided:
        return any(isinstance(s, torch.SymInt) for s in t.shape)
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride(), t.storage_offset()))


def structural_lines(gm: fx.GraphModule, example_inputs: Iterable[Any], extra: Iterable[Any] = ()) -> list[str]:
    lines = [f"extra {value!r}" for value in extra]
    lines += _graph_lines(gm, "")
    storages: dict[Any, int] = {}
    for index, value in enumerate(example_inputs):
        lines.append(f"input {index} {_input_meta(value, index, storages)}")
    return lines


def _graph_lines(gm: fx.GraphModule, prefix: str) -> list[str]:
    position: dict[fx.Node, str] = {}
    checkpoint_ids: dict[Any, int] = {}
    lines = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = f"%{i}"
        target = _target(gm, node, prefix, lines)
        meta = {k: node.meta[k] for k in _META_KEYS if k in node.meta}
        if "ac_graph_id" in node.meta:
            meta["ac_graph_id"] = checkpoint_ids.setdefault(node.meta["ac_graph_id"], len(checkpoint_ids))
        lines.append(
            f"{prefix}{node.op} {target} {_value(node.args, position)} {_value(node.kwargs, position)}"
            + (f" {_value(meta, position)}" if meta else "")
        )
    return lines


def _target(gm: fx.GraphModule, node: fx.Node, prefix: str, lines: list[str]) -> str:
    if node.op in ("placeholder", "output"):
        return ""
    if node.op == "call_method":
        return str(node.target)
    if node.op in ("get_attr", "call_module"):
        try:
            value = gm.get_submodule(str(node.target)) if node.op == "call_module" else _attr(gm, str(node.target))
        except AttributeError:
            return f"missing:{node.target}"
        if isinstance(value, fx.GraphModule):  # a higher-order op's body: its structure, not its name
            body = f"{prefix}  "
            lines.extend(_graph_lines(value, body))
            return f"graph({len(value.graph.nodes)})"
        if isinstance(value, torch.Tensor):
            return f"tensor@{id(value)}"  # a constant held by this graph: never shared
        if isinstance(value, torch.nn.Module):
            return f"module@{id(value)}"
        return _value(value, {})
    return _callable_name(node.target)


def _attr(gm: fx.GraphModule, dotted: str) -> Any:
    value: Any = gm
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _callable_name(fn: Any) -> str:
    if is_op_overload(fn):  # aten/prims overloads name themselves: "aten.add.Tensor"
        return str(fn)
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if module is None or name is None or "<lambda>" in name or "<locals>" in name:
        return f"{type(fn).__name__}@{id(fn)}"
    return f"{module}.{name}"


def _value(value: Any, position: dict[fx.Node, str]) -> str:
    if isinstance(value, fx.Node):
        return position.get(value, f"?{value.name}")
    if isinstance(value, (list, tuple)):
        inner = ",".join(_value(v, position) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return (
            "{"
            + ",".join(f"{k!s}:{_value(v, position)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
            + "}"
        )
    if isinstance(value, slice):
        return f"slice({_value(value.start, position)},{_value(value.stop, position)},{_value(value.step, position)})"
    if value is None or isinstance(
        value, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
    ):
        return repr(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym({value})"
    if callable(value):
        return _callable_name(value)
    text = repr(value)
    return f"{type(value).__name__}@{id(value)}" if " at 0x" in text else text


def _input_meta(value: Any, index: int, storages: dict[Any, int]) -> str:
    if isinstance(value, torch.Tensor):
        try:
            storage = StorageWeakRef(value.untyped_storage())
            alias = storages.setdefault(storage, index)
        except (NotImplementedError, RuntimeError):  # sparse or other storage-less layouts
            alias = index
        sizes = ",".join(str(s) for s in value.shape)
        strides = ",".join(str(s) for s in value.stride()) if value.layout == torch.strided else "-"
        offset = value.storage_offset() if value.layout == torch.strided else 0
        kind = "param" if isinstance(value, torch.nn.Parameter) else "tensor"
        return (
            f"{kind} [{sizes}] [{strides}] +{offset} {value.dtype} {value.device.type} {value.layout} "
            f"grad={value.requires_grad} alias={alias if alias != index else '-'}"
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym({value})"
    return _value(value, {})
