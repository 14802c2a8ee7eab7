"""Models, data, losses and hooks of the field scripts the in-graph tests replay (tests/multi_gpu/user_script.py).

Each is a pattern real training scripts contain: an auxiliary loss on a model parameter, a branch that
joins late or leaves, experts switched per step, eager code at a graph break, a custom comm hook.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.multi_gpu.models import WIDTH, mlp

OUT = 8


class Headed(nn.Module):
    """A body and a head: `head.bias` is what auxiliary losses like to touch."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(3)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


class HeadedWithUnused(Headed):
    """`Headed` with a layer no forward uses (a spare head): DDP needs find_unused_parameters or a static graph."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(WIDTH, OUT)


class ResidualBlock(nn.Module):
    """x + tanh(fc(x)): the repeated block of `Stacked`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class RegionBlock(ResidualBlock):
    """`ResidualBlock` whose forward the user marked as a nested compile region (on the class)."""

    forward = torch.compiler.nested_compile_region(ResidualBlock.forward)


class Stacked(nn.Module):
    """3 repeated blocks (`blocks.<i>`) and a head."""

    block = ResidualBlock

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.block() for _ in range(3))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Regioned(Stacked):
    """`Stacked` with the blocks under `torch.compiler.nested_compile_region`: Dynamo traces one block and
    calls it per layer (`invoke_subgraph`), so each block's parameter gradients come out of a subgraph call."""

    block = RegionBlock


class BrokenHeaded(Headed):
    """`Headed` with a graph break between the body and the head: two compiled graphs."""

    def forward(self, x):
        h = torch.tanh(self.body(x))
        torch._dynamo.graph_break()
        return self.head(h)


class TiedAcrossBreak(nn.Module):
    """One layer (`shared`) called before and after a graph break, as a language model ties its input embedding
    to its output head: the layer's parameters are inputs of both compiled graphs, and its gradient is the sum
    of what each graph's backward gives."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.body = mlp(2)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        h = self.body(torch.tanh(self.shared(x)))
        torch._dynamo.graph_break()
        return self.head(torch.tanh(self.shared(h)))


class ConvStem(nn.Module):
    """A convolution stem before a head (a ResNet's or a ViT's patch embedding, in small): Inductor on a CPU with
    oneDNN (and on a GPU for most training graphs) runs convolutions channels-last, converting the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, kernel_size=2, stride=2)
        self.head = nn.Linear(8 * 2 * 2, OUT)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x.view(-1, 4, 4, 4))).flatten(1))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.fc1(x)
        return x + self.fc2(torch.tanh(x))


class ResidualAcrossBreak(nn.Module):
    """Two residual blocks with a graph break between them: the second graph's backward returns the gradient
    of its input, read through `fc1.weight`'s transpose, which nothing after it in that backward needs, so
    Inductor may schedule it last; the update of `fc1.weight` inside that backward must wait for it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Residual(), _Residual()
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.head(self.second(x))


class BlocksWithBreaks(nn.Module):
    """`n` identical residual blocks, the graph broken after each (a log line, a data-dependent check in the
    loop): Dynamo compiles the loop's resume once and runs that one graph for every block after the first,
    each time with that block's parameters; and the backward of each graph after a break returns the
    gradient of its input, which reads the block's weights (`fc1`'s, through a transpose)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"fc1": nn.Linear(WIDTH, WIDTH), "fc2": nn.Linear(WIDTH, WIDTH)}) for _ in range(n)
        )
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = x + block["fc1"](x)
            x = x + block["fc2"](torch.tanh(x))
            torch._dynamo.graph_break()
        return self.head(x)


class _BrokenBody(nn.Module):
    """Two layers with a graph break between them; called with the caller's `shared` layer as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, shared: nn.Module):
        x = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return shared(torch.tanh(self.b(x)))


class SharedAfterNestedBreak(nn.Module):
    """A submodule with a graph break calls `shared`, and the caller calls it again afterwards: Dynamo runs
    the submodule as a frame of its own, whose second graph ends without a break (as the last graph of a
    model does) and is followed by the caller's graph, which takes `shared` too. A Hugging Face model whose
    top-level forward breaks (a logged warning) and that ties its embedding to its head is such a model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.body = _BrokenBody()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        h = self.body(torch.tanh(self.inp(x)), self.shared)
        return self.head(torch.tanh(self.shared(h)))


class Branchy(nn.Module):
    """`extra` runs only while `use_extra` is set (a Python flag: Dynamo compiles one graph per value)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, OUT)
        self.use_extra = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(torch.tanh(self.b(h)))


class Experts(nn.Module):
    """Two experts of the same shape, one used per step (`expert`, a Python int set by the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, OUT)
        self.expert = 0

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.experts[self.expert](h))
        return self.head(h)


