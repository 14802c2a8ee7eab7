"""Canaries of ddp/torch_ddp.py and ddp/torch_ddp_reducer.py: DDP's hooks, flags and reducer, the functional
collectives, the default store (what a canary is: tests/single/torch_internals_helpers.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp import torch_ddp, torch_ddp_reducer
from tests.single.torch_internals_helpers import canary, two_layers

pytestmark = pytest.mark.usefixtures("pg")


# -- ddp/torch_ddp.py + ddp/torch_ddp_reducer.py ----------------------------------------------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_hidden_from_dynamo_clears_and_restores_the_active_module_slot():
    with canary("ddp/torch_ddp.py:hidden_from_dynamo"):
        ddp = two_layers()
        DDP._active_ddp_module = ddp
        try:
            with torch_ddp.hidden_from_dynamo():
                assert DDP._get_active_ddp_module() is None
            assert DDP._get_active_ddp_module() is ddp
        finally:
            DDP._active_ddp_module = None


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_active_ddp_module_is_the_ddp_model_whose_forward_runs():
    with canary("ddp/torch_ddp.py:active_ddp_module"):
        ddp = DDP(nn.Linear(2, 2))
        seen = []
        ddp.module.register_forward_pre_hook(lambda module, args: seen.append(torch_ddp.active_ddp_module()))
        ddp(torch.randn(1, 2))
        assert seen == [ddp]
        assert torch_ddp.active_ddp_module() is None


def test_comm_hooks_lists_registered_hooks():
    with canary("ddp/torch_ddp.py:comm_hooks"):
        ddp = two_layers()
        state = object()

        def hook(state, bucket):
            return torch.futures.Future()

        ddp.register_comm_hook(state, hook)
        assert torch_ddp.comm_hooks(ddp) == [(hook, state)]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_builtin_comm_hooks_are_seen_through_ddps_logger():
    with canary("ddp/torch_ddp.py:builtin_comm_hook"):
        ddp = two_layers()
        assert torch_ddp.builtin_comm_hook(ddp) is None
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        assert torch_ddp.builtin_comm_hook(ddp) is None  # a Python hook is listed in _comm_hooks
        other = two_layers()
        other._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.FP16_COMPRESS)
        assert "FP16" in torch_ddp.builtin_comm_hook(other)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_compress_wrappers_reveal_their_dtype_and_inner_hook():
    with canary("ddp/torch_ddp.py:compress_wrapper_parts"):
        assert torch_ddp.compress_wrapper_parts(default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)) == (
            torch.float16,
            default_hooks.allreduce_hook,
        )
        assert torch_ddp.compress_wrapper_parts(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)) == (
            torch.bfloat16,
            default_hooks.allreduce_hook,
        )
        assert torch_ddp.compress_wrapper_parts(default_hooks.fp16_compress_hook) is None


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_static_graph_ddp_queues_no_delayed_reduce_once_marked():
    with canary("ddp/torch_ddp.py:keep_static_graph_reducer_idle"):
        ddp = DDP(nn.Linear(4, 4), static_graph=True)
        torch_ddp.keep_static_graph_reducer_idle(ddp)
        with ddp.no_sync():  # the reducer is not prepared: a queued _delay_all_reduce would assert
            ddp(torch.randn(2, 4)).sum().backward()
        assert ddp._static_graph_delay_allreduce_enqueued is True


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_ignored_names_are_ddps_parameters_to_ignore():
    with canary("ddp/torch_ddp.py:ignored_names"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["1.weight"])
        assert torch_ddp.ignored_names(DDP(model)) == frozenset({"1.weight"})


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_join_is_seen_on_the_ddp_object():
    with canary("ddp/torch_ddp.py:join_enabled"):
        ddp = two_layers()
        assert not torch_ddp.join_enabled(ddp)
        with ddp.join():
            assert torch_ddp.join_enabled(ddp)
        off = two_layers()
        with off.join(enable=False):
            assert not torch_ddp.join_enabled(off)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_gradient_hooks_on_a_parameter_are_seen_until_removed():
    with canary("ddp/torch_ddp.py:has_gradient_hooks"):
        p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
        assert not torch_ddp.has_gradient_hooks(p)
        handle = p.register_hook(lambda g: g.clamp(-1, 1))
        q.register_post_accumulate_grad_hook(lambda t: None)
        assert torch_ddp.has_gradient_hooks(p) and torch_ddp.has_gradient_hooks(q)
        handle.remove()
        assert not torch_ddp.has_gradient_hooks(p)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_reducer_params_are_the_parameters_ddps_reducer_was_built_with_in_order():
    with canary("ddp/torch_ddp.py:reducer_params"):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
        module[1].bias.requires_grad_(False)  # frozen when DDP wraps it: DDP never reduces it
        ddp = DDP(module)
        expected = [p for p in module.parameters() if p.requires_grad]
        module[2].weight.requires_grad_(False)  # frozen after: DDP's reducer holds it (and reduces it once unfrozen)
        params, sparse = torch_ddp.reducer_params(ddp)
        assert [id(p) for p in params] == [id(p) for p in expected]
        assert sparse == [False] * len(expected)
        assert [id(p) for p in torch_ddp.reducer_params(ddp)[0]] == [id(p) for p in expected]  # the same later
        assert len(ddp._build_params_for_reducer()[0]) == len(expected) - 1  # what DDP's own method says now


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_reducer_params_flag_sparse_gradients():
    with canary("ddp/torch_ddp.py:reducer_params"):
        ddp = DDP(nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 4)))
        params, sparse = torch_ddp.reducer_params(ddp)
        assert [id(p) for p in params] == [id(p) for p in ddp.module.parameters()]
        assert sparse == [True, False, False]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("static_graph", [True, False])
def test_reducer_swap_blocker_reads_ddp_flags(static_graph):
    with canary("ddp/torch_ddp_reducer.py:reducer_swap_blocker"):
        ddp = DDP(nn.Linear(4, 4), static_graph=static_graph)
        assert torch_ddp_reducer.reducer_swap_blocker(ddp) is None  # static_graph is reproduced (install_reducer)
        # the flags it reads are DDP's, off by default (DDP's mixed precision needs CUDA streams: not built here)
        assert ddp._use_python_reducer is False and ddp.mixed_precision is None and not ddp._delay_all_reduce_params
        ddp._delay_all_reduce_params = [ddp.module.weight]
        assert torch_ddp_reducer.reducer_swap_blocker(ddp).option == "delayed_all_reduce"


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11's DDP has no batched_grad_copy: not passed there).
def test_reducer_takes_our_keywords():
    with canary("ddp/torch_ddp_reducer.py:_new_reducer (install_reducer, release_reducer_buckets)"):
        doc = torch.distributed.Reducer.__init__.__doc__
        source = inspect.getsource(torch_ddp_reducer._new_reducer)
        for keyword in (
            "params",
            "bucket_indices",
            "per_bucket_size_limits",
            "process_group",
            "expect_sparse_gradients",
            "bucket_bytes_cap",
            "find_unused_parameters",
            "gradient_as_bucket_view",
            "param_to_name_mapping",
            "first_bucket_bytes_cap",
            "skip_all_reduce_unused_params",
            "use_python_reducer",
            "bucket_bytes_cap_list",
        ):
            assert f"{keyword}=" in source
            assert f"{keyword}:" in doc, f"Reducer no longer takes {keyword}="
        # DDP's batched_grad_copy option (torch 2.13) reaches the Reducer wherever DDP has it
        assert '"batched_grad_copy"' in source
        if "batched_grad_copy" in inspect.signature(DDP.__init__).parameters:
            assert "batched_grad_copy:" in doc, "Reducer no longer takes batched_grad_copy="


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_release_reducer_buckets_leaves_ddp_working_with_an_idle_one_element_reducer():
    with canary("ddp/torch_ddp_reducer.py:release_reducer_buckets + ddp/torch_ddp.py:reducer_bucket_elements"):
        ddp = two_layers()
        params, _ = torch_ddp.reducer_params(ddp)
        assert torch_ddp.reducer_bucket_elements(ddp) == sum(p.numel() for p in params)
        assert torch_ddp_reducer.release_reducer_buckets(ddp) == sum(p.numel() * 4 for p in params)
        assert torch_ddp.reducer_bucket_elements(ddp) == 1
        for _ in range(2):  # DDP's forward and an un-synchronised backward still run
            with ddp.no_sync():
                ddp(torch.randn(3, 8)).sum().backward()
        assert all(p.grad is not None for p in params)
        assert ddp._get_ddp_logging_data()["module_name"] == type(ddp.module).__name__


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_restore_reducer_buckets_gives_a_released_ddp_real_buckets_that_reduce():
    with canary("ddp/torch_ddp_reducer.py:restore_reducer_buckets"):
        ddp = two_layers()
        params, _ = torch_ddp.reducer_params(ddp)
        torch_ddp_reducer.release_reducer_buckets(ddp)
        seen: list[list[int]] = []

        def hook(state, bucket):
            seen.append([p.numel() for p in bucket.parameters()])
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        torch_ddp_reducer.restore_reducer_buckets(ddp)
        assert torch_ddp.reducer_bucket_elements(ddp) == sum(p.numel() for p in params)
        ddp(torch.randn(3, 8)).sum().backward()
        assert seen == [[2, 16, 8, 64]]  # one fp32 bucket, the last layer's parameters first
        assert all(p.grad is not None for p in params)


def record_bucket_sizes(ddp: DDP) -> list[int]:
    """A comm hook on `ddp` that reduces nothing and lists how many parameters each bucket it sees holds."""
    seen: list[int] = []

    def hook(state, bucket):
        seen.append(len(bucket.parameters()))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    return seen


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_install_reducer_gives_ddp_our_buckets_and_keeps_hooks():
    with canary("ddp/torch_ddp_reducer.py:install_reducer"):
        ddp = two_layers()
        seen = record_bucket_sizes(ddp)
        params, sparse = torch_ddp.reducer_params(ddp)
        layout = [[2, 3], [0, 1]]  # last layer's weight+bias first, as gradients become ready
        assert torch_ddp_reducer.install_reducer(ddp, params, sparse, layout)  # frozen: DDP will not re-cut it
        for _ in range(3):  # DDP would rebuild after the first backward; the layout must survive it
            ddp(torch.randn(3, 8)).sum().backward()
        assert seen == [2, 2] * 3
        assert ddp._has_rebuilt_buckets


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_static_graph_ddp_gets_a_static_reducer_on_our_buckets():
    with canary(
        "ddp/torch_ddp_reducer.py:install_reducer (static_graph), cut_static_layout + "
        "ddp/torch_ddp.py:queue_static_graph_first_backward"
    ):
        ddp = DDP(two_layers().module, static_graph=True)
        seen = record_bucket_sizes(ddp)
        ddp(torch.randn(3, 8)).sum().backward()  # DDP's own reducer: its static first backward
        assert seen == [4]
        params, sparse = torch_ddp.reducer_params(ddp)
        assert torch_ddp_reducer.install_reducer(ddp, params, sparse, [[2, 3], [0, 1]])
        assert ddp._get_ddp_logging_data().get("static_graph") == 1, "the new reducer's logger is not static"
        torch_ddp.queue_static_graph_first_backward(ddp)
        ddp(torch.randn(3, 8)).sum().backward()  # its static first: one bucket, reduced at the end
        assert ddp._static_graph_delay_allreduce_enqueued is True
        assert torch_ddp_reducer.cut_static_layout(ddp)
        for _ in range(3):
            ddp(torch.randn(3, 8)).sum().backward()
            with ddp.no_sync():  # accumulation between them leaves the reducer alone
                ddp(torch.randn(3, 8)).sum().backward()
        assert seen == [4, 4, 2, 2, 2, 2, 2, 2]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_functional_all_reduce_ops_run_and_sum():
    with canary("ddp/torch_ddp.py:functional_all_reduce_ops/functional_all_reduce_sum"):
        all_reduce, wait_tensor = torch_ddp.functional_all_reduce_ops()
        assert isinstance(all_reduce, torch._ops.OpOverload) and isinstance(wait_tensor, torch._ops.OpOverload)
        group = torch.distributed.group.WORLD
        t = torch.arange(4.0)
        torch.testing.assert_close(wait_tensor(all_reduce(t, "sum", group.group_name)), t)  # one rank: the identity
        torch.testing.assert_close(torch_ddp.functional_all_reduce_sum(t * 2, group) + 0, t * 2)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_pending_wait_runs_inside_wait_tensor_once_and_groups_resolve_by_name():
    with canary("ddp/torch_ddp.py:register_pending/resolve_group"):
        group = torch.distributed.group.WORLD
        assert torch_ddp.resolve_group(group.group_name) is group
        _, wait_tensor = torch_ddp.functional_all_reduce_ops()
        t = torch.zeros(3)
        calls = []
        torch_ddp.register_pending(t, lambda: (calls.append(1), t.add_(5)))
        assert calls == []  # nothing runs before the wait
        out = wait_tensor(t)
        assert calls == [1] and torch.equal(out, torch.full((3,), 5.0))
        wait_tensor(t)  # the work was taken by the first wait
        assert calls == [1]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_default_store_and_the_end_of_backward_queue():
    with canary("ddp/torch_ddp.py:default_store/queue_end_of_backward"):
        store = torch_ddp.default_store()
        store.set("canary", b"1")
        assert store.get("canary") == b"1"
        order = []
        w = torch.randn(2, requires_grad=True)
        y = (w * 2).sum()
        y.register_hook(lambda g: torch_ddp.queue_end_of_backward(lambda: order.append("end")) or None)
        w.register_hook(lambda g: order.append("grad") or None)
        y.backward()
        assert order == ["grad", "end"]
