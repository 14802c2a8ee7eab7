"""Inductor forward/backward compilers (see compilers.py). Knows nothing of buckets or DDP."""

from inductor.compilers import InductorSettings, inductor_compile

__all__ = ["InductorSettings", "inductor_compile"]
