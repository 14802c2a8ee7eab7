"""Benchmark configuration: modes, optimizers and a whole run (`BenchConfig`, over the workloads of
benchmarks/workloads.py). Everything is validated on construction."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.workloads import Workload

if TYPE_CHECKING:
    from benchmarks.link import LinkShape

DEFAULT_MODES: tuple[str, ...] = (
    "floor",
    "comm_only",
    "eager",
    "torch_ddpopt",
    "torch_nosplit",
    "torch_python_reducer",
    "torch_reducer_overlap",
    "torch_savvy",
    "torch_fused",
    "torch_savvy_one_rank",
    "torch_savvy_megacache",
    "ours_compile",
    "ours_in_graph",
    "ours_step",
    "ours_step_in_graph",
    "ours_step_in_graph_auto",
    "ours_step_in_backward",
)
"""What a run compares when `--modes` is not given, in table order (the bracket first)."""

VARIANT_MODES: tuple[str, ...] = (
    "ours_step_in_graph_unfused",
    "ours_step_in_backward_unfused",
    "ours_step_in_backward_cpp",
)
"""Our in-graph train steps with one option changed, for the GPU benchmark's questions (issue 34): run when
`--modes` names them, not by default."""

MODES: tuple[str, ...] = DEFAULT_MODES + VARIANT_MODES
"""Every mode, in table order."""

MODE_HELP: dict[str, str] = {
    "floor": "bracket, lower end: torch.compile(model) + torch.compile'd optimizer.step() on every rank at once, "
    "no DDP and no communication (each rank trains its own copy)",
    "comm_only": "bracket, communication: the all-reduce of DDP's buckets for this model and cap (same sizes and "
    "dtype), issued back to back asynchronously and waited for, nothing else",
    "eager": "eager DDP + eager optimizer",
    "torch_ddpopt": "torch.compile(ddp_model), PyTorch's DDPOptimizer (optimize_ddp=True) + eager optimizer",
    "torch_nosplit": "torch.compile(ddp_model), optimize_ddp=False (one graph, no overlap) + eager optimizer",
    "torch_python_reducer": "compiled autograd + optimize_ddp='python_reducer' + eager optimizer",
    "torch_savvy": "torch.compile(ddp_model) (DDPOptimizer) + torch.compile'd optimizer.step(): the strongest "
    "PyTorch-only setup",
    "torch_fused": "torch.compile(ddp_model) (DDPOptimizer) + the optimizer's fused step (fused=True), eagerly: "
    "no update compiled, as train_step runs a foreach Adam/AdamW",
    "torch_reducer_overlap": "compiled autograd + optimize_ddp='python_reducer', the backward's all-reduces bucketed "
    "and placed by Inductor's overlap scheduler (collective_bucketing) instead of DDP's concat fusion, + "
    "torch.compile'd optimizer.step()",
    "torch_savvy_one_rank": "start-up: torch_savvy with compile_on_one_rank (torch 2.14); rank 0 compiles the "
    "model's pieces in a no_sync forward+backward inside step 1 and ships torch.compiler.save_cache_artifacts() "
    "to the other ranks, which load it before compiling",
    "torch_savvy_megacache": "start-up: torch_savvy in an empty Inductor cache dir per job; step 1 first loads "
    "the mega-cache (save_cache_artifacts) an earlier job of this mode saved (its warm job: a new machine "
    "given the artifacts)",
    "ours_compile": "compile_core.compile(ddp_model) (ddp='split') + eager optimizer",
    "ours_in_graph": "compile_core.compile(ddp_model, ddp='in_graph') + eager optimizer",
    "ours_step": "compile_core.train_step (ddp='split'; forward+backward+optimizer captured)",
    "ours_step_in_graph": "compile_core.train_step(ddp='in_graph')",
    "ours_step_in_graph_auto": "compile_core.train_step(ddp='in_graph', bucket_cap_mb='auto'): the cap chosen "
    "from an all-reduce timed on the process group",
    "ours_step_in_backward": "compile_core.train_step(ddp='in_graph', optimizer_in_backward=True)",
    "ours_step_in_graph_unfused": "ours_step_in_graph with fused=False on the optimizer: the update after the "
    "backward compiled by the backend (Inductor's kernels, as torch.compile(opt.step) makes them) instead of "
    "torch's fused kernel",
    "ours_step_in_backward_unfused": "ours_step_in_backward with fused=False on the optimizer: each bucket's update "
    "inside the backward is the captured update graph, compiled with the backward, instead of torch's fused kernel",
    "ours_step_in_backward_cpp": "ours_step_in_backward with Inductor's C++ wrapper (options={'cpp_wrapper': True}): "
    "each compiled graph's call runs in C++, not Python (needs the default torch.compile mode)",
}

IN_GRAPH_MODES = frozenset(
    {
        "ours_in_graph",
        "ours_step_in_graph",
        "ours_step_in_graph_auto",
        "ours_step_in_backward",
        *VARIANT_MODES,
    }
)
"""Modes whose compiled backward all-reduces itself: DDP's comm hooks (the overlap recorder) see nothing."""

