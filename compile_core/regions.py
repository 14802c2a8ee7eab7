"""Repeated blocks as nested compile regions: traced once, called per layer (`nested_regions=True`).

Note [Repeated blocks as nested compile regions]
------------------------------------------------
Background: Dynamo inlines every call of a module's forward, so a 12-block transformer is traced 12
times, and AOTAutograd and Inductor see 12 copies of the block in the one graph of ddp='in_graph'.
`torch.compiler.nested_compile_region` marks a function whose calls Dynamo traces once and then calls
as a subgraph (`invoke_subgraph`); the backward of each call is a call of one backward subgraph.

Algorithm (`apply_nested_regions`, before the first compile):
  * the repeated units come from the parameter names, as for bucket alignment (ddp/bucketing/repeats.py):
    `blocks.0` ... `blocks.11` with the same parameters;
  * every unit of one class gets a subclass of it whose `forward` is that class's forward as one region,
    made once per class (reuse needs the very same region function), and the instance's `__class__` is
    swapped to it (what FSDP2's `fully_shard` does): the model and its state_dict keys are unchanged.
Why not a region bound per instance (`block.forward = MethodType(region, block)`): under torch 2.13 that
traced and gave outputs far from eager's (2.8 max abs on a 12-layer GPT's logits), silently; a class
decorator gave them exactly.
Inductor compiles a graph with repeated region calls without buffer reuse (inductor/compilers.py: with
it, torch 2.13 computed wrong gradients). AOTAutograd partitions each region body with the graph's own
partition step, before the graph: the in-graph all-reduce pass leaves a body alone (ddp/in_graph/partitioner.py;
the parameters' gradients leave through the calling backward, bucketed there). A graph that falls back to
eager runs the bodies as plain calls (aot/torch_graphs.py: inline_nested_regions): run eagerly, the region
op's own backward fails under torch 2.13.

Notes: only for ddp='in_graph' (one graph per step: ddp='split' cuts graphs at bucket boundaries, which
can fall inside a block). A unit whose instance has its own `forward` attribute, or whose class forward is
already a region, is left alone. Pickling the whole module (`torch.save(model)`) needs the original class
back: `remove_nested_regions(model)`.

Debugging: `report()["notes"]` lists the classes and how many units each; `TORCH_LOGS=graph_code`
shows the `invoke_subgraph` calls.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ddp.bucketing import ParamInfo
from ddp.bucketing.repeats import repeated_units

log = logging.getLogger(__name__)

_REGION_CLASSES: dict[type, type] = {}
"""Original class -> its region subclass (one per class: every unit must call the same region)."""
_ORIGINAL = "_compile_core_region_of"


def region_class(cls: type) -> type:
    """The subclass of `cls` whose forward is `cls.forward` as one nested compile region (made once)."""
    if cls not in _REGION_CLASSES:
        _REGION_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": torch.compiler.nested_compile_region(cls.forward),
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                _ORIGINAL: cls,
            },
        )
    return _REGION_CLASSES[cls]


def apply_nested_regions(model: nn.Module) -> dict[str, int]:
    """Make each repeated unit of `model` a nested compile region; returns class name -> units marked."""
    infos = [
        ParamInfo(name=name, nbytes=p.numel() * p.element_size(), key=f"{p.dtype}/{p.device}")
        for name, p in model.named_parameters()
    ]
    units = sorted(set(repeated_units(infos).values()))
    marked: dict[str, int] = {}
    for unit in units:
        module = model.get_submodule(unit)
        cls = type(module)
        if getattr(cls, _ORIGINAL, None) is not None or "forward" in vars(module):
            continue  # already a region, or a forward of its own this instance would lose
        module.__class__ = region_class(cls)
        marked[cls.__qualname__] = marked.get(cls.__qualname__, 0) + 1
    if marked:
        log.info("compile_core: nested compile regions: %s", ", ".join(f"{k} x{v}" for k, v in marked.items()))
    return marked


def remove_nested_regions(model: nn.Module) -> None:
    """Give every unit `apply_nested_regions` marked its original class back."""
    for module in model.modules():
        original = getattr(type(module), _ORIGINAL, None)
        if original is not None:
            module.__class__ = original
