"""Launching DDP (+ torch.compile) jobs: a torchx component and ``python -m launch``.

* ``launch.components.trainer`` - the torchx component (``torchx run launch/components.py:trainer`` or,
  once installed, ``torchx run ddp_compile.trainer``); same AppDef on local, slurm and kubernetes.
* ``python -m launch`` (``launch.cli``) - local-friendly front end over the torchx runner: ``launch.args``
  (command line, ``LaunchConfig``), ``launch.run`` (run, stream, cancel, reap), ``launch.failures`` (which
  rank failed first and why).
* ``launch.worker`` - per-rank trampoline recording each rank's exception for the failure report.
* ``launch.heartbeat`` - ``beat()``: a rank's progress signal, for hang detection (the library calls it).
* ``launch.watchdog`` - the per-node hang monitor torchrun runs under with ``--hang-timeout``.
* ``launch.net`` - ``free_port()``.

Importing this package imports nothing (not torch, not torchx, not the compile stack): ``launch.worker``
runs in every rank, ``launch.heartbeat`` is imported by the library, and the CLI must start fast.
"""