class EagerScale(nn.Module):
    """`head.weight` is used in the compiled graph and again by code Dynamo runs eagerly (a disabled frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(2)
        self.head = nn.Linear(WIDTH, OUT)

    @torch.compiler.disable
    def scale(self, h):
        return h * (1 + self.head.weight.mean())

    def forward(self, x):
        h = self.scale(torch.tanh(self.body(x)))
        return self.head(h)


class Mixed(nn.Module):
    """fp32 and bf16 layers: DDP never mixes dtypes in a bucket, nor may an optimizer template."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH).to(torch.bfloat16)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x):
        h = torch.tanh(self.a(x)).to(torch.bfloat16)
        return self.head(torch.tanh(self.b(h)).float())


class SparseBag(nn.Module):
    """A sparse-gradient embedding (`nn.Embedding(sparse=True)`, classic for SGD) under dense layers: DDP gives
    it a bucket of its own, and all-reduces its sparse gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, WIDTH, sparse=True)
        self.body = mlp(1)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, idx):
        return self.head(self.body(self.emb(idx).mean(1)))


def index_data(rank: int, n: int, device: torch.device) -> list:
    """Rows of token ids for `SparseBag`, different on every rank (so are the rows each rank's gradient touches)."""
    g = torch.Generator().manual_seed(200 + rank)
    return [
        ((torch.randint(0, 32, (8, 4), generator=g).to(device),), torch.randn(8, OUT, generator=g).to(device))
        for _ in range(n)
    ]


class MaxNormEmbedding(nn.Module):
    """`nn.Embedding(max_norm=...)`: the forward renormalises the rows it looks up, in place, in the
    parameter itself (rows of norm ~8 at init, so it does). The rows are the same on every rank, so the
    ranks stay equal; what the data change is their gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, WIDTH, max_norm=1.0)
        self.body = mlp(2)
        self.head = nn.Linear(WIDTH, OUT)
        self.register_buffer("rows", torch.arange(0, 16, 2), persistent=False)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x) + self.emb(self.rows).mean(0)))


FROZEN_UNTIL = ("body.0.weight", "body.0.bias")
"""The first layer of `frozen_until_update_3`: frozen when DDP is built, so DDP never reduces it."""


def frozen_until_update_3() -> Headed:
    """Gradual unfreezing: the first layer is frozen when DDP and the optimizer are built (it is in the
    optimizer) and trains from update 3 on (`unfreeze_at_update_3`); torch's step updates it from then on."""
    model = Headed()
    for p in model.body[0].parameters():
        p.requires_grad_(False)
    return model


_MODULE_HOOKS: dict[int, object] = {}  # id(model) -> the handle `module_hooks_change` removes later


def module_hooks_change(model: nn.Module, micro_batch: int) -> None:
    """A `before_step` for `Headed` that changes module hooks after the first compile, as a script that starts
    logging or rescaling activations mid-run does: a forward hook halving `body.0`'s output from micro-batch
    1, a forward pre-hook doubling the head's input from micro-batch 2, the first hook removed at micro-batch
    3. The handles are kept outside the model: touching its attributes would recompile on that alone."""
    if micro_batch == 1:
        _MODULE_HOOKS[id(model)] = model.body[0].register_forward_hook(lambda module, args, out: out * 0.5)
    elif micro_batch == 2:
        model.head.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,))
    elif micro_batch == 3:
        _MODULE_HOOKS.pop(id(model)).remove()


def branch_on_rank_0_first(model: nn.Module, micro_batch: int) -> None:
    """A `before_step` for `Branchy`: `extra` runs on rank 0 alone in the first micro-batch (its data took
    that branch), on every rank after it."""
    model.use_extra = micro_batch > 0 or dist.get_rank() == 0


def branch_from(first: int):
    """A `before_step` that switches `model.use_extra` (Branchy's extra branch) on from micro-batch `first`."""

    def before(model: nn.Module, micro_batch: int) -> None:
        model.use_extra = micro_batch >= first

    return before


def unfreeze_at_update_3(model: nn.Module, micro_batch: int) -> None:
    for p in model.body[0].parameters():
        p.requires_grad_(micro_batch >= 2)


