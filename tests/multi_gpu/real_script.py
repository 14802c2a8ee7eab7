"""A real training script's loop, written the way nanoGPT's `train.py` drives DDP, run eagerly and through us.

What such a script does to the object `torch.compile(ddp_model)` handed back, and what each run records:
  * the model comes from a class with methods of its own (`configure_optimizers`, `estimate_mfu`), its
    token embedding tied to the output layer, and it returns `(logits, loss)`;
  * the optimizer is built from the raw model before DDP wraps it: AdamW with a decay and a no-decay group;
  * optionally the raw model is compiled before DDP wraps it, `torch.compile(model)` (nanoGPT's `compile=True`)
    or `model.compile()`, with a backend of the script's own that counts its compiles (`SCRIPT_COMPILES`);
  * `raw_model = model.module` is taken from what the compile returned: checkpoints are
    `raw_model.state_dict()`, and `raw_model.estimate_mfu(...)` is logged;
  * gradient accumulation sets `model.require_backward_grad_sync = (micro == last)` on that object instead
    of using `no_sync()`: the gradients after a micro-batch that does not synchronise must stay local;
  * the learning rate follows a cosine schedule written into `param_groups` by hand; the gradients are
    clipped with `clip_grad_norm_` (or not); `zero_grad(set_to_none=True)`;
  * rank 0 alone evaluates under `no_grad` (or `torch.inference_mode`, as Lightning validates) in eval mode
    before the first update and every few updates, and
    the ranks may evaluate different numbers of batches; optionally rank 0 alone runs a forward with
    gradients enabled and no backward (a probe for logging, with the sync flag off: with it on, eager DDP
    itself hangs).
`train_step` variants run the same loop with the micro-batches and clipping given to `compile_core.train_step`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.multi_gpu.ddp_compare import snapshot
from tests.ranks import rank_device, wrap_ddp

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 48, 12, 32, 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT with nanoGPT's surface: `(logits, loss)` out, tied embedding, methods a script calls."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2 does
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    def configure_optimizers(self, lr: float) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    def estimate_mfu(self, tokens_per_iter: int, dt: float) -> float:
        n = sum(p.numel() for p in self.parameters())
        flops_per_iter = (6 * n + 12 * LAYERS * WIDTH * BLOCK) * tokens_per_iter
        return flops_per_iter / max(dt, 1e-9) / 1e12


@dataclasses.dataclass(kw_only=True)
class Loop:
    """One variant of the loop (see the module docstring)."""

    iters: int = 4
    accum: int = 2
    eval_interval: int = 2
    eval_batches: tuple[int, int] = (3, 0)
    """Batches rank 0 and rank 1 evaluate at each evaluation (0: that rank does not evaluate)."""
    eval_under: str = "no_grad"
    """"no_grad" (nanoGPT's `estimate_loss`) or "inference_mode" (Lightning's validation loop)."""
    grad_probe_at: int | None = None
    """At this iteration rank 0 alone runs a forward with gradients and no backward, with DDP's
    `require_backward_grad_sync` off (None: never)."""
    grad_probe_syncs: bool = False
    """The probe leaves `require_backward_grad_sync` on: the eager script hangs so, except with `static_graph`,
    whose DDP's forward has no collective of its own before its buckets are rebuilt."""
    static_graph: bool = False
    """DDP built with `static_graph=True` (its first backward must synchronise: use it with `accum=1`)."""
    batch: int = 4
    lr: float = 3e-3
    clip: float | None = 1.0
    """`clip_grad_norm_` before each update (nanoGPT's `grad_clip`; None: `grad_clip = 0.0`, no clipping)."""
    torch_compiled: str = ""
    """How the script compiles its model before DDP wraps it (backend `script_backend`): "wrapper" (nanoGPT's
    `compile=True`: `model = torch.compile(model)`), "in_place" (`model.compile()`), "" (it does not)."""


SCRIPT_COMPILES: list[int] = []
"""One entry per graph the script's own `torch.compile` compiled, in this process."""


def script_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    """The backend the script's own torch.compile uses: counts, then runs the graph as traced."""
    SCRIPT_COMPILES.append(len(gm.graph.nodes))
    return gm.forward


def cosine_lr(it: int, loop: Loop) -> float:
    warmup = 1
    if it < warmup:
        return loop.lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / max(1, loop.iters - warmup)
    return 0.1 * loop.lr + 0.5 * (1 + math.cos(math.pi * ratio)) * 0.9 * loop.lr


