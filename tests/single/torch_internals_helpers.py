"""What the canary files `tests/single/test_torch_internals_*.py` share.

Canaries: one per private torch internal we use, in one file per home or close group of homes
(ddp/torch_ddp.py and ddp/torch_ddp_reducer.py: `_ddp`; aot/torch_dynamo.py, aot/torch_aot.py,
aot/torch_eager.py and aot/torch_dynamo_cache.py: `_dynamo`; aot/torch_graphs.py: `_aot_graphs`;
inductor/torch_inductor.py: `_inductor`; every home's `capabilities()`: `_capabilities`). When a torch upgrade
changes one, its canary fails with a message that names the function to update, instead of a confusing failure
deep inside a compile.

The comment above each canary names the torch versions it was run on (CI: the full suite on 2.13.0, these
files (`python -m compile_core.doctor`) and `pytest -m compat` on 2.11.0 and 2.14.1, `.ci/run`) and how they
differ where they do."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


@contextlib.contextmanager
def canary(home: str):
    """Turn any failure into one line naming the function that mirrors the torch internal."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every failure here means torch changed under us
        raise AssertionError(
            f"torch {torch.__version__} changed what {home} relies on: {type(exc).__name__}: {exc}"
        ) from exc


def two_layers() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