def add_group_at_update_3(model: nn.Module, opt: torch.optim.Optimizer, micro_batch: int) -> None:
    """Lightning's fine-tuning callbacks unfreeze a backbone by adding it to the optimizer as a new param
    group (with its own lr) at some epoch: here the frozen first layer of `frozen_until_update_3`."""
    if micro_batch == 2:
        params = list(model.body[0].parameters())
        for p in params:
            p.requires_grad_(True)
        opt.add_param_group({"params": params, "lr": opt.param_groups[0]["lr"] * 0.3})


LOSES_STATE = ("head.weight", "head.bias")
"""The parameters whose optimizer state `load_checkpoint_without_head_state_at_update_3` drops."""


def clear_optimizer_state_at_update_3(model: nn.Module, opt: torch.optim.Optimizer, micro_batch: int) -> None:
    """A script that resets its optimizer between phases (`optimizer.state.clear()`): torch's next step
    starts every parameter afresh (step 0, zero moments)."""
    if micro_batch == 2:
        opt.state.clear()


def rewind_step_counts_at_update_3(model: nn.Module, opt: torch.optim.Optimizer, micro_batch: int) -> None:
    """A script that restarts Adam's bias correction between phases by writing its step counts in place
    (`state["step"].zero_()`): the same tensors, new values, which torch's next step reads."""
    if micro_batch == 2:
        for state in opt.state.values():
            state["step"].zero_()


def load_checkpoint_without_head_state_at_update_3(
    model: nn.Module, opt: torch.optim.Optimizer, micro_batch: int
) -> None:
    """Resuming from an optimizer checkpoint saved before the head was replaced: the loaded state
    (`load_state_dict`, a new state mapping) has no entries for the head, which starts afresh."""
    if micro_batch == 2:
        checkpoint = copy.deepcopy(opt.state_dict())
        head = {id(p) for n, p in model.named_parameters() if n in LOSES_STATE}
        order = [p for g in opt.param_groups for p in g["params"]]
        for index, p in enumerate(order):
            if id(p) in head:
                checkpoint["state"].pop(index, None)
        opt.load_state_dict(checkpoint)


def regression_data(rank: int, n: int, device: torch.device) -> list:
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    return [
        ((torch.randn(8, WIDTH, generator=g).to(device),), torch.randn(8, OUT, generator=g).to(device))
        for _ in range(n)
    ]


def last_batch_smaller(rank: int, n: int, device: torch.device) -> list:
    """`regression_data` whose last batch is smaller (a dataset that does not divide by the batch size):
    the graph is compiled again with a dynamic batch dimension."""
    data = regression_data(rank, n, device)
    (x,), y = data[-1]
    data[-1] = ((x[:5],), y[:5])
    return data


def aux_on_head_bias(out, target, model, step):
    """mse + a rank-dependent auxiliary term on `head.bias`, computed outside the model (eager code)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    weights = torch.linspace(-1, 1, OUT, device=out.device) * (rank + 1) * (step + 1)
    return torch.nn.functional.mse_loss(out, target) + 0.1 * (model.head.bias * weights).sum()


def aux_on_block_bias(out, target, model, step):
    """mse + a rank-dependent auxiliary term on `blocks.1.fc.bias`: a parameter inside a nested compile
    region (called once per block) that also gets a gradient from eager code outside the model."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    weights = torch.linspace(-1, 1, model.blocks[1].fc.bias.numel(), device=out.device) * (rank + 1) * (step + 1)
    return torch.nn.functional.mse_loss(out, target) + 0.1 * (model.blocks[1].fc.bias * weights).sum()


def regioned_first_block_frozen() -> Regioned:
    """`Regioned` fine-tuned with its first block frozen: the region's parameters get a gradient in two of
    its three calls."""
    model = Regioned()
    model.blocks[0].requires_grad_(False)
    return model


def clamp_grad_hooks(ddp) -> None:
    """Clip-by-value through gradient hooks on the head and the first layer (registered after wrapping):
    eager DDP averages the clamped local gradients, which is not the clamp of the average."""
    for p in [*ddp.module.head.parameters(), *ddp.module.body[0].parameters()]:
        p.register_hook(lambda g: g.clamp(-0.02, 0.02))


class Halve:
    """A custom comm hook's state: DDP's all-reduce, then scale the result by 0.5."""


def halve_hook(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0].mul_(0.5))


def bf16_by_hand(state, bucket):
    """What DDP's bf16_compress_hook does (DDP refuses that hook without CUDA + NCCL, so CPU tests
    use this copy of its steps): cast to bf16, divide by the world size, all-reduce, cast back."""
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size())

    def back(fut):
        buf.copy_(fut.value()[0])
        return buf

    return dist.all_reduce(low, async_op=True).get_future().then(back)
