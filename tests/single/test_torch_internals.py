"""Canaries: one per private torch internal we use (ddp/torch_ddp.py, ddp/torch_ddp_reducer.py,
aot/torch_dynamo.py, aot/torch_graphs.py, aot/torch_eager.py, aot/torch_dynamo_cache.py,
inductor/torch_inductor.py). When a torch upgrade changes one, its canary fails
with a message that names the function to update, instead of a confusing failure deep inside a compile.

The comment above each canary names the torch versions it was run on (CI: the full suite on 2.13.0, this file
and `pytest -m compat` on 2.11.0 and 2.14.1, `.ci/run`) and how they differ where they do."""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from aot import torch_dynamo, torch_eager, torch_graphs
from ddp import torch_ddp, torch_ddp_reducer
from inductor import torch_inductor

pytestmark = pytest.mark.usefixtures("pg")


@contextlib.contextmanager
def canary(home: str):
    """Turn any failure into one line naming the function that mirrors the torch internal."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every failure here means torch changed under us
        raise AssertionError(
            f"torch {torch.__version__} changed what {home} relies on: {type(exc).__name__}: {exc}"
        ) from exc


def two_layers() -> DDP:
    torch.manual_seed(0)
    return DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))


# -- ddp/torch_ddp.py -------------------------------------------------------------------------------


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
def test_the_compiled_functions_autograd_node_and_its_parameter_edges():
    with canary("aot/torch_graphs.py:compiled_backward_node/param_edges"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        out = torch.compile(model, backend="aot_eager")(torch.randn(3, 4))
        node = torch_graphs.compiled_backward_node(out)
        assert node is not None
        assert {id(p) for _, p in torch_graphs.param_edges(node)} == {id(p) for p in model.parameters()}
        assert torch_graphs.compiled_backward_node(torch.randn(2)) is None


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
def test_reducer_params_are_the_trainable_parameters_in_order():
    with canary("ddp/torch_ddp.py:reducer_params"):
        ddp = two_layers()
        ddp.module[0].bias.requires_grad_(False)
        params, sparse = torch_ddp.reducer_params(ddp)
        expected = [p for p in ddp.module.parameters() if p.requires_grad]
        assert [id(p) for p in params] == [id(p) for p in expected]
        assert sparse == [False] * len(expected)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("kwargs, words", [({"static_graph": True}, "static_graph"), ({}, None)])
def test_reducer_swap_blocker_reads_ddp_flags(kwargs, words):
    with canary("ddp/torch_ddp_reducer.py:reducer_swap_blocker"):
        ddp = DDP(nn.Linear(4, 4), **kwargs)
        blocker = torch_ddp_reducer.reducer_swap_blocker(ddp)
        assert (blocker is None) if words is None else (blocker.option == words and words in blocker.text)


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
def test_install_reducer_gives_ddp_our_buckets_and_keeps_hooks():
    with canary("ddp/torch_ddp_reducer.py:install_reducer"):
        ddp = two_layers()
        seen: list[int] = []

        def hook(state, bucket):
            seen.append(len(bucket.parameters()))
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        params, sparse = torch_ddp.reducer_params(ddp)
        layout = [[2, 3], [0, 1]]  # last layer's weight+bias first, as gradients become ready
        assert torch_ddp_reducer.install_reducer(ddp, params, sparse, layout)  # frozen: DDP will not re-cut it
        for _ in range(3):  # DDP would rebuild after the first backward; the layout must survive it
            ddp(torch.randn(3, 8)).sum().backward()
        assert seen == [2, 2] * 3
        assert ddp._has_rebuilt_buckets


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


# -- aot/torch_dynamo.py ----------------------------------------------------------------------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11 has no isolate_recompiles: not passed there).
def test_guard_hook_reports_the_reason_of_a_recompile():
    with canary("aot/torch_dynamo.py:compile_with_guard_hook"):
        failures: list[tuple[str, str]] = []
        fn = torch_dynamo.compile_with_guard_hook(
            lambda x: x * 2,
            "eager",
            on_guard_fail=lambda reason, where: failures.append((reason, where)),
            dynamic=False,
            isolate_recompiles=True,
        )
        fn(torch.randn(3))
        fn(torch.randn(5))
        assert failures and "size" in failures[0][0].lower(), failures


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_lookup_backend_and_restart_and_error_types():
    with canary("aot/torch_dynamo.py:lookup_backend/RestartAnalysis/DynamoError"):
        assert callable(torch_dynamo.lookup_backend("aot_eager"))
        assert issubclass(torch_dynamo.RestartAnalysis, Exception)
        assert issubclass(torch_dynamo.DynamoError, Exception)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_modules_call_can_be_replaced_and_bypassed_like_module_compile_does():
    with canary("aot/torch_eager.py:installed_compiled_call/install_compiled_call/call_uncompiled"):
        compiled = nn.Linear(2, 2)
        assert torch_eager.installed_compiled_call(compiled) is None
        compiled.compile(backend="eager")
        assert torch_eager.installed_compiled_call(compiled) is not None
        module, hooked = nn.Linear(2, 2), []
        module.register_forward_hook(lambda mod, args, out: hooked.append(out.shape))
        torch_eager.install_compiled_call(module, lambda *args, **kwargs: "replaced")
        assert torch_eager.installed_compiled_call(module) is not None
        assert module(torch.randn(1, 2)) == "replaced" and hooked == []
        x = torch.randn(3, 2)
        torch.testing.assert_close(torch_eager.call_uncompiled(module, x), module.forward(x))
        assert hooked == [torch.Size([3, 2])]  # hooks run, as in a plain call


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_operators_are_told_from_other_callables():
    with canary("aot/torch_eager.py:is_op_overload"):
        assert torch_eager.is_op_overload(torch.ops.aten.add.Tensor)
        assert torch_eager.is_op_overload(torch.ops.aten.add)
        assert torch_eager.is_op_overload(torch.ops.prims.convert_element_type.default)
        assert str(torch.ops.aten.add.Tensor) == "aten.add.Tensor"
        assert not torch_eager.is_op_overload(torch.add) and not torch_eager.is_op_overload(lambda x: x)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_tree_leaves_flattens_outputs():
    with canary("aot/torch_eager.py:tree_leaves"):
        a, b = torch.zeros(1), torch.ones(1)
        assert torch_eager.tree_leaves({"x": [a, (b, 3)], "y": None}) == [a, b, 3, None]


def _graph_break_fn(x):
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_outside_any_compile_makes_real_tensors_while_a_compile_is_in_progress():
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    in_progress = FakeTensorMode()
    with canary("aot/torch_dynamo.py:outside_any_compile"):
        with tracing(TracingContext(in_progress)), in_progress:
            assert isinstance(torch.zeros(2), FakeTensor)  # what a rank waiting inside a backend would make
            with torch_dynamo.outside_any_compile():
                assert not isinstance(torch.zeros(2), FakeTensor) and TracingContext.try_get() is None
            assert TracingContext.try_get() is not None and isinstance(torch.zeros(2), FakeTensor)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_graph_break_is_readable_from_the_graph_and_the_counters():
    with canary("aot/torch_dynamo.py:graph_break_of/break_counters"):
        breaks = []
        before = sum(torch_dynamo.break_counters().values())

        def backend(gm, example_inputs):
            breaks.append(torch_dynamo.graph_break_of(gm))
            return gm.forward

        torch.compile(_graph_break_fn, backend=backend)(torch.randn(2))
        found = [b for b in breaks if b is not None]
        assert found and "test_torch_internals.py:" in found[0]["where"], breaks
        assert sum(torch_dynamo.break_counters().values()) > before


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_fake_mode_and_hooks_while_a_backend_runs():
    with canary("aot/torch_dynamo.py:fake_mode_of/is_fake/saved_tensors_hooks_disabled/aot_autograd_backend"):
        seen = {}

        def backend(gm, example_inputs):
            fake = torch_dynamo.fake_mode_of(list(example_inputs))
            seen["fake"] = torch_dynamo.is_fake(fake.from_tensor(torch.randn(2)))
            with torch_dynamo.saved_tensors_hooks_disabled():
                return torch_dynamo.aot_autograd_backend(
                    fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward
                )(gm, example_inputs)

        w = torch.randn(4, requires_grad=True)
        torch.compile(lambda x: (x * w).sum(), backend=backend)(torch.randn(4))
        assert seen == {"fake": True}


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_non_lazy_backward_compiles_the_backward_with_the_forward():
    with canary("aot/torch_dynamo.py:non_lazy_backward"):
        compiled = []

        def backend(gm, example_inputs):
            with torch_dynamo.non_lazy_backward():
                return torch_dynamo.aot_autograd_backend(
                    fw_compiler=lambda g, i: compiled.append("fw") or g.forward,
                    bw_compiler=lambda g, i: compiled.append("bw") or g.forward,
                )(gm, example_inputs)

        w = torch.randn(4, requires_grad=True)
        torch.compile(lambda x: (x * w).sin().sum(), backend=backend)(torch.randn(4))
        assert compiled == ["fw", "bw"]  # before any backward ran


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.inductor
def test_watch_caches_reads_aot_and_fx_cache_outcomes(tmp_path, monkeypatch):
    with canary("aot/torch_dynamo_cache.py:watch_caches"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        w = torch.randn(4, requires_grad=True)
        unique = 1.0 + (hash(str(tmp_path)) % 10_000) / 1e5  # a graph no earlier run has cached
        outcomes = []

        def backend(gm, example_inputs):
            with torch_dynamo.watch_caches() as outcome:
                compiled = torch_inductor.compile_fx_with(
                    gm, example_inputs, on_graph=lambda g, b: None, config_patches=None
                )
            outcomes.append(outcome)
            return compiled

        for _ in range(2):
            torch._dynamo.reset()
            torch.compile(lambda x: (x * w * unique).cos().sum(), backend=backend)(torch.randn(4)).backward()
        assert [o.aot for o in outcomes] == ["miss", "hit"]
        assert outcomes[0].fx_misses >= 1 and outcomes[1].describe() == "aot cache hit"


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.inductor
def test_watch_caches_finds_why_the_aot_cache_was_bypassed(tmp_path, monkeypatch):
    with canary("aot/torch_dynamo_cache.py:watch_caches (bypass)"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        w = torch.randn(4, requires_grad=True)
        outcomes = []

        def backend(gm, example_inputs):
            with torch_dynamo.watch_caches() as outcome:
                compiled = torch_inductor.compile_fx_with(
                    gm, example_inputs, on_graph=lambda g, b: None, config_patches=None
                )
            outcomes.append(outcome)
            return compiled

        with torch._inductor.config.patch(freezing=True):  # AOTAutogradCache refuses frozen graphs
            torch.compile(lambda x: (x * w * 1.5).cos().sum(), backend=backend)(torch.randn(4)).backward()
        assert [o.aot for o in outcomes] == [torch_dynamo.AotCache.BYPASS], outcomes
        assert outcomes[0].reason == "Cannot cache a graph with freezing enabled", outcomes
        assert outcomes[0].describe().startswith("aot cache bypass (Cannot cache a graph with freezing enabled)")


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_optimizer_step_hooks_are_counted():
    with canary("aot/torch_eager.py:optimizer_step_hooks"):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        assert torch_eager.optimizer_step_hooks(opt) == 0
        handle = opt.register_step_pre_hook(lambda optimizer, args, kwargs: None)
        assert torch_eager.optimizer_step_hooks(opt) == 1
        handle.remove()
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: None)
        try:
            assert torch_eager.optimizer_step_hooks(opt) == 1
        finally:
            handle.remove()


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_pytorch_ddp_optimizer_is_a_dynamo_config_value():
    with canary("aot/torch_dynamo.py:pytorch_ddp_optimizer"):
        with torch_dynamo.pytorch_ddp_optimizer():
            assert torch._dynamo.config.optimize_ddp == "ddp_optimizer"


# -- inductor/torch_inductor.py ---------------------------------------------------------------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_inductor_option_and_mode_tables():
    with canary("inductor/torch_inductor.py:option_names/mode_options"):
        assert "max_autotune" in torch_inductor.option_names()
        assert torch_inductor.mode_options("max-autotune-no-cudagraphs", None).get("max_autotune") is True


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_cache_dir_and_disk_cache_switches(tmp_path, monkeypatch):
    with canary("inductor/torch_inductor.py:cache_dir/disk_caches_enabled"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
        assert torch_inductor.cache_dir() == str(tmp_path / "c")
        assert (tmp_path / "c").is_dir()
        with torch.compiler.config.patch(force_disable_caches=True):
            assert not torch_inductor.disk_caches_enabled()
        with (
            torch._inductor.config.patch(fx_graph_cache=True),
            torch._functorch.config.patch(enable_autograd_cache=True),
        ):
            assert torch_inductor.disk_caches_enabled()


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11 has no VecISA._probe_load: the memo steps aside).
@pytest.mark.inductor
def test_isa_probe_goes_through_probe_load_and_is_remembered(monkeypatch):
    with canary("inductor/torch_inductor.py:remember_isa_probes"):
        from torch._inductor import cpu_vec_isa

        load_step = hasattr(cpu_vec_isa.VecISA, "_probe_load")
        torch_inductor.remember_isa_probes()
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if isinstance(isa, cpu_vec_isa.VecAVX2)]
        isa = candidates[0] if candidates else None
        if isa is None or "avx2" not in cpu_vec_isa.x86_isa_checker():
            pytest.skip("needs an x86 CPU with AVX2, the ISA this canary builds a probe library for")
        assert isa.check_build(cpu_vec_isa.VecISA._avx_code)  # compiles (or finds) and loads; marks success
        if not load_step:
            # torch 2.11: check_build compiles and loads in one step; the memo steps aside and installs
            # nothing (when it asked for the missing name, every Inductor compile fell back)
            assert not hasattr(cpu_vec_isa.VecISA, "_probe_load")
            return

        def no_child(*args, **kwargs):
            raise AssertionError("the probe started a child process for a library that loaded before")

        monkeypatch.setattr(cpu_vec_isa.subprocess, "run", no_child)
        assert isa.check_build(cpu_vec_isa.VecISA._avx_code)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.inductor
def test_compile_fx_with_sees_forward_and_backward_graphs():
    with canary("inductor/torch_inductor.py:compile_fx_with"):
        graphs = []

        def backend(gm, example_inputs):
            return torch_inductor.compile_fx_with(
                gm, example_inputs, on_graph=lambda g, is_backward: graphs.append(is_backward), config_patches=None
            )

        w = torch.randn(8, requires_grad=True)
        x = torch.randn(8)
        # A cache hit skips the inner compile: this canary is about the hook, so no caches.
        with torch._inductor.config.patch(force_disable_caches=True):
            torch.compile(lambda x: (x * w).sin().sum(), backend=backend)(x).backward()
        assert graphs == [False, True]
        torch.testing.assert_close(w.grad, (x * w.detach()).cos() * x)


class _OwnError(RuntimeError):
    pass


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_an_error_raised_in_a_backend_is_found_inside_dynamos_wrapper():
    with canary("aot/torch_dynamo.py:root_cause/cause_chain"):

        def backend(gm, example_inputs):
            raise _OwnError("ours")

        with pytest.raises(torch_dynamo.DynamoError) as caught:
            torch.compile(lambda x: x + 1, backend=backend)(torch.randn(2))
        assert isinstance(torch_dynamo.root_cause(caught.value, _OwnError), _OwnError)
        chain = torch_dynamo.cause_chain(caught.value)
        assert chain[0] is caught.value and isinstance(chain[-1], _OwnError), chain


# -- the AOT graph internals of ddp="in_graph" ----------------------------------------------------------


def _partitioned(fn, *inputs, dynamic=None):
    """The joint graph, and the forward/backward graphs AOTAutograd partitions it into, for `fn`."""
    from functorch.compile import min_cut_rematerialization_partition

    seen = {}

    def partition(joint, joint_inputs, **kwargs):
        seen["joint"] = copy.deepcopy(joint.graph)
        seen["fw"], seen["bw"] = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        return seen["fw"], seen["bw"]

    backend = torch_dynamo.aot_autograd_backend(
        fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward, partition_fn=partition
    )
    torch.compile(fn, backend=backend, dynamic=dynamic)(*inputs).sum().backward()
    return seen


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_gradient_outputs_name_their_inputs():
    with canary("aot/torch_graphs.py:grad_outputs/input_placeholders/graph_fake_mode"):
        w, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
        seen = _partitioned(lambda x: torch.nn.functional.linear(x, w, b), torch.randn(2, 4))
        grads = torch_graphs.grad_outputs(seen["bw"].graph)
        shapes = {i: tuple(node.meta["val"].shape) for i, (_, node) in grads.items()}
        assert sorted(shapes.values()) == [(3,), (3, 4)], shapes
        assert set(torch_graphs.input_placeholders(seen["joint"])) >= set(grads)
        assert torch_graphs.graph_fake_mode(seen["bw"].graph) is not None


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_forward_input_can_be_saved_for_the_backward():
    with canary("aot/torch_graphs.py:save_for_backward"):
        w = torch.randn(4, requires_grad=True)
        seen = _partitioned(lambda x, b: x * w + b, torch.randn(4), torch.randn(4))
        fw, bw = seen["fw"], seen["bw"]
        saved = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
        unused = next(n for n in fw.graph.nodes if n.op == "placeholder" and n.name not in saved)  # `b`
        before = len([n for n in bw.graph.nodes if n.op == "placeholder"])
        placeholder = torch_graphs.save_for_backward(fw, bw, unused)
        assert placeholder.op == "placeholder"
        assert len([n for n in bw.graph.nodes if n.op == "placeholder"]) == before + 1
        assert torch_graphs.save_for_backward(fw, bw, unused) is placeholder  # saved once
        fw.recompile()
        bw.recompile()
        assert placeholder.name in bw.code


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("version_checked", [True, False])
def test_an_input_saved_unchecked_reaches_the_backward_after_an_in_place_write(version_checked):
    """What `optimizer_in_backward` relies on for the parameters it updates: saved unchecked, a tensor written
    in place between the forward and the backward (as `nn.Embedding(max_norm=...)` writes its weight) still
    reaches the backward; saved checked, autograd refuses it, as torch 2.13 does for any saved tensor."""
    with canary("aot/torch_graphs.py:save_for_backward(version_checked=False)"):
        from functorch.compile import min_cut_rematerialization_partition

        p = torch.randn(4)
        w = torch.randn(4, requires_grad=True)

        def partition(joint, joint_inputs, **kwargs):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
            live = next(n for n in fw.graph.nodes if n.op == "placeholder" and n.meta["val"].shape == (4,))
            torch_graphs.save_for_backward(fw, bw, live, version_checked=version_checked)
            fw.recompile()
            bw.recompile()
            return fw, bw

        backend = torch_dynamo.aot_autograd_backend(
            fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward, partition_fn=partition
        )
        out = torch.compile(lambda x: (x + w).square().sum(), backend=backend)(p)  # saves x + w, not x
        p.add_(1.0)  # the in-place write between the forward and the backward
        if version_checked:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.backward()
        else:
            out.backward()
            torch.testing.assert_close(w.grad, 2 * (p - 1.0 + w.detach()))


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_saved_tensors_pair_up_when_symbolic_sizes_are_saved_too():
    # The forward returns saved tensors then saved sizes; the backward takes the sizes first.
    with canary("aot/torch_graphs.py:save_for_backward"):
        w = torch.randn(4, requires_grad=True)
        seen = _partitioned(
            lambda x, b: (x.sum(0) * w).sin() + b.sum(), torch.randn(3, 4), torch.randn(5, 4), dynamic=True
        )
        fw, bw = seen["fw"], seen["bw"]
        n_saved = torch_graphs.saved_count(bw.graph)
        fw_saved = list(next(n for n in fw.graph.nodes if n.op == "output").args[0])[-n_saved:]
        is_tensor = lambda n: isinstance(n.meta.get("val"), torch.Tensor)  # noqa: E731
        assert not is_tensor(fw_saved[-1]), "no symbolic size saved: the order would not matter here"
        for value in filter(is_tensor, fw_saved):  # already saved: found, by the name it keeps in the backward
            assert torch_graphs.save_for_backward(fw, bw, value).name == value.name
        unsaved = next(n for n in fw.graph.nodes if n.op == "placeholder" and is_tensor(n) and n not in fw_saved)
        torch_graphs.save_for_backward(fw, bw, unsaved)
        n_saved = torch_graphs.saved_count(bw.graph)
        fw_tensors = [n.name for n in list(next(n for n in fw.graph.nodes if n.op == "output").args[0])[-n_saved:]]
        bw_saved = [n for n in bw.graph.nodes if n.op == "placeholder"][:n_saved]
        bw_tensors = [n.name.removeprefix("saved_") for n in bw_saved if is_tensor(n)]
        assert [n for n in fw_tensors if n in bw_tensors] == bw_tensors and unsaved.name in bw_tensors
        assert not is_tensor(bw_saved[0]), "the backward takes the saved sizes first"


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_saved_values_are_the_backward_inputs_before_the_tangents():
    with canary("aot/torch_graphs.py:saved_count"):
        w = torch.randn(4, requires_grad=True)
        seen = _partitioned(lambda x: (x * w).sin(), torch.randn(4))
        fw_outputs = next(n for n in seen["fw"].graph.nodes if n.op == "output").args[0]
        assert torch_graphs.saved_count(seen["bw"].graph) == len(fw_outputs) - 1 >= 1  # one user output


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_mutating_function_is_captured_as_a_functional_graph():
    with canary("aot/torch_dynamo.py:capture_functional"):

        def update(p, g, lr):
            p.sub_(g * lr)

        args = [torch.ones(4), torch.full((4,), 2.0), torch.tensor(0.5)]
        graph, positions = torch_dynamo.capture_functional(update, args)
        assert sorted(p for p in positions if p is not None) == [0, 1, 2]
        assert any(n.target is torch.ops.aten.copy_.default for n in graph.graph.nodes)
        p = torch.ones(4)
        inputs = [None] * 3
        for arg, pos in zip([p, torch.full((4,), 2.0), torch.tensor(0.5)], positions):
            inputs[pos] = arg
        graph(*inputs)
        torch.testing.assert_close(p, torch.zeros(4))


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_extra_inputs_leave_dynamos_graph_alone():
    with canary("aot/torch_graphs.py:with_extra_inputs"):
        seen = {}

        def backend(gm, example_inputs):
            extended = torch_graphs.with_extra_inputs(gm, ["extra"])
            seen["placeholders"] = [n.name for n in extended.graph.nodes if n.op == "placeholder"]
            seen["original"] = len([n for n in gm.graph.nodes if n.op == "placeholder"])
            compiled = torch_dynamo.aot_autograd_backend(fw_compiler=lambda g, i: g.forward)(
                extended, [*example_inputs, torch.zeros(1)]
            )
            return lambda *args: compiled(*args, torch.zeros(1))

        torch.compile(lambda x: x * 2, backend=backend)(torch.randn(3))
        assert seen["placeholders"][-1] == "extra" and len(seen["placeholders"]) == seen["original"] + 1


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_inductor_takes_a_custom_partitioner_and_its_decompositions():
    with canary("inductor/torch_inductor.py:partitioner_patch/decompositions"):
        import pickle

        patch = torch_inductor.partitioner_patch(lambda *a, **k: None, "uuid-1")
        fn = patch["custom_partitioner_fn"]
        assert fn.uuid() == "uuid-1"
        assert pickle.loads(pickle.dumps(fn)).uuid() == "uuid-1"  # goes into Inductor's cache keys
        table = torch_inductor.decompositions()
        assert isinstance(table, dict) and torch.ops.aten.linalg_vector_norm.default in table


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_ordering_op_is_cacheable_under_the_partitioner_patch():
    """Without the mark, a backward ordered by `order_after` is never taken from the FX graph cache."""
    with canary("inductor/torch_inductor.py:partitioner_patch/control_deps_name"):
        from torch._inductor.fx_passes.control_dependencies import control_deps

        patch = torch_inductor.partitioner_patch(lambda *a, **k: None, "uuid-1")
        assert not control_deps.cacheable()
        with torch._inductor.config.patch(unsafe_marked_cacheable_functions=patch["unsafe_marked_cacheable_functions"]):
            assert control_deps.cacheable()


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_users_own_partitioner_and_cacheable_functions_are_kept_under_our_patch():
    """Our patch builds on the user's Inductor settings instead of replacing them."""
    with canary("inductor/torch_inductor.py:partitioner_patch (user settings)"):

        class UserPartitioner:
            def __call__(self, gm, inputs, **kwargs):
                return ("user's", gm)

            def uuid(self):
                return "user-uuid"

        seen = {}

        def ours(gm, inputs, *, base=None, **kwargs):
            seen["base"] = base
            return base(gm, inputs, **kwargs)

        user = UserPartitioner()
        patch = torch_inductor.partitioner_patch(
            ours, "ours", {"custom_partitioner_fn": user, "unsafe_marked_cacheable_functions": {"my.op": "1"}}
        )
        assert patch["custom_partitioner_fn"]("gm", []) == ("user's", "gm") and seen["base"] is user
        assert "user-uuid" in patch["custom_partitioner_fn"].uuid()  # their partitioner shapes the cache key
        cacheable = patch["unsafe_marked_cacheable_functions"]
        assert cacheable["my.op"] == "1" and torch_inductor.control_deps_name() in cacheable
        with torch._inductor.config.patch(custom_partitioner_fn=user):  # set globally: found there too
            assert torch_inductor.partitioner_patch(ours, "ours")["custom_partitioner_fn"]("gm", [])[0] == "user's"


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


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_fresh_cache_artifacts_hold_one_compile_and_the_outer_collection_keeps_it():
    with canary("inductor/torch_inductor.py:fresh_cache_artifacts"):
        import torch._inductor.codecache  # noqa: F401 - registers the "inductor" artifact type
        from torch.compiler._cache import CacheArtifactManager

        outer_before = {k: list(v) for k, v in CacheArtifactManager._new_cache_artifacts.items()}
        with torch_inductor.fresh_cache_artifacts() as save:
            CacheArtifactManager.record_artifact("inductor", "canary-key", b"canary-bytes")
            blob = save()
        assert blob is not None
        loaded = CacheArtifactManager.deserialize(blob)
        assert [(a.key, a.content) for a in loaded["inductor"]] == [("canary-key", b"canary-bytes")]
        assert sum(len(v) for v in loaded.values()) == 1  # nothing recorded before the block came along
        after = CacheArtifactManager._new_cache_artifacts["inductor"]
        assert any(a.key == "canary-key" for a in after), "the outer collection lost the block's artifact"
        CacheArtifactManager._new_cache_artifacts.clear()
        CacheArtifactManager._new_cache_artifacts.update(outer_before)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_kernel_libraries_are_found_where_inductor_builds_them(tmp_path, monkeypatch):
    with canary("inductor/torch_inductor.py:kernel_libraries"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        assert torch_inductor.kernel_libraries(str(tmp_path)) == set()
        unique = 2.0 + (hash(str(tmp_path)) % 10_000) / 1e5
        torch.compile(lambda x: (x * unique).sin() + 1, backend="inductor")(torch.randn(8))
        found = torch_inductor.kernel_libraries(str(tmp_path))
        assert found, f"no kernel library under {tmp_path}: {sorted(p.name for p in tmp_path.rglob('*.so'))}"
        every_so = {str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/*.so")}
        assert found == every_so


def _region_graph() -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of 3 blocks under one nested_compile_region (the field tests' model)."""
    from tests.multi_gpu.field_models import Regioned

    torch._dynamo.reset()
    captured: list = []

    def capture(gm, inputs):
        captured.append((gm, inputs))
        return gm.forward

    torch.compile(Regioned(), backend=capture)(torch.randn(4, 64))
    return captured[0]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_nested_region_calls_counts_the_invoke_subgraph_calls_of_a_dynamo_graph():
    gm, _ = _region_graph()
    assert torch_graphs.nested_region_calls(gm) >= 2
    plain = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert torch_graphs.nested_region_calls(plain) == 0


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (the region op's eager backward: see below).
def test_inline_nested_regions_calls_the_region_bodies_and_gives_the_same_gradients():
    """The eager fallback of a graph with regions: no invoke_subgraph left, the graph's outputs, a gradient for
    every parameter, and Dynamo's graph itself unchanged."""
    gm, inputs = _region_graph()
    before = torch_graphs.nested_region_calls(gm)
    plain = torch_graphs.inline_nested_regions(gm)
    assert torch_graphs.nested_region_calls(plain) == 0 and torch_graphs.nested_region_calls(gm) == before
    real = [
        torch.randn(t.shape) if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) else t for t in inputs
    ]
    with torch.no_grad():
        expected = gm(*real)  # the op's forward runs eagerly; its backward does not (below)
    out = plain(*real)
    torch.testing.assert_close(out, expected)
    (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
    params = [p for p in inputs if isinstance(p, nn.Parameter)]
    grads = [p.grad.clone() for p in params if p.grad is not None]
    assert len(grads) == len(params) > 0 and all(g.abs().sum() > 0 for g in grads)
    with canary("aot/torch_graphs.py:inline_nested_regions (invoke_subgraph's eager backward)"):
        # Why it exists: on torch 2.11 and 2.13 Dynamo's graph as it is cannot run a backward eagerly (the
        # region op's autograd rule wants a fake mode). 2.14 runs the body under plain autograd when it is
        # given real tensors; inlining is then not needed, and both must give the same gradients.
        for p in params:
            p.grad = None
        try:
            out = gm(*real)
            (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
        except AssertionError as err:
            assert "fake_mode" in str(err), err
        else:
            for p, g in zip(params, grads):
                torch.testing.assert_close(p.grad, g)


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11 partitions the body twice).
def test_region_bodies_reach_the_partition_step_without_input_descriptors():
    """AOTAutograd partitions each nested region's body with the graph's own partition step, first: the
    in-graph pass tells the bodies from the graph by its input descriptors. torch 2.13 and 2.14 partition the
    one body once; 2.11 partitions it twice (block 0's input needs no gradient, the others' do), which the
    pass handles alike: every body before the graph, without descriptors."""
    from functorch.compile import min_cut_rematerialization_partition

    from aot import nop_compiler
    from tests.multi_gpu.field_models import Regioned

    with canary("aot/torch_graphs.py:has_input_descriptors (invoke_subgraph bodies partitioned alone)"):
        seen: list[bool] = []

        def partition(joint, joint_inputs, **kwargs):
            seen.append(torch_graphs.has_input_descriptors(joint.graph))
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        torch._dynamo.reset()
        backend = torch_dynamo.aot_autograd_backend(
            fw_compiler=nop_compiler, bw_compiler=nop_compiler, partition_fn=partition
        )
        torch.compile(Regioned(), backend=backend)(torch.randn(4, 64)).sum().backward()
        assert len(seen) >= 2 and seen[-1] and not any(seen[:-1]), seen


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11: no Autograd kernel of its own).
def test_an_ordered_graph_runs_eagerly_on_parameters_even_where_control_deps_had_no_autograd_kernel():
    """torch 2.11's `control_deps` had no Autograd kernel: an ordered backward run eagerly (aot_eager) on
    tensors that require grad raised. Simulated here by taking 2.13's kernel away; `order_after` puts one back."""
    with canary("inductor/torch_inductor.py:order_after/control_deps Autograd kernel"):
        from torch._C import DispatchKey
        from torch._inductor.fx_passes.control_dependencies import control_deps, preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet

        def ordered(order) -> torch.fx.GraphModule:
            gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
            x = gm.graph.placeholder("x")
            first = gm.graph.call_function(torch.ops.aten.add.Tensor, (x, 1))
            second = gm.graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
            gm.graph.output((first, second))
            order(gm.graph, second, first)
            gm.recompile()
            assert any(n.target is control_deps for n in gm.graph.nodes)
            return gm

        x = torch.ones(3, requires_grad=True)
        kept = control_deps.py_kernels.pop(DispatchKey.Autograd, None)  # None on 2.11 (unless ours is there)
        control_deps._dispatch_cache.clear()
        try:
            before = ordered(lambda g, node, after: preserve_node_ordering(g, {node: OrderedSet([after])}))
            with torch.no_grad(), pytest.raises(NotImplementedError, match="control_deps"):
                before(x)  # what torch 2.11 did
            ours = ordered(lambda g, node, after: torch_inductor.order_after(g, {node: [after]}))
            with torch.no_grad():
                first, second = ours(x)
            assert torch.equal(first, x.detach() + 1) and torch.equal(second, x.detach() * 2)
        finally:
            if kept is not None:
                control_deps.py_kernels[DispatchKey.Autograd] = kept
            control_deps._dispatch_cache.clear()


# -- capabilities and the torch versions (compile-time refusals, python -m compile_core.doctor) -------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_every_home_finds_every_feature_on_a_supported_torch():
    """Covers torch 2.11.0, 2.13.0, 2.14.1: every feature the homes check for is there (some through our
    stand-ins on 2.11, which their text names), so no mode is refused at compile time."""
    from compile_core.config import BACKENDS, DDP_MODES

    for home, table in (
        ("ddp/torch_ddp.py", torch_ddp.capabilities()),
        ("aot/torch_dynamo.py", torch_dynamo.capabilities()),
        ("inductor/torch_inductor.py", torch_inductor.capabilities()),
    ):
        with canary(f"{home}:capabilities"):
            missing = {name: how for name, (ok, how) in table.items() if not ok}
            assert table and not missing, missing
            for mode in DDP_MODES:
                for backend in BACKENDS:
                    module = {"ddp": torch_ddp, "aot": torch_dynamo, "inductor": torch_inductor}[home.split("/")[0]]
                    assert module.blocker(mode, backend=backend, nested_regions=mode == "in_graph") is None


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11: Dynamo misses the unfreezing, we guard).
def test_a_parameter_unfrozen_after_the_first_compile_gets_its_gradient():
    """Covers torch 2.11.0 (Dynamo's guards miss the unfreezing: `compile_with_guard_hook` guards every
    parameter itself), 2.13.0 and 2.14.1 (Dynamo compiles again by itself)."""
    with canary("aot/torch_dynamo.py:guards_follow_requires_grad/compile_with_guard_hook"):
        guarded = torch_dynamo.guards_follow_requires_grad()
        assert guarded in (True, False)

        def frozen_first() -> nn.Sequential:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
            model[0].requires_grad_(False)
            return model

        def unfrozen_grad(compile_fn) -> bool:
            model = frozen_first()
            run = compile_fn(model)
            x = torch.randn(3, 4)
            run(x).sum().backward()
            model[0].requires_grad_(True)
            run(x).sum().backward()
            return model[0].weight.grad is not None

        torch._dynamo.reset()
        ours = lambda m: torch_dynamo.compile_with_guard_hook(m, "aot_eager", on_guard_fail=lambda r, w: None)  # noqa: E731
        assert unfrozen_grad(ours), "the unfrozen layer got no gradient through compile_with_guard_hook"
        torch._dynamo.reset()
        # what torch does alone: on 2.11 the graph traced with the layer frozen keeps running
        assert unfrozen_grad(lambda m: torch.compile(m, backend="aot_eager")) is guarded
