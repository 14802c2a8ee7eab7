"""A small GPT-like model on synthetic tokens, shared by the demo job, the benchmark and the tests.

No downloads: tokens come from seeded generators. Two kinds:
  * `synthetic_batch`: uniform random tokens. Nothing to learn (the loss stays at ln(vocab)); the benchmark
    and the tests use it, where only the shapes and the arithmetic matter.
  * `markov_batch`: walks on a fixed random sparse Markov chain, which a small GPT learns within tens of
    steps; the demo (examples/train_gpt.py) trains on it so that its printed loss shows learning.
The model's shape (`GPTConfig`) and its named presets (`GPT_PRESETS`) live in examples/gpt_config.py, which
imports no torch; both are re-exported here.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.gpt_config import GPT_PRESETS, GPTConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "MARKOV_BRANCHING",
    "RegionBlock",
    "lm_loss",
    "markov_batch",
    "markov_floor",
    "markov_successors",
    "synthetic_batch",
]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class RegionBlock(Block):
    """`Block` whose forward is a `torch.compiler.nested_compile_region`: Dynamo traces it once and calls
    the traced region per layer. Decorated on the class, as users do: under torch 2.13, the same region
    bound to each instance with `types.MethodType` traced and gave outputs far from eager's, silently."""

    forward = torch.compiler.nested_compile_region(Block.forward)


class GPT(nn.Module):
    """Token + position embeddings, `n_layers` blocks, a final norm and an untied LM head; `regions=True`
    builds `RegionBlock`s."""

    def __init__(self, cfg: GPTConfig, *, regions: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList((RegionBlock if regions else Block)(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a (batch, seq, vocab) logits tensor."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def synthetic_batch(
    cfg: GPTConfig, batch: int, seq_len: int, *, step: int, rank: int = 0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input, target) token batch for a given step and rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


MARKOV_BRANCHING = 4
"""How many distinct tokens may follow each token in `markov_batch`'s chain (fewer when the vocabulary is smaller)."""


@functools.cache
def _successors(vocab_size: int, branching: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
    while True:  # redraw the rows that picked a successor twice (terminates: branching <= vocab_size)
        ordered = succ.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if not repeated.any():
            return succ
        succ[repeated] = torch.randint(0, vocab_size, (int(repeated.sum()), branching), generator=g)


def markov_successors(vocab_size: int, *, seed: int = 0, branching: int = MARKOV_BRANCHING) -> torch.Tensor:
    """The chain of `markov_batch`: row v holds the distinct tokens that may follow token v, each taken with
    the same probability. A function of its arguments only (the same on every rank and in every run); a
    copy, so callers may change it."""
    if vocab_size < 1 or branching < 1:
        raise ValueError(f"vocab_size={vocab_size}, branching={branching}: both must be >= 1")
    return _successors(vocab_size, min(branching, vocab_size), seed).clone()


def markov_floor(vocab_size: int, *, branching: int = MARKOV_BRANCHING) -> float:
    """The lowest next-token loss a model can reach on `markov_batch` away from a sequence's first token:
    ln(successors per token)."""
    return math.log(min(branching, vocab_size))


def markov_batch(
    cfg: GPTConfig,
    batch: int,
    seq_len: int,
    *,
    step: int,
    rank: int = 0,
    seed: int = 0,
    branching: int = MARKOV_BRANCHING,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (input, target) batch for a given step and rank, with structure to learn.

    Every row is a walk on one fixed sparse Markov chain (`markov_successors(cfg.vocab_size, seed=seed)`):
    it starts at a uniformly drawn token and each next token is one of the current token's `branching`
    successors, uniformly. Every rank and step draws its own walks from the same chain, so the ranks see
    different data from one distribution; the batch depends on (seed, step, rank) only, so a job resumed at
    step N gets the batches an uninterrupted one would. A model that has learned the chain reaches
    `markov_floor` per token (ln 4 ≈ 1.39), against ln(vocab) for a model that predicts nothing.
    """
    succ = _successors(cfg.vocab_size, min(branching, cfg.vocab_size), seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
    choice = torch.randint(0, succ.shape[1], (batch, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = succ[tokens[:, t], choice[:, t]]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
