"""Canaries of aot/torch_dynamo.py, aot/torch_eager.py, aot/torch_dynamo_cache.py and aot/torch_aot.py: Dynamo's
hooks, counters and errors, a module's compiled call, the caches' outcomes, AOTAutograd's switches and fake modes
(see tests/single/torch_internals_helpers.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from aot import torch_aot, torch_dynamo, torch_eager
from inductor import torch_inductor
from tests.single.torch_internals_helpers import canary

pytestmark = pytest.mark.usefixtures("pg")


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


# Canary on torch 2.11.0, 2.13.0, 2.14.1 (2.11: isolated by a copy of the function's code object).
def test_wrappers_of_one_function_compiled_with_isolate_recompiles_keep_caches_apart():
    """What the per-block optimizer update relies on: one wrapper per distinct block, each compiled for its
    own shapes, none failing another's guards (torch 2.11 shared the code object's cache between them)."""
    with canary("aot/torch_dynamo.py:compile_with_guard_hook"):
        failures: list[str] = []

        def double(x, *, k=2):
            return x * k

        wrappers = [
            torch_dynamo.compile_with_guard_hook(
                double, "eager", on_guard_fail=lambda r, w: failures.append(r), dynamic=False, isolate_recompiles=True
            )
            for _ in range(3)
        ]
        for size, fn in zip((3, 5, 7), wrappers):
            assert torch.equal(fn(torch.ones(size)), torch.full((size,), 2.0))
            assert torch.equal(fn(torch.ones(size), k=3), torch.full((size,), 3.0))  # keyword defaults kept
        # a new k may fail a wrapper's own guards; another wrapper's sizes never do
        assert not [f for f in failures if "size" in f.lower()], failures


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_what_a_compiled_function_reaches_goes_with_it():
    """Dynamo keeps its backends (`cached_backends`), the graphs they compile (`__compiled_fn_*` globals) and the
    hook on failed guards (inside each cache entry's guards) for the rest of the process; `compile_with_guard_hook`
    hands it weak references, so what the backend, its graphs and the hook reach (the model) goes with the
    function it returned. Sizes change once, so the hook is installed and called."""
    with canary("aot/torch_dynamo.py:compile_with_guard_hook"):
        import gc
        import weakref

        class Owner:  # what the model is in compile_core: reached by the backend, its graphs and the hook
            def backend(self, gm, example_inputs):
                return lambda *args: gm(*args)

            def on_guard_fail(self, reason: str, where: str) -> None:
                self.failures.append(reason)

        owner = Owner()
        owner.failures = []
        fn = torch_dynamo.compile_with_guard_hook(
            lambda x: x * 2, owner.backend, on_guard_fail=owner.on_guard_fail, dynamic=False, isolate_recompiles=True
        )
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
        assert torch.equal(fn(torch.ones(5)), torch.full((5,), 2.0))
        assert owner.failures, "no guard failed: the hook was not exercised"
        gone = weakref.ref(owner)
        del owner, fn
        gc.collect()
        assert gone() is None, "Dynamo keeps something of the compiled function strongly"


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("guarded", [True, False])
def test_module_hooks_changed_after_a_compile_compile_again_only_when_guarded(guarded):
    """`guard_module_hooks`: a forward hook registered on a layer compiled without one runs from the next call,
    and stops once removed. Unguarded (Dynamo's default, `skip_nnmodule_hook_guards`), the first compile's
    hooks keep running: the check that the flag still means what we turn off."""
    with canary("aot/torch_dynamo.py:compile_with_guard_hook"):
        torch._dynamo.reset()
        model, x = _TwoLayers(), torch.randn(2, 3)
        reasons: list[str] = []
        fn = torch_dynamo.compile_with_guard_hook(
            model, "eager", on_guard_fail=lambda r, w: reasons.append(r), guard_module_hooks=guarded
        )
        plain = fn(x)
        handle = model.a.register_forward_hook(lambda module, args, out: out * 0)
        hooked = fn(x)
        handle.remove()
        after = fn(x)
        assert torch.equal(after, plain)
        if guarded:
            # one compile more: removing the hook brings back the first compile's graph, not a third
            assert torch.equal(hooked, model.b(torch.zeros(2, 3))) and len(reasons) == 1, reasons
        else:
            assert torch.equal(hooked, plain) and reasons == [], reasons


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_lookup_backend_and_restart_and_error_types():
    with canary("aot/torch_dynamo.py:lookup_backend/RestartAnalysis/DynamoError"):
        assert callable(torch_dynamo.lookup_backend("aot_eager"))
        assert issubclass(torch_dynamo.RestartAnalysis, Exception)
        assert issubclass(torch_dynamo.DynamoError, Exception)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_a_modules_call_can_be_replaced_and_bypassed_like_module_compile_does():
    with canary(
        "aot/torch_eager.py:installed_compiled_call/install_compiled_call/uninstall_compiled_call/call_uncompiled"
    ):
        compiled = nn.Linear(2, 2)
        assert torch_eager.installed_compiled_call(compiled) is None
        compiled.compile(backend="eager")
        assert torch_eager.installed_compiled_call(compiled) is not None
        torch_eager.uninstall_compiled_call(compiled)
        assert torch_eager.installed_compiled_call(compiled) is None
        module, hooked = nn.Linear(2, 2), []
        module.register_forward_hook(lambda mod, args, out: hooked.append(out.shape))
        torch_eager.install_compiled_call(module, lambda *args, **kwargs: "replaced")
        assert torch_eager.installed_compiled_call(module) is not None
        assert module(torch.randn(1, 2)) == "replaced" and hooked == []
        x = torch.randn(3, 2)
        torch.testing.assert_close(torch_eager.call_uncompiled(module, x), module.forward(x))
        assert hooked == [torch.Size([3, 2])]  # hooks run, as in a plain call


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_the_wrapper_torch_compile_returns_can_call_its_module_uncompiled():
    with canary("aot/torch_eager.py:uncompile_torch_wrapper/torch_compile_original"):
        compiles = []

        def scripts_backend(gm, example_inputs):
            compiles.append(gm)
            return gm.forward

        assert torch_eager.uncompile_torch_wrapper(nn.Linear(2, 2)) is None
        linear, hooked = nn.Linear(2, 2), []
        wrapper = torch.compile(linear, backend=scripts_backend)
        wrapper.register_forward_hook(lambda mod, args, out: hooked.append(out.shape))
        assert torch_eager.torch_compile_original(wrapper) is linear and not compiles  # a look changes nothing
        assert torch_eager.torch_compile_original(linear) is None
        assert torch_eager.uncompile_torch_wrapper(wrapper) is linear
        x = torch.randn(3, 2)
        torch.testing.assert_close(wrapper(x), linear(x))
        assert compiles == [] and hooked == [torch.Size([3, 2])]  # not compiled; the wrapper's hooks run
        lazy = torch.compile(nn.LazyLinear(4), backend=scripts_backend)
        torch_eager.uncompile_torch_wrapper(lazy)
        assert lazy(x).shape == (3, 4) and compiles == []  # a lazy module is still initialised first


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
def test_graph_break_is_readable_from_the_graph_and_the_counters():
    with canary("aot/torch_dynamo.py:graph_break_of/break_counters"):
        breaks = []
        before = sum(torch_dynamo.break_counters().values())

        def backend(gm, example_inputs):
            breaks.append(torch_dynamo.graph_break_of(gm))
            return gm.forward

        torch.compile(_graph_break_fn, backend=backend)(torch.randn(2))
        found = [b for b in breaks if b is not None]
        assert found and "test_torch_internals_dynamo.py:" in found[0]["where"], breaks
        assert sum(torch_dynamo.break_counters().values()) > before


def _inductor_recording_cache_outcomes(outcomes: list):
    """A backend that compiles with Inductor and appends each compile's cache outcome to `outcomes`."""

    def backend(gm, example_inputs):
        with torch_dynamo.watch_caches() as outcome:
            compiled = torch_inductor.compile_fx_with(
                gm, example_inputs, on_graph=lambda g, b: None, config_patches=None
            )
        outcomes.append(outcome)
        return compiled

    return backend


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.inductor
def test_watch_caches_reads_aot_and_fx_cache_outcomes(tmp_path, monkeypatch):
    with canary("aot/torch_dynamo_cache.py:watch_caches"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        w = torch.randn(4, requires_grad=True)
        unique = 1.0 + (hash(str(tmp_path)) % 10_000) / 1e5  # a graph no earlier run has cached
        outcomes = []
        backend = _inductor_recording_cache_outcomes(outcomes)
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
        backend = _inductor_recording_cache_outcomes(outcomes)
        with torch._inductor.config.patch(freezing=True):  # AOTAutogradCache refuses frozen graphs
            torch.compile(lambda x: (x * w * 1.5).cos().sum(), backend=backend)(torch.randn(4)).backward()
        assert [o.aot for o in outcomes] == [torch_dynamo.AotCache.BYPASS], outcomes
        assert outcomes[0].reason == "Cannot cache a graph with freezing enabled", outcomes
        assert outcomes[0].describe().startswith("aot cache bypass (Cannot cache a graph with freezing enabled)")


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.inductor
def test_aot_cache_off_keeps_a_compile_out_of_the_aot_cache(tmp_path, monkeypatch):
    from aot.torch_dynamo_cache import AotCache, aot_cache_off

    with canary("aot/torch_dynamo_cache.py:aot_cache_off"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        w = torch.randn(4, requires_grad=True)
        outcomes = []
        backend = _inductor_recording_cache_outcomes(outcomes)
        for _ in range(2):
            torch._dynamo.reset()
            with aot_cache_off():
                torch.compile(lambda x: (x * w * 2.5).sin().sum(), backend=backend)(torch.randn(4)).backward()
        assert [o.aot for o in outcomes] == [AotCache.UNUSED, AotCache.UNUSED], outcomes  # neither saved nor found
        assert outcomes[1].fx_hits >= 1  # Inductor's own FX graph cache stays on


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
def test_a_step_marked_taken_keeps_the_schedulers_order_warning_quiet():
    import warnings

    with canary("aot/torch_eager.py:mark_stepped"):
        for mark in (False, True):
            opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1)
            if mark:
                torch_eager.mark_stepped(opt)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sched.step()
            warned = any("before `optimizer.step()`" in str(w.message) for w in caught)
            assert warned is not mark, (mark, [str(w.message) for w in caught])


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_foreach_by_default_follows_torchs_choice_for_the_parameters_device(monkeypatch):
    with canary("aot/torch_eager.py:foreach_by_default"):
        params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))]
        assert torch_eager.foreach_by_default(params) is False  # the CPU loops over its parameters
        # the choice is read from the devices torch has foreach kernels for (CUDA, ... ; never the CPU here)
        from torch.optim import optimizer as optim_module

        monkeypatch.setattr(optim_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
        assert torch_eager.foreach_by_default(params) is True
        # only plain tensors: torch keeps subclasses on the per-parameter loop
        assert torch_eager.foreach_by_default([torch.Tensor._make_subclass(_Sub, torch.zeros(2))]) is False


class _Sub(torch.Tensor):
    pass


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_fused_kernel_devices_are_the_ones_adams_fused_step_accepts():
    with canary("aot/torch_eager.py:fused_kernel_devices"):
        devices = torch_eager.fused_kernel_devices()
        assert "cuda" in devices and "cpu" in devices, devices
        # the list Adam checks its parameters against under fused=True: a CPU parameter steps fused here
        p = nn.Parameter(torch.ones(3))
        p.grad = torch.full((3,), 0.5)
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        opt.step()
        assert opt.state[p]["step"].device == p.device and opt.state[p]["step"].dtype == torch.float32
        assert float(p.detach()[0]) < 1.0


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_adam_kernel_is_the_step_of_a_fused_adam_with_lr_and_counts_read_from_tensors(cls):
    with canary("aot/torch_eager.py:fused_adam_kernel"):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
        ref = [nn.Parameter(p.detach().clone()) for p in params]
        grads = [torch.randn_like(p) for p in params]
        opt = cls(ref, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, eps=1e-6, fused=True)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        # the counts and lr as views of one float32 table, as the update inside the backward passes them
        table = torch.tensor([[0.01, 1.0], [0.01, 1.0]])
        kernel = torch_eager.fused_adam_kernel(decoupled=cls is torch.optim.AdamW)
        kernel(
            [p.data for p in params], [g.clone() for g in grads], [m for m, _ in state], [v for _, v in state],
            [], [table[0, 1], table[1, 1]],
            lr=table[0, 0], beta1=0.8, beta2=0.95, weight_decay=0.1, eps=1e-6, amsgrad=False, maximize=False,
        )  # fmt: skip
        for p, r, (m, v) in zip(params, ref, state):
            torch.testing.assert_close(p.data, r.data, rtol=0, atol=0)
            torch.testing.assert_close(m, opt.state[r]["exp_avg"], rtol=0, atol=0)
            torch.testing.assert_close(v, opt.state[r]["exp_avg_sq"], rtol=0, atol=0)
        assert float(table[0, 1]) == 1.0  # read, not advanced: the caller counts


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_sgd_kernel_is_the_step_of_a_fused_sgd_with_lr_read_from_a_tensor(momentum):
    with canary("aot/torch_eager.py:fused_sgd_kernel"):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
        ref = [nn.Parameter(p.detach().clone()) for p in params]
        grads = [torch.randn_like(p) for p in params]
        opt = torch.optim.SGD(ref, lr=0.1, momentum=momentum, weight_decay=0.01, fused=True)
        buffers = []
        for step in range(2):  # the second step decays the buffers the first created
            for p, g in zip(ref, grads):
                p.grad = g.clone()
            opt.step()
            if step == 0:
                buffers = [opt.state[p]["momentum_buffer"].clone() for p in ref] if momentum else []
                for p, r in zip(params, ref):
                    p.data.copy_(r.data)
        table = torch.tensor([[0.1]])
        torch_eager.fused_sgd_kernel()(
            [p.data for p in params], [g.clone() for g in grads], buffers,
            weight_decay=0.01, momentum=momentum, lr=table[0, 0], dampening=0.0, nesterov=False, maximize=False,
            is_first_step=False,
        )  # fmt: skip
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.data, r.data, rtol=0, atol=0)
        for b, r in zip(buffers, ref):
            torch.testing.assert_close(b, opt.state[r]["momentum_buffer"], rtol=0, atol=0)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_add_to_each_advances_every_tensor_in_place():
    with canary("aot/torch_eager.py:add_to_each"):
        counts = [torch.tensor(0.0), torch.tensor(5.0), torch.tensor(41.0)]
        before = [c.data_ptr() for c in counts]
        versions = [torch_eager.version_of(c) for c in counts]
        torch_eager.add_to_each(counts, 1)
        assert [float(c) for c in counts] == [1.0, 6.0, 42.0]
        assert [c.data_ptr() for c in counts] == before
        # each count's version moves by exactly one (the in-backward update trusts counts it advanced itself)
        assert [torch_eager.version_of(c) for c in counts] == [v + 1 for v in versions]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_version_of_counts_in_place_writes_and_not_reads():
    with canary("aot/torch_eager.py:version_of"):
        t = torch.tensor(3.0)
        v = torch_eager.version_of(t)
        assert float(t + 1) == 4.0 and torch_eager.version_of(t) == v  # a read
        t.add_(1)
        t.view(1)[0] = 7.0  # through a view
        assert torch_eager.version_of(t) == v + 2
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        opt = torch.optim.AdamW([p], foreach=True)
        opt.step()
        count = opt.state[p]["step"]
        before = torch_eager.version_of(count)
        opt.step()  # torch's own step advances the count in place
        assert torch_eager.version_of(count) > before
    with canary("aot/torch_eager.py:versions_of"):
        a, b = torch.tensor(1.0), torch.tensor(2.0)
        versions = torch_eager.versions_of([a, b])
        b.add_(1)
        assert torch_eager.versions_of([a, b]) == [versions[0], versions[1] + 1]


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_set_version_lets_a_saved_tensor_written_in_place_be_read_as_it_is_now():
    with canary("aot/torch_eager.py:set_version"):
        x = torch.ones(3, requires_grad=True)
        saved = torch.full((3,), 2.0)
        out = torch.compile(lambda a, b: (a * b).sum(), backend="aot_eager")(x, saved)  # `saved` kept for backward
        version = torch_eager.version_of(saved)
        saved.zero_()  # without set_version, autograd refuses a saved tensor modified in place
        torch_eager.set_version(saved, version)
        assert torch_eager.version_of(saved) == version
        out.backward()
        assert x.grad.tolist() == [0.0, 0.0, 0.0]  # the values as they are now


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_pytorch_ddp_optimizer_is_a_dynamo_config_value():
    with canary("aot/torch_dynamo.py:pytorch_ddp_optimizer"):
        with torch_dynamo.pytorch_ddp_optimizer():
            assert torch._dynamo.config.optimize_ddp == "ddp_optimizer"


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


