"""The per-parameter update graph that `optimizer_in_backward=True` splices into the compiled backward
(compile_core/in_backward/), run on its own: one process, no process group."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from compile_core.events import CompileEvents
from compile_core.in_backward.optimizer import OptimizerInBackward
from compile_core.in_backward.splice import FusedKernel, UpdateTemplate
from compile_core.step import chunk_math, optim_math


def _after_one_eager_step(kind: str, beta1: float) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(8, 16))
    optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind](
        [param], lr=1e-2, betas=(beta1, 0.99), weight_decay=0.1, foreach=False
    )
    param.grad = torch.randn(8, 16)
    optimizer.step()  # update 1 runs eagerly and creates the state, as in train_step
    return param, optimizer


def _apply_template(updates: OptimizerInBackward, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """What the spliced graph does for one parameter: its row of the table, its update, its step count."""
    template = updates.template_for(param)
    assert template is not None
    _, table, row = updates.scalar_table(param)
    roles = [param.data, grad] + updates.state_tensors([(param, k) for k in template.state_keys]) + [table[row]]
    inputs: list = [None] * len(template.positions)
    for role, position in zip(roles, template.positions):
        if position is not None:
            inputs[position] = role
    template.graph(*inputs)
    updates.advance_steps(frozenset({id(param)}))


@pytest.mark.compat  # the GPU machine's torch is 2.11: the math spliced into its backward is checked there too
@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_the_spliced_adam_update_matches_torchs_step(kind, beta1):
    """Both of lerp's formulas for the first moment (beta1 above and below 0.5) give torch's update."""
    param, optimizer = _after_one_eager_step(kind, beta1)
    ref_param, ref_optimizer = _after_one_eager_step(kind, beta1)
    updates = OptimizerInBackward(optimizer)
    updates.prepare()  # captures the template and this update's scalars
    grad = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    _apply_template(updates, param, grad)
    ref_param.grad = grad.clone()
    ref_optimizer.step()
    # Bit for bit from torch 2.13, whose capture keeps `addcmul` (compile_core/step/optim_math.py, Notes);
    # 2.11's decomposes it into a mul and an add, two roundings: there, within one at the inputs' scale.
    torch.testing.assert_close(param.data, ref_param.data, rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        mine, theirs = optimizer.state[param][key], ref_optimizer.state[ref_param][key]
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")


def test_the_first_moment_formula_is_fixed_when_the_template_is_captured():
    """No per-element choice between lerp's formulas in the spliced graph (5 nodes per parameter fewer,
    which the compile of a graph with one update per parameter pays for), and a beta1 that crosses 0.5
    is a structural change that takes the update back to the normal path, with the reason."""
    param, optimizer = _after_one_eager_step("adamw", 0.9)
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    template = updates.template_for(param)
    targets = [n.target for n in template.graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.where.self not in targets, targets
    optimizer.param_groups[0]["betas"] = (0.4, 0.99)
    assert "low_lerp" in (updates.changed_hyperparameters() or "")


FUSED_OPTIONS = {
    "adam": {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False, "maximize": False},
    "adamw": {"beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8, "amsgrad": False, "maximize": False},
    "sgd": {
        "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0, "nesterov": False, "maximize": False,
        "is_first_step": False,
    },
}  # fmt: skip


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
def test_a_contiguous_parameter_is_updated_by_torchs_fused_kernel_a_strided_or_bf16_one_by_the_update_graph(kind):
    """The fused kernel walks each tensor as flat memory, so it only takes parameters laid out as their
    bucket's gradient views (contiguous), and rounds a bf16 update once where eager rounds per op; Adam's L2
    decay and AdamW's decoupled decay pick their kernel."""
    torch.manual_seed(0)
    dense, strided = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6, 4).t())
    low = nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16))
    make = {
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
    }[kind]
    optimizer = make([dense, strided, low], lr=1e-2)
    for p in (dense, strided, low):
        p.grad = torch.randn_like(p)
    optimizer.step()
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    kernel = updates.update_for(dense)
    assert isinstance(kernel, FusedKernel), kernel
    assert kernel.op is getattr(torch.ops.aten, f"_fused_{kind}_").tensor_lr
    assert dict(kernel.options) == FUSED_OPTIONS[kind]
    assert kernel.state_keys == (("momentum_buffer",) if kind == "sgd" else ("exp_avg", "exp_avg_sq"))
    assert isinstance(updates.update_for(strided), UpdateTemplate)
    assert isinstance(updates.update_for(low), UpdateTemplate)
    assert updates.fused_groups() == [0]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_bf16_parameter_takes_the_fused_kernel_where_the_users_step_is_that_kernel(kind):
    """With `fused=True` the user's own step rounds a bf16 update once, as the kernel does; the update graph
    would round per op."""
    torch.manual_seed(0)
    low = nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16))
    make = torch.optim.AdamW if kind == "adamw" else functools.partial(torch.optim.SGD, momentum=0.9)
    optimizer = make([low], lr=1e-2, fused=True)
    low.grad = torch.randn_like(low)
    optimizer.step()
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    assert isinstance(updates.update_for(low), FusedKernel)
    assert updates.fused_groups() == [0] and updates.update_graph_groups() == []