class Batches:
    """Rank-dependent token batches, the same sequence in the eager run and ours."""

    def __init__(self, rank: int, batch: int, device: torch.device) -> None:
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.eval_gen = torch.Generator().manual_seed(2000 + rank)
        self.batch, self.device = batch, device

    def _draw(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, VOCAB, (self.batch, BLOCK + 1), generator=gen)
        return data[:, :-1].contiguous().to(self.device), data[:, 1:].contiguous().to(self.device)

    def train(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(self.gen)

    def eval(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(self.eval_gen)


def grad_fingerprint(module: nn.Module) -> float:
    """One number per parameter set: local gradients differ between ranks, averaged ones do not."""
    return float(sum(p.grad.double().sum() * (i + 1) for i, p in enumerate(module.parameters()) if p.grad is not None))


def estimate_loss(model: nn.Module, batches: Batches, n: int, under: str = "no_grad") -> float:
    model.eval()
    with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[under]():
        losses = [model(*batches.eval())[1].item() for _ in range(n)]
    model.train()
    return sum(losses) / len(losses)


def run_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    loop: Loop,
    *,
    step: Callable[..., torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The loop on `model` (what the script's compile line returned); `step`: a `train_step` doing the
    micro-batches, clipping and update instead of the hand-written ones."""
    raw_model = model.module  # as train.py: the user's model, for checkpoints and its own methods
    batches = Batches(rank, loop.batch, next(model.parameters()).device)
    out: dict[str, Any] = {"losses": [], "evals": [], "local_fingerprints": [], "checkpoint_keys": None}
    x, y = batches.train()
    for it in range(loop.iters):
        lr = cosine_lr(it, loop)
        for group in opt.param_groups:
            group["lr"] = lr
        evaluates = loop.eval_batches[rank]
        if it % loop.eval_interval == 0 and evaluates:
            out["evals"].append(estimate_loss(model, batches, evaluates, loop.eval_under))
            if rank == 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": opt.state_dict(), "iter_num": it}
                out["checkpoint_keys"] = list(checkpoint["model"])
        if loop.grad_probe_at == it and rank == 0:
            # Gradients on, no backward, this rank alone: eager DDP allows it while the forward does not
            # prepare a synchronising backward (with the flag on, the eager script itself hangs).
            model.require_backward_grad_sync = loop.grad_probe_syncs
            out["probe"] = model(*batches.eval())[1].item()
            model.require_backward_grad_sync = True
        for micro in range(loop.accum):
            if step is not None:
                loss = step(x, y, target=None)
                x, y = batches.train()
                out["losses"].append(loss.item())
                continue
            model.require_backward_grad_sync = micro == loop.accum - 1
            _, loss = model(x, y)
            loss = loss / loop.accum
            x, y = batches.train()  # prefetch while the backward runs, as train.py does
            loss.backward()
            out["losses"].append(loss.item() * loop.accum)
            if micro < loop.accum - 1:
                out["local_fingerprints"].append(grad_fingerprint(raw_model))
        if step is None:
            if loop.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["mfu"] = raw_model.estimate_mfu(loop.batch * loop.accum * BLOCK, 1.0)
    out["params"] = {n: t.cpu() for n, t in snapshot(raw_model).items()}
    out["is_ddp"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    # `.module` is what the script wrapped: its model, or torch.compile's wrapper of it
    out["module_is_raw"] = type(getattr(raw_model, "_orig_mod", raw_model)) is TinyGPT
    return out


def fresh(device: torch.device, loop: Loop) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    raw = TinyGPT().to(device)
    opt = raw.configure_optimizers(loop.lr)  # from the raw model, before DDP wraps it
    if loop.torch_compiled == "wrapper":
        raw = torch.compile(raw, backend=script_backend)
    elif loop.torch_compiled == "in_place":
        raw.compile(backend=script_backend)
    return wrap_ddp(raw, static_graph=loop.static_graph), opt


def compiled_run(rank: int, loop: Loop, how: str, **options: Any) -> dict[str, Any]:
    """The loop through compile_core (`how`: "compile" or "train_step"), then the eager script, on this rank."""
    import compile_core

    # A rendezvous the eager script does not have would otherwise wait for the default 900 s.
    os.environ.setdefault("DDP_COMPILE_FIRST_TIMEOUT_S", "45")
    device = rank_device(rank)
    options.setdefault("backend", "aot_eager")
    compiles_before = len(SCRIPT_COMPILES)
    model, opt = fresh(device, loop)
    if how == "compile":
        model = compile_core.compile(model, **options)  # the one line a script changes
        ours = run_loop(model, opt, rank, loop)
    else:
        step = compile_core.train_step(
            model,
            opt,
            lambda output, _: output[1],
            accum_steps=loop.accum,
            clip_grad_norm=loop.clip,
            **options,
        )
        ours = run_loop(model, opt, rank, loop, step=step)
        ours["step_report"] = step.report().to_dict()
    ours["report"] = model.report().to_dict()
    ours["script_compiles"] = len(SCRIPT_COMPILES) - compiles_before
    model, opt = fresh(device, loop)
    eager = run_loop(model, opt, rank, loop)
    eager["script_compiles"] = len(SCRIPT_COMPILES) - compiles_before - ours["script_compiles"]
    return {"ours": ours, "eager": eager}