# -- aot/torch_aot.py -------------------------------------------------------------------------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_outside_any_compile_makes_real_tensors_while_a_compile_is_in_progress():
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    in_progress = FakeTensorMode()
    with canary("aot/torch_aot.py:outside_any_compile"):
        with tracing(TracingContext(in_progress)), in_progress:
            assert isinstance(torch.zeros(2), FakeTensor)  # what a rank waiting inside a backend would make
            with torch_aot.outside_any_compile():
                assert not isinstance(torch.zeros(2), FakeTensor) and TracingContext.try_get() is None
            assert TracingContext.try_get() is not None and isinstance(torch.zeros(2), FakeTensor)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_fake_mode_and_hooks_while_a_backend_runs():
    with canary(
        "aot/torch_aot.py:fake_mode_of/is_fake/aot_autograd_backend, aot/torch_dynamo.py:saved_tensors_hooks_disabled"
    ):
        seen = {}

        def backend(gm, example_inputs):
            fake = torch_aot.fake_mode_of(list(example_inputs))
            seen["fake"] = torch_aot.is_fake(fake.from_tensor(torch.randn(2)))
            with torch_dynamo.saved_tensors_hooks_disabled():
                return torch_aot.aot_autograd_backend(
                    fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward
                )(gm, example_inputs)

        w = torch.randn(4, requires_grad=True)
        torch.compile(lambda x: (x * w).sum(), backend=backend)(torch.randn(4))
        assert seen == {"fake": True}


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_an_added_example_input_is_a_static_fake_of_dynamos_mode():
    """AOTAutograd fakeifies a real example with a sourceless size symbol per dimension; an input we add
    beside Dynamo's is handed over as a fake of Dynamo's mode with plain int sizes instead."""
    with canary("aot/torch_aot.py:traced_fake_mode/static_example"):
        seen = {}

        def backend(gm, example_inputs):
            mode = torch_aot.traced_fake_mode(list(example_inputs))
            added = torch_aot.static_example(mode, torch.zeros(148, 7))
            seen["same mode"] = added.fake_mode is mode
            seen["sizes"] = [type(d).__name__ for d in added.shape]
            seen["kept"] = torch_aot.static_example(mode, added) is added
            return gm.forward

        torch.compile(lambda x: x * 2, backend=backend, dynamic=True)(torch.randn(4))
        assert seen == {"same mode": True, "sizes": ["int", "int"], "kept": True}, seen
        assert torch_aot.traced_fake_mode([torch.randn(2)]) is None
        real = torch.randn(2)
        assert torch_aot.static_example(None, real) is real


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_static_tracing_compiles_a_captured_graph_again_on_static_fakes_with_a_shape_env():
    """ddp/in_graph/dispatch.py compiles a graph Dynamo captured once more, after Dynamo's call: inside
    `static_tracing` the inputs become fakes of one mode with a ShapeEnv and plain int sizes, AOTAutograd
    traces them (no symbol, no Dynamo), and the result computes what the graph does."""
    with canary("aot/torch_aot.py:static_tracing"):
        captured = {}

        def backend(gm, example_inputs):
            captured["gm"] = gm
            return gm.forward

        x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
        torch.compile(lambda x, w: torch.tanh(x @ w).sum(), backend=backend)(x, w)
        with torch_aot.static_tracing() as fakeify:
            fakes = fakeify([x, w])
            mode = torch_aot.traced_fake_mode(fakes)
            assert mode is not None and mode.shape_env is not None
            assert all(f.fake_mode is mode for f in fakes)
            assert [type(d).__name__ for f in fakes for d in f.shape] == ["int"] * 4
            compiled = torch_aot.aot_autograd_backend(
                fw_compiler=lambda g, i: g.forward, bw_compiler=lambda g, i: g.forward
            )(captured["gm"], fakes)
            env = mode.shape_env
            symbols = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # 2.14: renamed
            assert not symbols, f"the compile made size symbols: {symbols}"
        (out,) = compiled(x, w)
        out.backward()
        w2 = w.detach().clone().requires_grad_(True)
        torch.tanh(x @ w2).sum().backward()
        torch.testing.assert_close(w.grad, w2.grad)


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_non_lazy_backward_compiles_the_backward_with_the_forward():
    with canary("aot/torch_aot.py:non_lazy_backward"):
        compiled = []

        def backend(gm, example_inputs):
            with torch_aot.non_lazy_backward():
                return torch_aot.aot_autograd_backend(
                    fw_compiler=lambda g, i: compiled.append("fw") or g.forward,
                    bw_compiler=lambda g, i: compiled.append("bw") or g.forward,
                )(gm, example_inputs)

        w = torch.randn(4, requires_grad=True)
        torch.compile(lambda x: (x * w).sin().sum(), backend=backend)(torch.randn(4))
        assert compiled == ["fw", "bw"]  # before any backward ran


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
@pytest.mark.parametrize("declared", [False, True])
def test_a_backward_compiled_with_its_forward_retains_the_graph_only_when_nothing_is_declared_donated(declared):
    """AOTAutograd still marks the saved activations of a graph compiled with its backward as donated
    (then a retaining backward is refused), and the forward compiler can still take that back."""
    from aot import GraphPair, aot_compile, nop_compiler

    def forward_compiler(gm, example_inputs):
        if declared:
            torch_aot.declare_nothing_donated()
        return nop_compiler(gm, example_inputs)

    def backend(gm, example_inputs):
        with torch_aot.non_lazy_backward():
            return aot_compile(
                gm, example_inputs, fw_compiler=forward_compiler, bw_compiler=nop_compiler, pair=GraphPair(name="g")
            )

    with canary("aot/torch_aot.py:declare_nothing_donated"):
        w, x = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4)
        out = torch.compile(lambda x: torch.tanh(x @ w) @ w, backend=backend)(x)
        if declared:
            out.sum().backward(retain_graph=True)
            out.pow(2).sum().backward()
            w2 = w.detach().clone().requires_grad_(True)
            eager = torch.tanh(x @ w2) @ w2
            eager.sum().backward(retain_graph=True)
            eager.pow(2).sum().backward()
            torch.testing.assert_close(w.grad, w2.grad)
        else:
            with pytest.raises(RuntimeError, match="donated buffers"):
                out.sum().backward(retain_graph=True)