@pytest.mark.parametrize("fused", [None, False])
def test_a_group_that_says_fused_false_takes_the_update_graph_not_the_fused_kernel(fused):
    """`fused=False` is the user's word that their step is not torch's fused kernel: inside the backward the
    group's update is the captured update graph (the backend's kernels), as the step after the backward is
    compiled for it; left to choose (None), an fp32 group takes the fused kernel."""
    torch.manual_seed(0)
    wide = nn.Parameter(torch.randn(4, 6))
    optimizer = torch.optim.AdamW([wide], lr=1e-2, foreach=True, fused=fused)
    wide.grad = torch.randn_like(wide)
    optimizer.step()
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    if fused is False:
        assert isinstance(updates.update_for(wide), UpdateTemplate)
        assert updates.fused_groups() == [] and updates.update_graph_groups() == [
            {"group": 0, "dtype": "float32", "device": "cpu", "params": 1}
        ]
    else:
        assert isinstance(updates.update_for(wide), FusedKernel) and updates.fused_groups() == [0]


def test_a_bf16_parameter_takes_the_fused_kernel_where_the_backend_rounds_its_update_once():
    """Inductor compiles a bf16 update graph into one kernel that rounds once, as torch's fused kernel does
    (`half_on_kernel`); run op by op (aot_eager) the graph rounds as eager's step, and the report names it."""
    torch.manual_seed(0)
    low, wide = nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16)), nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([low, wide], lr=1e-2, foreach=True)
    for p in (low, wide):
        p.grad = torch.randn_like(p)
    optimizer.step()
    op_by_op = OptimizerInBackward(optimizer)
    op_by_op.prepare()
    assert isinstance(op_by_op.update_for(low), UpdateTemplate)
    assert op_by_op.update_graph_groups() == [{"group": 0, "dtype": "bfloat16", "device": "cpu", "params": 1}]
    rounds_once = OptimizerInBackward(optimizer, half_on_kernel=True)
    rounds_once.prepare()
    assert isinstance(rounds_once.update_for(low), FusedKernel)
    assert rounds_once.update_graph_groups() == []


def test_values_a_schedule_moved_since_update_1_keep_the_update_graph_later_changes_are_named():
    """betas, weight decay and eps are constants of the fused kernel in the compiled backward: a group whose
    values moved between update 1 and the compile (a schedule that moves them every update) keeps the update
    graph, which reads them as inputs; a change after the compile moves the group to that graph for good and
    asks for one more compile (a new generation)."""
    param, optimizer = _after_one_eager_step("adamw", 0.9)
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    optimizer.param_groups[0]["betas"] = (0.85, 0.99)
    assert updates.moved_constants() == [] and updates.generation == 0  # no backward holds them yet
    assert isinstance(updates.update_for(param), UpdateTemplate) and updates.fused_groups() == []
    param, optimizer = _after_one_eager_step("adamw", 0.9)
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    assert isinstance(updates.update_for(param), FusedKernel)
    optimizer.param_groups[0]["lr"] = 5e-3  # an input: changes nothing
    assert updates.moved_constants() == [] and updates.generation == 0
    optimizer.param_groups[0]["weight_decay"] = 0.2
    assert updates.changed_hyperparameters() is None  # not structural: the update stays in the backward
    assert updates.moved_constants() == ["param group 0 changed weight_decay 0.1 -> 0.2"]
    assert updates.generation == 1 and updates.fused_groups() == []
    assert isinstance(updates.update_for(param), UpdateTemplate)
    optimizer.param_groups[0]["weight_decay"] = 0.3  # the update graph reads it: no further compile
    assert updates.moved_constants() == [] and updates.generation == 1


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_the_chunked_update_gets_its_scalar_rows_on_the_parameters_device(opt_cls):
    # A CUDA kernel handed a CPU tensor fails at launch (seen on an H100: "CUDA driver error: invalid
    # argument" in the first compiled update); the meta device stands in for the GPU here.
    params = [nn.Parameter(torch.empty(4, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.empty(4, device="meta")
    optimizer = opt_cls(params, lr=0.1, **({"momentum": 0.9} if opt_cls is torch.optim.SGD else {}))
    states = [
        {"momentum_buffer": None}
        if opt_cls is torch.optim.SGD
        else {
            "step": torch.tensor(0.0),
            "exp_avg": torch.empty(4, device="meta"),
            "exp_avg_sq": torch.empty(4, device="meta"),
        }
        for _ in params
    ]
    arguments = chunk_math.chunk_arguments(optimizer, 0, params, states)
    rows = [a for a in arguments if isinstance(a, torch.Tensor)]
    assert len(rows) == 1 and rows[0].shape[0] == len(params)
    assert rows[0].device.type == "meta"


def test_the_spliced_update_handles_scalar_and_one_element_parameters_like_torchs_step():
    """A 0-dim parameter (a learned temperature or scale) and a 1-element one take the template captured on a
    small stand-in of the group's first parameter: the math is elementwise, whatever the shape."""

    def setup() -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(shape)) for shape in ((8, 16), (), (1,), (5,))]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        optimizer.step()  # update 1 creates the state, as in train_step
        return params, optimizer

    (params, optimizer), (refs, ref_optimizer) = setup(), setup()
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    for p, ref in zip(params, refs):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7 + p.numel()))
        _apply_template(updates, p, grad)
        ref.grad = grad.clone()
    ref_optimizer.step()
    for p, ref in zip(params, refs):
        torch.testing.assert_close(p.data, ref.data, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optimizer.state[p][key], ref_optimizer.state[ref][key], rtol=1e-6, atol=1e-7)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 2, bias=False)  # the rest: 3 parameters, a block 2

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.norm(x))


