"""Launching DDP (+ torch.compile) jobs: a torchx component and ``python -m launch``.

* ``launch.components.trainer`` - the torchx component (``torchx run launch/components.py:trainer`` or,
  once installed, ``torchx run ddp_compile.trainer``); same AppDef on local, slurm and kubernetes.
* ``python -m launch`` (``launch.cli``) - local-friendly front end over the torchx runner.
* ``launch.worker`` - per-rank trampoline recording each rank's exception for the failure report.

Importing this package imports nothing (not torch, not torchx, not the compile stack): ``launch.worker``
runs in every rank, and the CLI must start fast.
"""
