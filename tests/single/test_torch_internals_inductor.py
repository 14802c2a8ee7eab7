"""Canaries of inductor/torch_inductor.py: option tables, cache dir and artifacts, the ISA probe, compile_fx, and
what ddp="in_graph" asks of Inductor: its partitioner patch, the ordering op (see torch_internals_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from inductor import torch_inductor
from tests.single.torch_internals_helpers import canary

pytestmark = pytest.mark.usefixtures("pg")


# -- inductor/torch_inductor.py ---------------------------------------------------------------------


# Canary on torch 2.11.0, 2.13.0, 2.14.1.
def test_inductor_option_and_mode_tables():
    with canary("inductor/torch_inductor.py:option_names/mode_names/mode_options"):
        assert "max_autotune" in torch_inductor.option_names()
        assert {"default", "lite", "reduce-overhead", "max-autotune"} <= set(torch_inductor.mode_names())
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


# -- what ddp="in_graph" asks of inductor/torch_inductor.py: the partitioner, caches, ordering ------


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