def test_the_update_compiled_ahead_on_stand_ins_is_the_one_update_1_needs():
    """`ChunkedUpdate.compile_ahead` (what ranks other than 0 of a one-graph job run before their first
    forward) compiles each distinct chunk on stand-ins, touching neither the parameters nor the optimizer
    state; update 1 (eager) then finds every chunk compiled, and update 2 runs it like torch's step."""
    from compile_core.step.chunked_update import ChunkedUpdate

    def setup():
        torch.manual_seed(0)
        model = _Blocks()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, optimizer = setup()
    ref_model, ref_optimizer = setup()
    compiled: list[bool] = []

    def counting(gm, example_inputs):
        compiled.append(any(isinstance(x, torch.SymInt) for x in example_inputs))
        return gm.forward

    names = {id(p): n for n, p in model.named_parameters()}
    update = ChunkedUpdate(optimizer, names, counting, CompileEvents(breaks_from="counters", name="update"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert update.compile_ahead() == 2 and len(compiled) == 2  # the blocks' chunk (once) and the rest
    # Both static: the second chunk compiled through the same function is not made dynamic, so its graph
    # (and cache key) does not depend on which chunk a rank compiled first.
    assert compiled == [False, False], compiled
    assert [r["ahead"] for r in update.records] == [True, True]
    assert not optimizer.state
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m in (model, ref_model):
            m(x).square().sum().backward()
        update(step + 1)
        ref_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
    assert len(compiled) == 2, compiled  # update 1's keys were the stand-ins' keys: nothing compiled again
    for (n, p), ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7, msg=n)


def test_the_chunk_gets_its_gradients_at_storage_offset_zero_over_the_same_memory():
    """A gradient that sits in its bucket's storage reaches the compiled chunk as an alias at offset 0: the
    compile caches key an input's offset, so a compile on stand-ins (offset 0) is found for the real one."""
    bucket = torch.zeros(40)
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(8))]
    params[0].grad = bucket[4:20].view(4, 4)
    params[1].grad = bucket[24:32]
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad.normal_()
    optimizer.step()
    states = [optimizer.state[p] for p in params]
    grads = chunk_math.chunk_arguments(optimizer, 0, params, states)[1]
    for grad, p in zip(grads, params):
        assert grad.storage_offset() == 0 and grad.data_ptr() == p.grad.data_ptr()
        assert grad.shape == p.grad.shape and grad.stride() == p.grad.stride()
        torch.testing.assert_close(grad, p.grad, rtol=0, atol=0)


def test_the_next_step_of_each_parameter_is_read_as_torch_counts_it():
    """`state["step"] + 1` per parameter, from counts that may sit on different devices (read once per device)."""
    from compile_core.step import optim_math

    counts = [torch.tensor(3.0), torch.tensor(0.0), torch.tensor(41.0)]
    assert optim_math.next_steps(counts) == [4.0, 1.0, 42.0]
    assert optim_math.next_steps([]) == []


