"""Shape of the GPT-like model (examples/gpt.py) and its named presets: the one place a model shape is declared.

The demo job (examples/train_gpt.py), the integration examples and the benchmark (benchmarks/workloads.py) all
build their model from a preset here, changing only what their command line asks for. This module imports
no torch: the benchmark driver validates its workloads before it checks that torch is installed.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model; the defaults are the `bench` preset."""

    vocab_size: int = 4096
    """Number of token ids."""
    d_model: int = 384
    """Width of the residual stream."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 6
    """Attention heads per block (must divide d_model)."""
    max_seq_len: int = 256
    """Longest sequence the position table covers."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick n_heads that divides d_model"
            )

    @classmethod
    def preset(cls, name: str, **overrides: int) -> GPTConfig:
        """The preset `name` from `GPT_PRESETS`, with the fields in `overrides` replaced (and validated again)."""
        if name not in GPT_PRESETS:
            raise ValueError(f"GPT preset {name!r} is unknown; choose one of {', '.join(GPT_PRESETS)}")
        return dataclasses.replace(GPT_PRESETS[name], **overrides)


GPT_PRESETS: dict[str, GPTConfig] = {
    # python -m benchmarks: the compute and comm workloads (13.8M parameters at 128 tokens)
    "bench": GPTConfig(),
    # python -m benchmarks: the compile workload, many blocks for many graph pieces (11.6M parameters)
    "bench_compile": GPTConfig(vocab_size=4096, d_model=256, n_layers=12, n_heads=4, max_seq_len=64),
    # python -m benchmarks --quick / --smoke (0.93M parameters)
    "tiny": GPTConfig(vocab_size=2048, d_model=128, n_layers=2, n_heads=4, max_seq_len=64),
    # examples/train_gpt.py defaults (0.67M parameters)
    "demo": GPTConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, max_seq_len=64),
    # examples/{fabric,lightning,accelerate}_train.py (0.17M parameters)
    "integration": GPTConfig(vocab_size=128, d_model=64, n_layers=3, n_heads=4, max_seq_len=32),
}
"""Named model shapes. The benchmark sizes the position table to each workload's sequence length
(`benchmarks.workloads.Workload.gpt`), so `max_seq_len` of the `bench*` and `tiny` presets is not what it builds."""
