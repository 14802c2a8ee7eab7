"""A fingerprint of where training took a model's parameters, to compare benchmark modes with eager.

Final losses agree across modes long before the parameters do: after 2 steps a mode that never
all-reduced (each rank trains on its own data) still ends near eager's loss. The parameters do not: each
rank's update follows its own gradient. So every rank records, per parameter, the norm of its update
(final - initial) and the update's dot product with a fixed pseudo-random direction (float64), and
`checksum_distance` measures how far two such fingerprints are apart, relative to the update's size.
A matching mode is ~1e-7..1e-6 away from eager (rounding), a mode without all-reduce ~1e-1..1.
"""

from __future__ import annotations

import math
from typing import Any, Mapping


def param_checksum(final: Mapping[str, Any], initial: Mapping[str, Any]) -> dict[str, Any]:
    """Fingerprint of the update `final - initial` (name -> tensor mappings over the same names)."""
    import torch

    norms, dots = [], []
    for i, (name, p) in enumerate(final.items()):
        delta = (
            p.detach().to("cpu", torch.float64).flatten() - initial[name].detach().to("cpu", torch.float64).flatten()
        )
        direction = torch.randn(delta.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(1000 + i))
        norms.append(delta.norm().item())
        dots.append(torch.dot(delta, direction).item())
    return {"names": list(final), "update_norm": norms, "update_dot": dots}


def checksum_distance(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """How far fingerprint `a` is from the reference `b`, relative to b's total update norm.

    max(|norms_a - norms_b|, |dots_a - dots_b|) (Euclidean over parameters) / |norms_b|. A random
    direction's dot product with an update has about the update's norm, so both terms share one scale.
    Infinite when the parameter names differ (different models cannot match).
    """
    if a["names"] != b["names"]:
        return math.inf
    scale = math.sqrt(sum(x * x for x in b["update_norm"])) or 1e-30

    def diff(key: str) -> float:
        return math.sqrt(sum((x - y) ** 2 for x, y in zip(a[key], b[key])))

    return max(diff("update_norm"), diff("update_dot")) / scale
