"""The benchmark's workloads: one model shape, per-rank batch and DDP bucket cap each (`Workload`), validated
on construction, and the standard three a run measures (`full_workloads`: compute, comm, compile)."""

from __future__ import annotations

import dataclasses
from typing import Any

from examples.gpt_config import GPT_PRESETS, GPTConfig  # torch-free: the model's shape and its presets


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One model shape, per-rank batch and DDP bucket cap."""

    name: str
    """Short label used in tables and file names (letters, digits, '_' and '-')."""
    model: GPTConfig = GPT_PRESETS["bench"]
    """Shape of the GPT-like model (a preset from examples/gpt_config.py); the position table is sized to
    `seq_len`, whatever `model.max_seq_len` says (`gpt()`)."""
    batch: int = 8
    """Sequences per rank per step."""
    seq_len: int = 128
    """Tokens per sequence."""
    bucket_cap_mb: float | None = None
    """DDP bucket cap in MiB for this workload (None: BenchConfig.bucket_cap_mb)."""
    scaling: bool = True
    """Run the 1-rank reference job for scaling efficiency (when the config asks for scaling)."""
    overlap: bool = True
    """Run the extra overlap job (recorder + profiler) for this workload (when the config asks for it)."""
    purpose: str = ""
    """One line on what the workload is for, shown in the report."""

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"Workload.name={self.name!r}: use letters, digits, '_' or '-' (it names files)")
        if not isinstance(self.model, GPTConfig):
            raise TypeError(
                f"Workload({self.name}).model={self.model!r}: pass a GPTConfig (examples/gpt_config.py); "
                "Workload.from_dict reads a recorded one"
            )
        for field in ("batch", "seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Workload({self.name}).{field}={value!r}: must be a positive int")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(
                f"Workload({self.name}).bucket_cap_mb={self.bucket_cap_mb!r}: pass a positive MiB "
                "value, or None for the config's cap"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """The workload a results.json recorded (`dataclasses.asdict`); older runs recorded the shape's fields
        flat (vocab_size, d_model, n_layers, n_heads) instead of `model`."""
        data = dict(data)
        if "model" in data:
            model = GPTConfig(**data.pop("model"))
        else:
            shape = {k: data.pop(k) for k in _SHAPE_FIELDS if k in data}
            model = dataclasses.replace(GPT_PRESETS["bench"], **shape)
        return cls(model=model, **data)

    def gpt(self) -> GPTConfig:
        """The model every job of this workload builds: `model` with its position table sized to `seq_len`."""
        return dataclasses.replace(self.model, max_seq_len=self.seq_len)

    def gpt_kwargs(self) -> dict[str, int]:
        """`gpt()` as the keyword arguments of GPTConfig (what the worker spec carries)."""
        return dataclasses.asdict(self.gpt())

    def cap_mb(self, default: float | None) -> float | None:
        """The DDP bucket cap this workload runs with (None: DDP's own default of 25 MiB)."""
        return self.bucket_cap_mb if self.bucket_cap_mb is not None else default

    def describe(self, default_cap_mb: float | None = None) -> str:
        cap = self.cap_mb(default_cap_mb)
        return (
            f"GPT d={self.model.d_model}, {self.model.n_layers} layers, {self.model.n_heads} heads, "
            f"vocab {self.model.vocab_size}; "
            f"batch {self.batch}x{self.seq_len} tokens per rank; bucket cap "
            f"{'25 MiB (DDP default)' if cap is None else f'{cap:g} MiB'}"
        )


def full_workloads(
    *,
    model: GPTConfig = GPT_PRESETS["bench"],
    compute_batch: tuple[int, int] = (8, 128),
    comm_batch: tuple[int, int] = (2, 64),
    comm_cap_mb: float | None = 4.0,
) -> tuple[Workload, ...]:
    """The standard workloads: compute- and communication-heavy batches on one model, plus `compile`."""
    return (
        Workload(
            name="compute",
            model=model,
            batch=compute_batch[0],
            seq_len=compute_batch[1],
            purpose="compute-heavy step: large per-rank batch, DDP's default buckets",
        ),
        # the issue-11/12 comm-heavy comparison: small batch, 4 MiB buckets (~14 buckets on this model)
        Workload(
            name="comm",
            model=model,
            batch=comm_batch[0],
            seq_len=comm_batch[1],
            bucket_cap_mb=comm_cap_mb,
            purpose="communication-heavy step: small per-rank batch, small buckets",
        ),
        COMPILE_WORKLOAD,
    )


COMPILE_WORKLOAD = Workload(
    name="compile",
    model=GPT_PRESETS["bench_compile"],
    batch=2,
    seq_len=64,
    bucket_cap_mb=1.0,
    scaling=False,
    overlap=False,
    purpose=f"compile time: {GPT_PRESETS['bench_compile'].n_layers} blocks at 1 MiB buckets (many graph pieces); "
    "read the cold/warm first step",
)
"""The issue-10 shape: first-step (compile) wall time, cold and warm; no 1-rank or overlap jobs."""

WORKLOAD_NAMES = ("compute", "comm", "compile")

TINY_PRESET = "tiny"
"""GPT preset of --quick and --smoke for compute/comm (smoke shrinks `compile` to it too)."""

_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads")
"""GPTConfig fields a workload's shape sets (max_seq_len is the workload's seq_len)."""
