"""AOTAutograd pairing of forward and backward graphs (see pairing.py's Note). Knows nothing of DDP."""

from aot.pairing import GraphPair, aot_compile, nop_compiler, nop_forward_compiler, recording_compilers

__all__ = ["GraphPair", "aot_compile", "nop_compiler", "nop_forward_compiler", "recording_compilers"]
