"""Small models and rank-dependent data shared by the 2-rank test modules."""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH = 64
LAYERS = 5


def mlp(n: int = LAYERS) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, rank: int) -> tuple[torch.Tensor]:
    # Different data on every rank: DDP's average then differs from each rank's own gradient.
    return (torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1000 * rank + step)),)


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class GraphBreak(nn.Module):
    """Two graphs (an explicit break in the middle), three layers each."""

    def __init__(self) -> None:
        super().__init__()
        self.first = mlp(3)
        self.second = mlp(3)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, WIDTH),
            nn.BatchNorm1d(WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, WIDTH),
            nn.BatchNorm1d(WIDTH),
            nn.Tanh(),
            nn.Linear(WIDTH, WIDTH),
        )

    def forward(self, x):
        return self.net(x)


def step_model() -> nn.Sequential:
    """For train_step tests: every parameter gets a real gradient. (A GPT's key bias gets ~0
    gradients, which AdamW normalises into noise-sized updates that no tight comparison survives.)"""
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.GELU()]
    for _ in range(3):
        layers += [nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 8))


def step_data(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]
