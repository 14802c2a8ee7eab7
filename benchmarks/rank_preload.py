"""What the benchmark's rank server imports once, before it forks the ranks (Note [Forked benchmark ranks] in
benchmarks/rank_start.py): the modules every `benchmarks.worker` imports before its first step. Nothing here
may compile, start a thread or touch a GPU. An ImportError here is skipped by the fork server (the rank then
imports what it needs itself); any other error would stop the server."""

import torch
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.nn.parallel  # noqa: F401

import benchmarks.bracket_modes  # noqa: F401
import benchmarks.breakdown  # noqa: F401
import benchmarks.checksum  # noqa: F401
import benchmarks.memory  # noqa: F401
import benchmarks.modes  # noqa: F401
import benchmarks.profile_overlap  # noqa: F401
import benchmarks.worker  # noqa: F401
import compile_core  # noqa: F401
import ddp.overlap  # noqa: F401
import examples.gpt  # noqa: F401

# A forked rank would inherit a CUDA context it cannot use. Not raised here: the fork server would die with it and
# take the whole run down; each forked rank checks instead (benchmarks.rank_start._rank_main) and fails its job.
CUDA_INITIALISED = torch.cuda.is_initialized()