BRACKET_MODES = ("floor", "comm_only")
"""Modes that bracket the others' step time (benchmarks/bracket.py): they do not train like eager DDP, so the
loss and parameter gates skip them (labelled in the tables), and they get no 1-rank or overlap jobs."""

NO_COMPILE_MODES = frozenset({"eager", "comm_only"})
"""Modes that compile nothing: one job per round, no cold/warm pair."""

COMM_HOOKS = ("fp16",)
"""What --comm-hook registers on every mode's DDP object (fp16: DDP's fp16_compress_hook). bf16_compress_hook
is refused by DDP without CUDA + NCCL, so it is not offered."""

REDUCE_DTYPES = ("bf16", "fp16")
"""What --reduce-dtype passes as reduce_dtype= to our ddp='in_graph' modes."""

AUTOCAST_DTYPES = ("bf16",)
"""What --autocast accepts: bf16 (fp16 autocast needs loss scaling, which only train_step's grad_scaler= offers)."""

AUTOCAST_PARAM_RTOL = 5e-2
"""Parameter-gate tolerance under --autocast bf16: every mode rounds its matmuls to bf16, compiled kernels fuse
(and round) differently from eager's. Not yet measured against a run: a guess between the 16-bit wire's 3e-2
and a mode that skips the all-reduce (0.1-1)."""

REDUCED_WIRE_PARAM_RTOL = {"bf16": 3e-2, "fp16": 1e-2}
"""Parameter-gate tolerance of the --reduce-dtype modes: they all-reduce in 16 bits, eager (the reference) in
fp32, so they end measurably apart. Seen on the smoke run (SGD, aot_eager, 3 steps): bf16 1.4e-3, fp16 2.7e-4;
a rank that skips the all-reduce lands at 0.1-1, still well outside."""


OPTIMIZERS: dict[str, dict[str, Any]] = {
    # SGD keeps the cross-mode parameter gate sharp: its update is linear in the gradient, so a wrong
    # all-reduce scale shows up. AdamW is what the issue-11/12 comparisons are about (per-parameter state,
    # the optimizer-in-backward case); its defaults are torch's (betas 0.9/0.999, eps 1e-8, wd 0.01).
    "sgd": {"lr": 0.05, "momentum": 0.9},
    "adamw": {"lr": 1e-3, "weight_decay": 0.01},
}
"""Optimizer name -> its keyword arguments in every mode (lr is the default; BenchConfig.lr overrides it)."""

