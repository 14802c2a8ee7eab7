"""The chunks `ChunkedUpdate` (compile_core/step/chunked_update.py) compiles its update for: each param group
cut into one chunk per repeated block, from the parameter names (ddp/bucketing/repeats.py), and one for the
rest (Note [Optimizer update per block] in chunked_update.py)."""

from __future__ import annotations

import dataclasses

import torch

from ddp.bucketing import ParamInfo
from ddp.bucketing.repeats import repeated_units


@dataclasses.dataclass
class Chunk:
    group: int
    """Index of its param group."""
    name: str
    """`group0.blocks.3` or `group0.rest`."""
    params: list[torch.nn.Parameter]
    keys: dict = dataclasses.field(default_factory=dict)
    """Ids of a set of its parameters with a gradient -> the key of the compiled update for that set
    (group, shapes/strides/dtypes of the parameters and their state): one entry per set this chunk runs
    compiled, at most `MAX_SUBSETS` (compile_core/step/chunked_update.py)."""


def plan_chunks(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[Chunk]:
    """Each param group's chunks, group by group: one per repeated block, one for the rest (`group0.rest`)."""
    chunks: list[Chunk] = []
    for index, group in enumerate(optimizer.param_groups):
        # Every parameter of the group, frozen ones too: torch's step updates whatever has a gradient when
        # it runs, and a parameter frozen now may be unfrozen later (gradual unfreezing in fine-tuning).
        params = list(group["params"])
        infos = [
            ParamInfo(
                name=names.get(id(p), f"param{i}"), nbytes=p.numel() * p.element_size(), key=f"{p.dtype}/{p.device}"
            )
            for i, p in enumerate(params)
        ]
        units = repeated_units(infos)
        by_unit: dict[str, list] = {}
        for p, info in zip(params, infos):
            by_unit.setdefault(units.get(info.name, ""), []).append(p)
        for unit, members in by_unit.items():
            chunks.append(Chunk(group=index, name=f"group{index}.{unit or 'rest'}", params=members))
    return chunks
