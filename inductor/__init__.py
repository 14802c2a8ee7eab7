"""Inductor forward/backward compilers (see compilers.py). Knows nothing of buckets or DDP."""

from inductor.compilers import MODES, InductorSettings, inductor_compile

__all__ = ["MODES", "InductorSettings", "inductor_compile"]