def test_step_counts_the_host_advanced_are_not_read_back_until_someone_else_writes_them(monkeypatch):
    """`KnownSteps`: a count is read once; after the host's own advance it is vouched for (no read, no
    dispatched op, no device sync); a write by anyone else (same tensor, new version) or a new tensor (a
    loaded state) is read again."""
    from compile_core.step import optim_math

    reads = []
    real = optim_math.next_steps
    monkeypatch.setattr(optim_math, "next_steps", lambda counts: reads.append(len(counts)) or real(counts))
    a, b = torch.tensor(3.0), torch.tensor(7.0)
    known = optim_math.KnownSteps()
    assert known.next_steps([(1, a), (2, b)]) == [4.0, 8.0] and reads == [2]
    known.advance([(1, a), (2, b)])
    assert (float(a), float(b)) == (4.0, 8.0)
    assert known.next_steps([(1, a), (2, b)]) == [5.0, 9.0] and reads == [2]  # vouched for: nothing read
    b.zero_()  # torch's own step, or a user rewinding the bias correction
    assert known.next_steps([(1, a), (2, b)]) == [5.0, 1.0] and reads == [2, 1]
    c = torch.tensor(10.0)  # a loaded state: another tensor under the same key
    assert known.next_steps([(1, c), (2, b)]) == [11.0, 1.0] and reads == [2, 1, 1]
    b.add_(1)  # written between the read and the host's advance: not vouched for after it
    known.advance([(2, b)])
    assert known.next_steps([(2, b)]) == [3.0] and reads == [2, 1, 1, 1]


def test_a_table_of_step_counts_the_host_advanced_is_answered_without_a_look_at_each_count(monkeypatch):
    """`KnownSteps.next_steps_of`: before the forward (where a GPU waits for the host) a table whose counts the
    host itself advanced is answered from what it expects; a count written by anyone else, one the host did not
    advance, or another tensor in its place sends the table back to the per-count path."""
    from compile_core.step import optim_math

    per_count = []
    real = optim_math.KnownSteps.next_steps
    monkeypatch.setattr(optim_math.KnownSteps, "next_steps", lambda self, c: per_count.append(len(c)) or real(self, c))
    a, b = torch.tensor(3.0), torch.tensor(7.0)
    known = optim_math.KnownSteps()
    assert known.next_steps_of("t", [1, 2], [a, b]) == [4.0, 8.0] and per_count == [2]
    assert known.next_steps_of("t", [1, 2], [a, b]) == [4.0, 8.0] and per_count == [2]  # nothing moved
    known.advance([(1, a), (2, b)])
    assert known.next_steps_of("t", [1, 2], [a, b]) == [5.0, 9.0] and per_count == [2]
    b.zero_()  # torch's own step, or a user rewinding the bias correction
    assert known.next_steps_of("t", [1, 2], [a, b]) == [5.0, 1.0] and per_count == [2, 2]
    known.advance([(1, a)])  # only one of the table's counts
    assert known.next_steps_of("t", [1, 2], [a, b]) == [6.0, 1.0] and per_count == [2, 2, 2]
    c = torch.tensor(10.0)  # a loaded state: another tensor under the same key
    assert known.next_steps_of("t", [1, 2], [c, b]) == [11.0, 1.0] and per_count == [2, 2, 2, 2]
    b.add_(1)  # written between the read and the host's advance
    known.advance([(1, c), (2, b)])
    assert known.next_steps_of("t", [1, 2], [c, b]) == [12.0, 3.0] and per_count == [2, 2, 2, 2, 2]


def test_a_param_group_shares_one_scalar_table_and_step_counts_advance_on_the_host():
    """Every input of the compiled backward costs host time at each call: the update reads one table of
    scalars per param group and device (a row per parameter, each for that parameter's own step count), and
    the step counts are not graph inputs; they advance after the backward, only for the parameters it updated."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4)) for _ in range(3)]
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.9), foreach=False)
    for p in params:
        p.grad = torch.randn(4)
    optimizer.step()
    optimizer.state[params[1]]["step"].fill_(5.0)  # counts may differ (a parameter that joined late)
    updates = OptimizerInBackward(optimizer)
    updates.prepare()
    slots = [updates.scalar_table(p) for p in params]
    assert len({key for key, _, _ in slots}) == 1 and len({id(table) for _, table, _ in slots}) == 1
    _, table, _ = slots[0]
    assert [row for _, _, row in slots] == [0, 1, 2] and table.shape == (3, len(optim_math.ADAM_SCALARS))
    # column 5 is -lr / (1 - beta1 ** step) for the step each parameter reaches: 2, 6, 2
    expected = [-1e-2 / (1 - 0.8**s) for s in (2, 6, 2)]
    torch.testing.assert_close(table[:, 5], torch.tensor(expected), rtol=1e-6, atol=0)
    assert all("step" not in t.state_keys for t in updates._templates.values())
    updates.advance_steps(frozenset({id(params[0]), id(params[1])}))
    assert [float(optimizer.state[p]["step"]) for p in params] == [2.0, 6.0, 1.0]