OPTIMIZER_CLASSES = {"sgd": "SGD", "adamw": "AdamW"}
"""Optimizer name -> its torch.optim class name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """A whole benchmark run."""

    workloads: tuple[Workload, ...]
    """Workloads to measure (each gets its own table)."""
    modes: tuple[str, ...] = DEFAULT_MODES
    """Modes to compare, from `MODES` (default: `DEFAULT_MODES`, every mode but the variants)."""
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
    """DDP bucket cap in MiB for workloads without their own (None: DDP's default of 25)."""
    optimizer: str = "sgd"
    """Optimizer of every mode, from `OPTIMIZERS`: sgd (momentum 0.9) or adamw."""
    lr: float | None = None
    """Learning rate (None: the optimizer's default in `OPTIMIZERS`: sgd 0.05, adamw 1e-3). Constant: no scheduler."""
    seed: int = 0
    """Seed for the model init and the synthetic token batches."""
    cold_warm: bool = True
    """Run each compiled mode twice per round: with a fresh Inductor cache dir, then reusing it."""
    scaling: bool = True
    """Also run a 1-rank job per mode per round (same per-rank batch) for scaling efficiency."""
    overlap: bool = True
    """Measure overlap: a separate job per mode (recorder + profiler), or inside the main job (see below)."""
    overlap_in_main_job: bool = False
    """Measure overlap in the measured job itself (quick/smoke runs: fewer jobs, profiled steps are extra)."""
    profile_steps: int = 2
    """Steps profiled with torch.profiler for the profiler overlap and the step's tensor peak (0: none)."""
    timeout_s: float = 900.0
    """Wall-clock limit of one job; on expiry every rank is killed and the mode is reported as failed."""
    loss_rtol: float = 1e-3
    """Relative tolerance when comparing final losses across modes."""
    loss_atol: float = 1e-4
    """Absolute tolerance when comparing final losses across modes."""
    param_rtol: float | None = None
    """How far a mode's final parameters may end from eager's (the gate; losses agree far too easily):
    `benchmarks.checksum.checksum_distance` of the rank-0 fingerprints, relative to eager's update.
    None picks by backend and optimizer (`param_tolerance`). SGD: 1e-5 for aot_eager/eager, which run
    eager's kernels (seen: 0 to 1e-7), 1e-3 for inductor, whose fused kernels round differently. AdamW
    divides every gradient element by its own running scale, so rounding in near-zero gradients is
    amplified up to lr/eps per unit (seen 1e-5..5e-5 on aot_eager after 3 steps): 1e-3 and 1e-2. A mode
    that skips the all-reduce ends ~0.5-1 away with either optimizer (each rank follows its own gradient);
    a doubled gradient ~1 with SGD, but AdamW is blind to a gradient's scale (~3e-4), which is why the
    smoke run uses SGD."""
    plot: bool = True
    """Draw the step-time chart and overlap timelines (needs matplotlib; checked before any job runs)."""
    out_dir: Path = Path("bench_out")
    """Where JSON, PNGs and per-job logs go."""
    markdown: Path | None = None
    """Where to write the BENCHMARKS.md report (None: skip)."""
    preset: str = "full"
    """full, quick or smoke (smoke: no timing claims in the report)."""
    command: str = ""
    """The exact command line, recorded in the outputs."""
    link_gbit: float | None = None
    """Shape the loopback of every job to this many Gbit/s, in a network namespace per job (None: plain loopback)."""
    comm_hook: str | None = None
    """DDP comm hook registered on every mode's DDP object: None or 'fp16' (`COMM_HOOKS`); floor has no DDP."""
    reduce_dtype: str | None = None
    """reduce_dtype= of our ddp='in_graph' modes: None, 'bf16' or 'fp16' (`REDUCE_DTYPES`); other modes unchanged."""
    compile_mode: str | None = None
    """torch.compile mode of every compiled mode, ours and PyTorch's ('reduce-overhead': CUDA graphs); None: default."""
    nested_regions: bool = False
    """Mark each GPT block's forward `torch.compiler.nested_compile_region` (every mode): a block traced once."""
    autocast: str | None = None
    """Run every mode's forward and loss under `torch.autocast(device, bfloat16)` ('bf16', `AUTOCAST_DTYPES`):
    eager and PyTorch's modes wrap them, train_step modes get `autocast=torch.bfloat16`; None: fp32."""
    compile_threads: int | None = 1
    """TORCHINDUCTOR_COMPILE_THREADS of every rank (1: each rank compiles its C++ in-process, so the breakdown
    sees every C++ compile); None leaves torch's default (the CPU count), what a user gets."""

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("BenchConfig.workloads is empty: pass at least one workload (--workloads compute,comm)")
        names = [w.name for w in self.workloads]
        if len(set(names)) != len(names):
            raise ValueError(f"BenchConfig.workloads has duplicate names {names}; give each workload its own name")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"BenchConfig.modes={list(self.modes)!r}: choose from {list(MODES)}")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"BenchConfig.modes={list(self.modes)!r} names a mode twice; list each mode once")
        from compile_core import BACKENDS  # one list of backends; imported late: it imports torch

        if self.backend not in BACKENDS:
            raise ValueError(f"BenchConfig.backend={self.backend!r}: choose from {list(BACKENDS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"BenchConfig.optimizer={self.optimizer!r}: choose from {list(OPTIMIZERS)} (--optimizer)")
        for field, minimum in (("rounds", 1), ("warmup", 1), ("steps", 1), ("world_size", 1), ("profile_steps", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"BenchConfig.{field}={value!r}: must be an int >= {minimum}")
        threads = self.compile_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(
                f"BenchConfig.compile_threads={self.compile_threads!r}: pass an int >= 1, or None for torch's default"
            )
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"BenchConfig.bucket_cap_mb={self.bucket_cap_mb!r}: pass a positive MiB value or omit it")
        if self.lr is not None and not self.lr > 0:
            defaults = ", ".join(f"{name} {kwargs['lr']:g}" for name, kwargs in OPTIMIZERS.items())
            raise ValueError(
                f"BenchConfig.lr={self.lr!r}: pass a positive learning rate, or None for the "
                f"optimizer's default ({defaults})"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"BenchConfig.timeout_s={self.timeout_s!r}: pass a positive number of seconds")
        if self.param_rtol is not None and not self.param_rtol > 0:
            raise ValueError(f"BenchConfig.param_rtol={self.param_rtol!r}: pass a positive number or None")
        if self.loss_rtol < 0 or self.loss_atol < 0:
            raise ValueError(f"loss tolerances must be >= 0, got rtol={self.loss_rtol}, atol={self.loss_atol}")
        if self.preset not in ("full", "quick", "smoke"):
            raise ValueError(f"BenchConfig.preset={self.preset!r}: use full, quick or smoke")
        self._check_link_and_reduction()
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(
                f"BenchConfig.autocast={self.autocast!r}: use None or one of {list(AUTOCAST_DTYPES)} (--autocast bf16; "
                "fp16 autocast needs loss scaling, not offered here)"
            )
        if self.compile_mode is not None:
            from inductor.torch_inductor import mode_names

            if self.compile_mode not in mode_names():
                raise ValueError(
                    f"BenchConfig.compile_mode={self.compile_mode!r}: use None or one of {list(mode_names())} "
                    "(--compile-mode)"
                )
            if self.backend != "inductor":
                raise ValueError(
                    f"--compile-mode {self.compile_mode} needs --backend inductor (torch.compile takes a mode for "
                    f"Inductor only), got --backend {self.backend}: drop one of them"
                )

    def _check_link_and_reduction(self) -> None:
        if self.link_gbit is not None:
            from benchmarks.link import LinkShape

            LinkShape(rate_gbit=self.link_gbit)  # validates the rate, naming --link-gbit
        if self.comm_hook is not None:
            if self.comm_hook not in COMM_HOOKS:
                raise ValueError(
                    f"BenchConfig.comm_hook={self.comm_hook!r}: use None or one of {list(COMM_HOOKS)} "
                    "(--comm-hook none|fp16; DDP refuses bf16_compress_hook without CUDA + NCCL)"
                )
            if set(self.modes) <= {"floor"}:
                raise ValueError(
                    f"--comm-hook {self.comm_hook} changes none of the modes {list(self.modes)} (floor "
                    "has no DDP object): add a DDP mode to --modes or drop --comm-hook"
                )
        if self.reduce_dtype is not None:
            if self.reduce_dtype not in REDUCE_DTYPES:
                raise ValueError(
                    f"BenchConfig.reduce_dtype={self.reduce_dtype!r}: use None or one of "
                    f"{list(REDUCE_DTYPES)} (--reduce-dtype bf16|fp16)"
                )
            if not IN_GRAPH_MODES & set(self.modes):
                raise ValueError(
                    f"--reduce-dtype {self.reduce_dtype} applies to {sorted(IN_GRAPH_MODES)} only, and "
                    f"none of them is in --modes {','.join(self.modes)}: add one or drop --reduce-dtype"
                )
            if self.comm_hook is not None and self.comm_hook != self.reduce_dtype:
                raise ValueError(
                    f"--reduce-dtype {self.reduce_dtype} conflicts with --comm-hook {self.comm_hook} "
                    f"(the in-graph modes would all-reduce in {self.comm_hook}, as the hook says, and "
                    "compile_core refuses the pair): drop one of them"
                )

    def link(self) -> LinkShape | None:
        """The loopback shaping of every job (None: the plain loopback)."""
        from benchmarks.link import LinkShape

        return None if self.link_gbit is None else LinkShape(rate_gbit=self.link_gbit)

    def param_tolerance(self) -> float:
        """`param_rtol`, or the backend's default (see its docstring)."""
        if self.param_rtol is not None:
            return self.param_rtol
        exact_kernels = self.backend != "inductor"
        if self.optimizer == "adamw":
            base = 1e-3 if exact_kernels else 1e-2
        else:
            base = 1e-5 if exact_kernels else 1e-3
        return max(base, AUTOCAST_PARAM_RTOL) if self.autocast is not None else base

    def param_tolerances(self) -> dict[str, float]:
        """Modes gated at another tolerance than `param_tolerance()`: with --reduce-dtype our in-graph modes
        (`REDUCED_WIRE_PARAM_RTOL`, or `param_tolerance()` where that is looser)."""
        if self.reduce_dtype is None:
            return {}
        loose = max(self.param_tolerance(), REDUCED_WIRE_PARAM_RTOL[self.reduce_dtype])
        return {m: loose for m in self.modes if m in IN_GRAPH_MODES}

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the optimizer every mode builds (the lr override applied)."""
        kwargs = dict(OPTIMIZERS[self.optimizer])
        if self.lr is not None:
            kwargs["lr"] = self.lr
        return kwargs

    def describe_optimizer(self) -> str:
        args = ", ".join(f"{k}={v:g}" for k, v in self.optimizer_kwargs().items())
        return f"{OPTIMIZER_CLASSES[self.optimizer]}({args})"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["markdown"] = None if self.markdown is None else str(self.markdown)
        out["optimizer_kwargs"] = self.optimizer_kwargs()
        return out
