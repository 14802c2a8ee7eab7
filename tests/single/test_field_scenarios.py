"""Cases PyTorch's own DDPOptimizer tests and user reports exercise: strides, layouts, unbacked sizes,
parameters used through methods. World size 1 (gloo); compared with eager DDP."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import compile_core
from tests.single.ddp_helpers import run_against_eager

pytestmark = pytest.mark.usefixtures("pg")
BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)]


class Transposed(nn.Module):
    """Each piece hands a non-contiguous (transposed) tensor to the next one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x).transpose(0, 1)
        h = self.b(h.relu()).transpose(0, 1)
        return self.c(h)


class Convs(nn.Module):
    """Convolutions, where Inductor may pick another memory layout for a piece's outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8 if i else 3, 8, 3, padding=1) for i in range(4))

    def forward(self, x):
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x


class MethodWeights(nn.Module):
    """Parameters reached through `.t()` and `torch.mm`, not through nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(32, 32) / 6)
        self.w2 = nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        return torch.mm(torch.mm(x, self.w1.t()).relu(), self.w2.t())


class UnbackedSize(nn.Module):
    """A size read from data (`.item()`) in one piece and used in the next."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, n):
        k = n.item()
        torch._check_is_size(k)
        torch._check(k <= x.shape[0])
        return self.b(self.a(x)[:k])


def fixed(*tensors):
    return lambda step: tensors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make,inputs,pieces",
    [
        (Transposed, (torch.randn(4, 6, 64),), 3),
        (Convs, (torch.randn(2, 3, 16, 16),), 4),
        (MethodWeights, (torch.randn(4, 32),), 2),
    ],
    ids=["transposed", "convs", "method_weights"],
)
def test_pieces_pass_real_strides_and_layouts(make, inputs, pieces, backend):
    _, report = run_against_eager(make, fixed(*inputs), backend=backend, bucket_cap_mb=0.0001)
    assert [g["pieces"] for g in report["graphs"]] == [pieces]
    assert report["fallbacks"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbacked_size_crosses_a_piece_boundary(backend):
    inputs = (torch.randn(6, 32), torch.tensor(4))
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        _, report = run_against_eager(UnbackedSize, lambda step: inputs, backend=backend, bucket_cap_mb=0.0001)
    assert [g["pieces"] for g in report["graphs"]] == [2]
    assert report["graph_breaks"] == [] and report["fallbacks"] == []


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.a(x).relu())


class MixedDtypes(nn.Module):
    def __init__(self, low: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.low = low
        self.a, self.c = nn.Linear(16, 16), nn.Linear(16, 16)
        self.b = nn.Linear(16, 16).to(low)

    def forward(self, x):
        return self.c(self.b(self.a(x).to(self.low)).float())


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.a.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x).relu())


def x16(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step))


def test_unused_parameter_with_find_unused_parameters():
    _, report = run_against_eager(
        WithUnused, x16, steps=3, backend="aot_eager", bucket_cap_mb=0.0001, ddp_kwargs={"find_unused_parameters": True}
    )
    # the parameter no graph uses still gets a bucket of its own, so DDP never waits for it
    assert report["alignment"]["buckets"][-1] == ["unused.bias", "unused.weight"]


def test_buckets_never_mix_dtypes():
    # Tight (outputs and gradients, every step): the bf16 layer runs the same bf16 kernel compiled or not;
    # a piece computing it in fp32 would land outside (checked below on the eager model).
    _, report = run_against_eager(MixedDtypes, x16, steps=3, backend="aot_eager", bucket_cap_mb=1, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    bf16 = MixedDtypes()
    fp32 = MixedDtypes(low=torch.float32)
    fp32.load_state_dict(bf16.state_dict())
    assert not torch.allclose(bf16(x16(0)), fp32(x16(0)), rtol=1e-4, atol=1e-5), "bf16 made no difference"
    # one 25 MiB-style cap would hold all three layers; the bf16 layer forces cuts on both sides
    assert [b["params"] for b in report["graphs"][0]["buckets"]] == [
        ["c.weight", "c.bias"],
        ["b.weight", "b.bias"],
        ["a.weight", "a.bias"],
    ]
    assert report["alignment"]["status"] == "aligned"


def test_frozen_parameters_are_not_bucketed():
    _, report = run_against_eager(Frozen, x16, steps=2, backend="aot_eager", bucket_cap_mb=0.0001)
    assert [b["params"] for b in report["graphs"][0]["buckets"]] == [["b.weight", "b.bias"]]


def test_eval_after_training_keeps_the_aligned_buckets():
    make = lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))  # noqa: E731
    compiled, _, ref = run_against_eager(make, x16, steps=2, backend="aot_eager", bucket_cap_mb=0.0001, with_ref=True)
    compiled.eval()
    ref.eval()
    with torch.no_grad():
        out, expected = compiled(x16(5)), ref(x16(5))
    report = compiled.report()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # the trained eager DDP model's output
    assert [g.pieces for g in report.graphs] == [2, 2]  # the no-grad graph, split the same way
    assert report.notes == []


def _two_losses_retaining_the_graph(model: nn.Module, params: list, steps: int = 3) -> None:
    """A multi-task loop: each loss back-propagates on its own through one forward (`retain_graph=True`)."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    for step in range(steps):
        out = model(x16(step))
        out.pow(2).mean().backward(retain_graph=True)
        out.abs().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("wrap", ["plain", "ddp_split", "ddp_in_graph"])
def test_a_backward_that_retains_the_graph_runs_as_under_torch_compile(wrap):
    """`torch.compile(backend="aot_eager")` compiles each backward at the first backward and, when that one
    retains the graph, donates no saved tensor; ours compile the backward with the forward, and until
    session 65 AOTAutograd refused the retaining backward ("compiled with non-empty donated buffers")."""
    make = lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))  # noqa: E731
    torch.manual_seed(0)
    ours, ref = make(), make()
    ref.load_state_dict(ours.state_dict())
    if wrap == "plain":
        model = compile_core.compile(ours, backend="aot_eager")
        eager = ref
    else:
        # world size 1: DDP reduces nothing across ranks, and its reducer (split) or our in-graph all-reduce
        # (in_graph) still runs once per backward; the 2-rank case is in tests/multi_gpu/test_compile_multirank.py
        # two buckets, [the last two layers] and [the first]: split's second piece keeps an activation of its
        # own for the backward
        model = compile_core.compile(DDP(ours, bucket_cap_mb=0.003), backend="aot_eager", ddp=wrap[4:])
        eager = DDP(ref, bucket_cap_mb=0.003)
    initial = ours[0].weight.detach().clone()
    _two_losses_retaining_the_graph(model, list(ours.parameters()))
    _two_losses_retaining_the_graph(eager, list(ref.parameters()))
    assert not torch.equal(ours[0].weight, initial), "nothing trained"
    if wrap == "ddp_split":
        assert [g.pieces for g in model.report().graphs] == [2]
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
