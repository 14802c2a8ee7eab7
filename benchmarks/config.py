"""Benchmark configuration: workloads, modes, presets. Everything is validated on construction."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

MODES: tuple[str, ...] = (
    "eager",
    "torch_ddpopt",
    "torch_nosplit",
    "torch_python_reducer",
    "ours_compile",
    "ours_step",
)
"""Every mode, in table order."""

MODE_HELP: dict[str, str] = {
    "eager": "eager DDP + eager optimizer",
    "torch_ddpopt": "torch.compile(ddp_model), PyTorch's DDPOptimizer (optimize_ddp=True)",
    "torch_nosplit": "torch.compile(ddp_model), optimize_ddp=False (one graph, no overlap)",
    "torch_python_reducer": "compiled autograd + optimize_ddp='python_reducer'",
    "ours_compile": "compile_core.compile(ddp_model) + eager optimizer",
    "ours_step": "compile_core.train_step (forward+backward+optimizer captured)",
}

BACKENDS = ("inductor", "aot_eager", "eager")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One model shape and per-rank batch."""

    name: str
    """Short label used in tables and file names (letters, digits, '_' and '-')."""
    vocab_size: int = 4096
    """Token ids of the GPT-like model."""
    d_model: int = 384
    """Width of the residual stream."""
    n_layers: int = 6
    """Transformer blocks."""
    n_heads: int = 6
    """Attention heads (must divide d_model)."""
    batch: int = 8
    """Sequences per rank per step."""
    seq_len: int = 128
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"Workload.name={self.name!r}: use letters, digits, '_' or '-' (it names files)")
        for field in ("vocab_size", "d_model", "n_layers", "n_heads", "batch", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Workload({self.name}).{field}={value!r}: must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"Workload({self.name}): d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick --heads that divides --d-model"
            )

    def gpt_kwargs(self) -> dict[str, int]:
        return {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "max_seq_len": self.seq_len,
        }

    def describe(self) -> str:
        return (
            f"GPT d={self.d_model}, {self.n_layers} layers, {self.n_heads} heads, vocab {self.vocab_size}; "
            f"batch {self.batch}x{self.seq_len} tokens per rank"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """A whole benchmark run."""

    workloads: tuple[Workload, ...]
    """Workloads to measure (each gets its own table)."""
    modes: tuple[str, ...] = MODES
    """Modes to compare, from `MODES`."""
    rounds: int = 2
    """Rounds; each round runs every mode once (interleaved, so drift hits all modes alike)."""
    warmup: int = 3
    """Untimed steps at the start of each job (the first one compiles)."""
    steps: int = 10
    """Timed steady-state steps per job (the median is reported)."""
    backend: str = "inductor"
    """Compiler backend for every compiled mode: inductor, aot_eager or eager."""
    world_size: int = 2
    """Ranks per job."""
    bucket_cap_mb: float | None = None
    """DDP bucket cap in MiB for every mode (None: DDP's default of 25)."""
    lr: float = 0.05
    """SGD learning rate (momentum 0.9); SGD keeps the cross-mode loss comparison numerically tame."""
    seed: int = 0
    """Seed for the model init and the synthetic token batches."""
    cold_warm: bool = True
    """Run each compiled mode twice per round: with a fresh Inductor cache dir, then reusing it."""
    scaling: bool = True
    """Also run a 1-rank job per mode per round (same per-rank batch) for scaling efficiency."""
    overlap: bool = True
    """After the last round, run one extra 2-rank job per mode with the overlap recorder attached."""
    overlap_in_main_job: bool = False
    """Attach the recorder in the measured job itself (smoke runs: fewer jobs, no timing claims)."""
    timeout_s: float = 900.0
    """Wall-clock limit of one job; on expiry every rank is killed and the mode is reported as failed."""
    loss_rtol: float = 1e-3
    """Relative tolerance when comparing final losses across modes."""
    loss_atol: float = 1e-4
    """Absolute tolerance when comparing final losses across modes."""
    param_rtol: float | None = None
    """How far a mode's final parameters may end from eager's (the gate; losses agree far too easily):
    `benchmarks.checksum.checksum_distance` of the rank-0 fingerprints, relative to eager's update.
    None picks by backend: 1e-5 for aot_eager/eager, which run eager's kernels (seen: ~1e-7), and 1e-3
    for inductor, whose fused kernels round differently. A mode that skips the all-reduce ends ~0.1-1
    away (each rank follows its own gradient), a mode that doubles the gradient ~1: far outside both."""
    out_dir: Path = Path("bench_out")
    """Where JSON, PNGs and per-job logs go."""
    markdown: Path | None = None
    """Where to write the BENCHMARKS.md report (None: skip)."""
    preset: str = "full"
    """full, quick or smoke (smoke: no timing claims in the report)."""
    command: str = ""
    """The exact command line, recorded in the outputs."""

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("BenchConfig.workloads is empty: pass at least one workload (--workloads compute,comm)")
        names = [w.name for w in self.workloads]
        if len(set(names)) != len(names):
            raise ValueError(f"BenchConfig.workloads has duplicate names {names}; give each workload its own name")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"BenchConfig.modes={list(self.modes)!r}: choose from {list(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"BenchConfig.backend={self.backend!r}: choose from {list(BACKENDS)}")
        for field, minimum in (("rounds", 1), ("warmup", 1), ("steps", 1), ("world_size", 1)):
            value = getattr(self, field)
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"BenchConfig.{field}={value!r}: must be an int >= {minimum}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"BenchConfig.bucket_cap_mb={self.bucket_cap_mb!r}: pass a positive MiB value or omit it")
        if not self.timeout_s > 0:
            raise ValueError(f"BenchConfig.timeout_s={self.timeout_s!r}: pass a positive number of seconds")
        if self.param_rtol is not None and not self.param_rtol > 0:
            raise ValueError(f"BenchConfig.param_rtol={self.param_rtol!r}: pass a positive number or None")
        if self.loss_rtol < 0 or self.loss_atol < 0:
            raise ValueError(f"loss tolerances must be >= 0, got rtol={self.loss_rtol}, atol={self.loss_atol}")
        if self.preset not in ("full", "quick", "smoke"):
            raise ValueError(f"BenchConfig.preset={self.preset!r}: use full, quick or smoke")

    def param_tolerance(self) -> float:
        """`param_rtol`, or the backend's default (see its docstring)."""
        if self.param_rtol is not None:
            return self.param_rtol
        return 1e-3 if self.backend == "inductor" else 1e-5

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["markdown"] = None if self.markdown is None else str(self.markdown)
        return out


def full_workloads(
    *, d_model: int = 384, n_layers: int = 6, n_heads: int = 6, vocab_size: int = 4096,
    compute_batch: tuple[int, int] = (8, 128), comm_batch: tuple[int, int] = (2, 64),
) -> tuple[Workload, ...]:
    """The two standard workloads: compute-heavy and communication-heavy batch on the same model."""
    shape = dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab_size)
    return (
        Workload(name="compute", batch=compute_batch[0], seq_len=compute_batch[1], **shape),
        Workload(name="comm", batch=comm_batch[0], seq_len=comm_batch[1], **shape),
    )


TINY_SHAPE = dict(d_model=128, n_layers=2, n_heads=4, vocab_size=2048)
"""Model used by --quick and --smoke."""
