"""What the fork server of `tests.ranks.run_ranks` imports once, so that each rank it forks starts with torch,
Dynamo and the project already imported (about 4 s of CPU per rank on CI's 2 cores, some 60 ranks a suite).

The settings every rank wants are made before torch reads them at import: one OpenMP thread, and one
Inductor compile thread (no worker pool competing with the other rank for 2 cores). Nothing here may start
a thread or touch a GPU: the server forks.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401

import compile_core  # noqa: E402, F401
import tests.multi_gpu.ddp_compare  # noqa: E402, F401
