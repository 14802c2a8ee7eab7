"""Demo job: a small GPT on synthetic tokens, trained under DDP with the compiled train step.

    python -m launch examples/train_gpt.py                                # 2 gloo ranks on CPU
    python -m launch --nproc-per-node auto examples/train_gpt.py          # one rank per GPU (nccl)
    python -m launch --hang-timeout 300 examples/train_gpt.py             # stop a hung job (exit 3)
    python -m launch --nnodes 2 --nproc-per-node 1 --max-restarts 2 examples/train_gpt.py \
        --checkpoint-dir runs/ckpt                                        # 2 nodes, survives a lost rank
    torchx run -s local_cwd launch/components.py:trainer --script examples/train_gpt.py

Why it exists: it is the end-to-end check that the launcher, DDP and the compile core work together,
and the thing a user copies. `--mode` picks the path:
  * train_step (default): `compile_core.train_step(ddp_model, opt, lm_loss, backend=..., ddp="split")` -
    compiled forward + loss + backward + compiled optimizer update;
  * compile: `compile_core.compile(ddp_model, backend=...)` with an eager optimizer;
  * eager: plain DDP, no compilation (the baseline, and a way to test the launcher alone).
The tokens are walks on a fixed random sparse Markov chain (examples/gpt.py: `markov_batch`; each token is
followed by one of 4 tokens drawn for it), different walks on every rank and step, all from one chain fixed
by `--seed`: the loss starts at ln(vocab) (6.9 for the default 1024 tokens) and falls towards ln 4 = 1.39 as
the model learns the chain, to about a third of where it started within the default 60 steps.
Rank 0 prints the loss of the first step, of every `--print-every`-th step and of the last one, then the
compile report (at the end: DDP's buckets are aligned to the compiled pieces by then), and a summary.
With `--checkpoint-dir`, rank 0
saves the model, optimizer, LR scheduler, step counter and data position every `--checkpoint-every`
steps (atomically: examples/checkpoint.py), and a start resumes from the latest complete checkpoint
there, so `python -m launch --max-restarts K` continues where the job was when a rank died, with the
same parameters an uninterrupted run would have. While the first step compiles,
rank 0 shows one `compile_core:` line per graph piece (compiled, loaded from the cache, or reused from an
identical piece, with seconds) and every rank says when it waits for another rank's compile; `--log-level
WARNING` hides them. The process-group backend comes from DDP_COMPILE_DIST_BACKEND (set by the launcher),
else nccl when this rank has a GPU, else gloo. The model is the `demo` preset of examples/gpt_config.py, with
--d-model, --layers, --vocab and --seq-len replacing its fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import statistics
import sys
import time
from typing import Any

# Run as a script (torchrun puts examples/ first on sys.path) or as -m examples.train_gpt: either way the
# repo root must be importable for `compile_core` and `examples.gpt`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from examples import checkpoint  # noqa: E402
from examples.gpt import GPT, GPT_PRESETS, GPTConfig, lm_loss, markov_batch, markov_floor  # noqa: E402
from launch import heartbeat, restarts  # noqa: E402  (torch-free; no-ops unless launched by python -m launch)

DIST_BACKEND_ENV = "DDP_COMPILE_DIST_BACKEND"
"""The process-group backend (gloo or nccl) python -m launch hands every rank."""
MODES = ("train_step", "compile", "eager")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


_MODEL = GPT_PRESETS["demo"]
"""The demo's model; TrainConfig's model fields default to it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What to train and how; validated on construction."""

    steps: int = 60
    """Optimizer steps to run."""
    batch: int = 8
    """Sequences per rank per step."""
    seq_len: int = _MODEL.max_seq_len
    """Tokens per sequence (the model's position table covers exactly these)."""
    d_model: int = _MODEL.d_model
    """Model width (a multiple of the preset's attention heads)."""
    layers: int = _MODEL.n_layers
    """Transformer blocks."""
    vocab: int = _MODEL.vocab_size
    """Vocabulary size of the synthetic tokens."""
    backend: str = "inductor"
    """torch.compile backend, one of compile_core.BACKENDS: inductor, aot_eager or eager (Dynamo only)."""
    mode: str = "train_step"
    """train_step (everything compiled), compile (model compiled, eager optimizer) or eager."""
    lr: float = 5e-3
    """AdamW learning rate (after the warm-up)."""
    seed: int = 0
    """Seed of the data: the Markov chain every rank samples and each rank's walks of each step."""
    print_every: int = 5
    """Rank 0 prints the loss of step 1, of every step that is a multiple of this, and of the last step."""
    log_level: str = "INFO"
    """Level of the library's log lines (compile progress at INFO); WARNING keeps only problems."""
    checkpoint_dir: str = ""
    """Where rank 0 keeps checkpoints and every start resumes from the latest one; empty: no checkpoints."""
    checkpoint_every: int = 5
    """Steps between checkpoints (with --checkpoint-dir)."""
    warmup_steps: int = 4
    """Steps of linear LR warm-up (the LR scheduler whose state a checkpoint carries)."""

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch",
            "seq_len",
            "d_model",
            "layers",
            "vocab",
            "checkpoint_every",
            "warmup_steps",
            "print_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.seed < 0:
            raise ValueError(f"--seed {self.seed}: must be >= 0")
        if self.d_model % _MODEL.n_heads:
            raise ValueError(
                f"--d-model {self.d_model}: must be a multiple of {_MODEL.n_heads} ({_MODEL.n_heads} attention heads)"
            )
        if self.mode not in MODES:
            raise ValueError(f"--mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.mode != "eager":  # eager compiles nothing and never imports the compile stack (1+ s, Dynamo)
            from compile_core import BACKENDS

            if self.backend not in BACKENDS:
                raise ValueError(f"--backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r}: choose one of {', '.join(LOG_LEVELS)}")

    def data(self) -> str:
        """What the tokens are, as a checkpoint records it: a resume continues only the same stream."""
        return f"markov_batch(vocab={self.vocab}, seq_len={self.seq_len}, batch={self.batch}, seed={self.seed})"

    def gpt(self) -> GPTConfig:
        """The model: the `demo` preset with this config's width, depth, vocabulary and sequence length."""
        return dataclasses.replace(
            _MODEL, vocab_size=self.vocab, d_model=self.d_model, n_layers=self.layers, max_seq_len=self.seq_len
        )


def parse_args(argv: list[str] | None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        default = getattr(defaults, field.name)
        p.add_argument(f"--{field.name.replace('_', '-')}", type=type(default), default=default)
    ns = p.parse_args(argv)
    try:
        return TrainConfig(**vars(ns))
    except ValueError as exc:
        p.error(str(exc))  # exit code 2, one line
        raise  # unreachable: p.error exits


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; returns (rank, world size, device)."""
    backend = os.environ.get(DIST_BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        device = torch.device("cpu")
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def synthetic_batch(
    gcfg: GPTConfig, batch: int, seq_len: int, *, step: int, rank: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step index `step` on `rank`: Markov-chain walks (examples/gpt.py: `markov_batch`), a
    function of (seed, step, rank) only. Looked up by this name at every step, so a wrapper put here
    (tests/multi_gpu/test_nodes_launch.py, benchmarks/nodes_job.py: a rank that dies at a given step) sees
    every batch the demo takes."""
    return markov_batch(gcfg, batch, seq_len, step=step, rank=rank, seed=seed)


def build_step(cfg: TrainConfig, ddp_model: DDP, optimizer: torch.optim.Optimizer, scheduler: Any):
    """Returns (step(x, y) -> loss, report() -> str or None) for the chosen mode."""

    def manual_step(forward):
        # eager optimizer around a (compiled or eager) forward: the baseline a user writes by hand
        def step(x, y):
            loss = lm_loss(forward(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            return loss.detach()

        return step

    if cfg.mode == "eager":
        return manual_step(ddp_model), lambda: None

    import compile_core

    if cfg.mode == "train_step":
        step = compile_core.train_step(
            ddp_model, optimizer, lm_loss, backend=cfg.backend, ddp="split", lr_scheduler=scheduler
        )
        return step, lambda: str(step.report())
    compiled = compile_core.compile(ddp_model, backend=cfg.backend, ddp="split")
    return manual_step(compiled), lambda: str(compiled.report())


def configure_logging(cfg: TrainConfig, rank: int) -> None:
    """Show the library's lines (compile progress: compile_core logs it at INFO on rank 0) on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    for name in ("compile_core", "ddp", "launch"):
        logger = logging.getLogger(name)
        logger.setLevel(cfg.log_level)
        logger.addHandler(handler)
        logger.propagate = False


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    rank, world, device = init_distributed()
    configure_logging(cfg, rank)
    try:
        train(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()


def train(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> None:
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    gcfg = cfg.gpt()
    model = GPT(gcfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(cfg.warmup_steps))
    say = print if rank == 0 else (lambda *a, **k: None)
    start, state = checkpoint.resume(cfg.checkpoint_dir or None, say=lambda m: say(f"train_gpt: {m}", flush=True))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if state["data_step"] != state["step"]:
            raise ValueError(f"checkpoint of step {state['step']} says the data is at step {state['data_step']}")
        if state.get("data") != cfg.data():  # another data stream (or the uniform tokens of older demos)
            raise ValueError(
                f"checkpoint of step {state['step']} was trained on {state.get('data') or 'uniform random tokens'}, "
                f"this run's data is {cfg.data()}: resume with the same flags, or pick a fresh --checkpoint-dir"
            )
        restarts.record_resumed(start, cfg.checkpoint_dir)  # the launcher's summary names the step
    start = start or 0
    if start >= cfg.steps:
        say(f"train_gpt: the checkpoint is at step {start}, --steps is {cfg.steps}: nothing left to train", flush=True)
        return
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    step, report = build_step(cfg, ddp_model, optimizer, scheduler)
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"train_gpt: {world} ranks ({dist.get_backend()}), mode={cfg.mode}, backend={cfg.backend}, "
        f"{n_params / 1e6:.2f}M params, batch {cfg.batch}x{cfg.seq_len} per rank",
        flush=True,
    )
    say(
        f"train_gpt: data: walks on a random sparse Markov chain (seed {cfg.seed}); loss ln({cfg.vocab}) = "
        f"{math.log(cfg.vocab):.2f} knowing nothing, {markov_floor(cfg.vocab):.2f} knowing the chain",
        flush=True,
    )

    tokens_per_step = cfg.batch * cfg.seq_len * world
    times: list[float] = []
    t_start = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for i in range(start, cfg.steps):
        x, y = (t.to(device) for t in synthetic_batch(gcfg, cfg.batch, cfg.seq_len, step=i, rank=rank, seed=cfg.seed))
        t0 = time.perf_counter()
        loss = step(x, y)
        loss_value = loss.item()  # host sync: the step time below covers the whole step
        dt = time.perf_counter() - t0
        # Progress for `python -m launch --hang-timeout`. Compiled modes also beat inside compile_core;
        # this one covers eager mode, and comes after the step so a first-step compile stays in the grace.
        heartbeat.beat()
        times.append(dt)
        if i == start or (i + 1) % cfg.print_every == 0 or i + 1 == cfg.steps:
            say(
                f"step {i + 1:4d}/{cfg.steps}  loss {loss_value:.4f}  {dt * 1e3:8.1f} ms  "
                f"{tokens_per_step / dt:10.0f} tok/s",
                flush=True,
            )
        if cfg.checkpoint_dir and (i + 1) % cfg.checkpoint_every == 0 and i + 1 < cfg.steps:
            save_checkpoint(cfg, rank, i + 1, model, optimizer, scheduler)
    total = time.perf_counter() - t_start
    steady = times[1:] or times  # step 1 includes compilation
    median = statistics.median(steady)
    first_note = " (includes compile)" if cfg.mode != "eager" else ""
    if cfg.checkpoint_dir:
        save_checkpoint(cfg, rank, cfg.steps, model, optimizer, scheduler)  # the final state, for a later run
    # Once, at the end: DDP's buckets are aligned to the compiled pieces by the second step's forward, so
    # a report taken any earlier would say "DDP bucket alignment: pending" (it still does after one step).
    if (text := report()) is not None:
        say(f"compile report (rank 0):\n{text}", flush=True)
    say(
        f"summary: {len(times)} steps in {total:.1f}s; first step {times[0] * 1e3:.0f} ms{first_note}; "
        f"median step after that {median * 1e3:.1f} ms = {tokens_per_step / median:.0f} tok/s over {world} ranks; "
        f"final loss {loss.item():.4f}",
        flush=True,
    )


class _Warmup:
    """Linear LR warm-up over `steps` steps, then constant (a picklable LambdaLR factor)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


def save_checkpoint(
    cfg: TrainConfig, rank: int, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """Rank 0 writes the state after `step` steps; the others wait for it (a checkpoint is a step boundary)."""
    if rank == 0:
        state = {
            "step": step,
            "data_step": step,
            "data": cfg.data(),
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        path = checkpoint.save(cfg.checkpoint_dir, step, state)
        print(f"train_gpt: checkpoint of step {step} written ({path})", flush=True)
    heartbeat.beat()
    dist.barrier()


if __name__ == "__main__":
    main()
