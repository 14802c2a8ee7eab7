"""Every piece of Inductor's Python API this project relies on, in one place.

`list_options` / `list_mode_options` are documented next to `torch.compile`; `compile_fx` and
`compile_fx_inner` (`torch/_inductor/compile_fx.py`) are Inductor's private entry points: the
outer one runs AOTAutograd with Inductor's decompositions and partitioner, the inner one compiles
one forward or backward graph. `tests/single/test_torch_internals_inductor.py` has a canary per function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn


def option_names() -> frozenset[str]:
    """Every Inductor config name `options=` may set (`torch._inductor.list_options()`)."""
    import torch._inductor

    return frozenset(torch._inductor.list_options())


def mode_names() -> tuple[str, ...]:
    """The modes this torch's `torch.compile` accepts (2.11-2.14 add `lite` to the four of earlier releases)."""
    import torch._inductor

    return tuple(torch._inductor.list_mode_options())


def mode_options(mode: str, dynamic: bool | None) -> dict[str, Any]:
    """The Inductor config a `torch.compile` mode stands for (`torch._inductor.list_mode_options`)."""
    import torch._inductor

    return dict(torch._inductor.list_mode_options(mode, dynamic))


def compile_fx_with(
    gm: fx.GraphModule,
    example_inputs: list,
    *,
    on_graph: Callable[[fx.GraphModule, bool], None],
    config_patches: Mapping[str, Any] | None,
) -> Callable[..., Any]:
    """Inductor's `compile_fx`, calling `on_graph(graph, is_backward)` before each inner compile.

    Mirrors `compile_fx(..., inner_compile=)` and `compile_fx_inner(..., is_backward=)`
    (`torch/_inductor/compile_fx.py`).
    """
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    remember_isa_probes()

    def inner_compile(graph: fx.GraphModule, inputs: list, **kwargs: Any) -> Any:
        on_graph(graph, bool(kwargs.get("is_backward", False)))
        return compile_fx_inner(graph, inputs, **kwargs)

    return compile_fx(
        gm, example_inputs, inner_compile=inner_compile, config_patches=dict(config_patches or {}) or None
    )


ISA_PROBE_MARK = ".dlopen_ok."
"""Suffix (then a hash of the process's environment) of the file that says a probe library loaded."""


def remember_isa_probes() -> None:
    """Let Inductor's CPU vector-ISA probe trust an earlier success on this host (once per process).

    Mirrors `VecISA.check_build` / `VecISA._probe_load` (`torch/_inductor/cpu_vec_isa.py`): in every
    process, for each ISA the CPU reports (3 on an AVX-512 machine, checked twice for AVX-512), Inductor
    compiles a small library into its cache dir (kept: the path hashes the compiler version, the ISA flags
    and the torch version) and then starts a child Python to `dlopen` it, about 0.16 s a child and 1 s
    per process here: a quarter of a warm start of our one-graph modes. We keep the load step and remember
    its success in a file next to the library, named by a hash of what else the load depends on (host,
    interpreter, torch build, `LD_LIBRARY_PATH`). A later process with the same library and the same hash
    skips the child. A failed or hung probe is not remembered, so it is tried again, as torch would.
    """
    import torch._inductor.cpu_vec_isa as vec_isa

    probe = getattr(vec_isa.VecISA, "_probe_load", None)
    if probe is None or getattr(probe, "_remembers", False):
        # None: a torch whose probe has no separate load step (2.11), so nothing to remember; Inductor
        # probes as it always did (a missing name here failed every Inductor compile on an H100 with 2.11)
        return

    def probe_load(self: Any, output_path: str) -> bool:
        mark = output_path + ISA_PROBE_MARK + _probe_environment()
        if os.path.isfile(mark) and os.path.isfile(output_path):
            return True
        ok = probe(self, output_path)
        if ok:
            _touch_atomically(mark)
        return ok

    probe_load._remembers = True  # type: ignore[attr-defined]
    vec_isa.VecISA._probe_load = probe_load


def _probe_environment() -> str:
    import hashlib
    import platform
    import sys

    parts = (platform.node(), sys.executable, torch.__version__, str(torch.version.git_version))
    parts += (os.environ.get("LD_LIBRARY_PATH", ""),)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _touch_atomically(path: str) -> None:
    import tempfile

    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".isa_probe")
        os.close(fd)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache dir: the next process probes again, as without us


def cache_dir() -> str:
    """The directory Inductor keeps its on-disk caches in (`TORCHINDUCTOR_CACHE_DIR` or a per-user
    default), created if missing (`torch/_inductor/runtime/cache_dir_utils.py:cache_dir`)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return inductor_cache_dir()


def disk_caches_enabled() -> bool:
    """Whether a compile can be loaded from disk: the local AOTAutograd and FX graph caches are on.

    Mirrors `should_use_local_autograd_cache` (`_functorch/_aot_autograd/autograd_cache.py`) and
    `torch._inductor.config.fx_graph_cache` (`_inductor/config.py`).
    """
    import torch
    import torch._inductor.config as inductor_config

    if torch.compiler.config.force_disable_caches:
        return False
    return bool(torch._functorch.config.enable_autograd_cache and inductor_config.fx_graph_cache)


def decompositions() -> dict:
    """Inductor's decomposition table (`torch/_inductor/decomposition.py`): graphs spliced into an
    Inductor graph after AOTAutograd ran must already be in these terms."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def order_after(graph: fx.Graph, deps: dict[fx.Node, list[fx.Node]]) -> None:
    """Make each node in `deps` run after the nodes listed for it, whatever Inductor's scheduler prefers.

    Mirrors `torch/_inductor/fx_passes/control_dependencies.py: preserve_node_ordering`: the node
    is wrapped in the `control_deps` higher-order op, which Inductor lowers keeping the order and
    which runs eagerly (aot_eager) as the node itself.
    """
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    _run_control_deps_below_autograd()
    preserve_node_ordering(graph, {node: OrderedSet(before) for node, before in deps.items() if before})


def _run_control_deps_below_autograd() -> None:
    """Give `control_deps` an Autograd kernel where this torch has none (2.11 has none; 2.13 has one).

    A backward graph run eagerly (aot_eager, or a fallback) calls the op on parameters, which require
    grad, so the dispatcher asks for its AutogradCUDA/AutogradCPU kernel even with grad mode off: without
    one every ordered backward raised "could not find kernel for HigherOrderOperator control_deps" (seen
    on an H100 with torch 2.11). The kernel only runs the wrapped node, as 2.13's does.
    """
    from torch._C import DispatchKey
    from torch._inductor.fx_passes.control_dependencies import control_deps

    if DispatchKey.Autograd in control_deps.py_kernels:
        return

    def _below_autograd(additional_deps, subgraph, *args, **kwargs):
        return subgraph(*args, **kwargs)

    _below_autograd._ours = True  # type: ignore[attr-defined] # capabilities() tells torch's kernel from ours
    control_deps.py_impl(DispatchKey.Autograd)(_below_autograd)


def partitioner_patch(
    partition: Callable[..., Any], uuid: str, patches: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Inductor config that runs `partition(joint_gm, joint_inputs, base=..., **kwargs)` instead of min-cut.

    Mirrors `torch._inductor.config.custom_partitioner_fn`, a `CustomPartitionerFn`
    (`torch/_inductor/custom_graph_pass.py`): Inductor still runs its joint-graph passes first, and
    `uuid` goes into the AOTAutograd/FX cache keys, so it must change whenever `partition` would
    produce other graphs. Inductor pickles its config into those keys: the partitioner pickles as
    its uuid alone.

    A user's own settings are kept, not replaced: their `custom_partitioner_fn` (from `patches`, the
    options given to us, else the global config) is handed to `partition` as `base`, the partition
    step it builds on (its uuid joins ours), and their `unsafe_marked_cacheable_functions` are merged
    with the op we mark.
    """
    import torch._inductor.config as inductor_config

    patches = dict(patches or {})
    user = patches.get("custom_partitioner_fn", inductor_config.custom_partitioner_fn)
    cacheable = dict(
        patches.get("unsafe_marked_cacheable_functions", inductor_config.unsafe_marked_cacheable_functions) or {}
    )
    cacheable[control_deps_name()] = torch.__version__
    if user is not None:
        uuid = f"{uuid}+{user.uuid() if hasattr(user, 'uuid') else repr(user)}"
    return {
        "custom_partitioner_fn": _Partitioner(partition, uuid, base=user),
        "unsafe_marked_cacheable_functions": cacheable,
    }


def control_deps_name() -> str:
    """`order_after`'s higher-order op, by the name `HigherOrderOperator.cacheable()` looks up in
    `torch._inductor.config.unsafe_marked_cacheable_functions` (`torch/_ops.py`).

    Inductor's FX graph cache refuses a graph holding a HOP not marked cacheable, so a backward
    ordered with it was compiled again on every warm start. Marking it is safe for our graphs: the
    cache key pickles each GraphModule with its submodules (the HOP's subgraphs, code included),
    and the partitioner's uuid names everything `order_after` was asked to do.
    """
    from torch._inductor.fx_passes.control_dependencies import control_deps

    return f"{control_deps.__module__}.{control_deps.__name__}"


class _UuidOnlyPartitioner(CustomPartitionerFn):
    """What a pickled partitioner turns into: enough for a cache key, not for partitioning."""

    def __init__(self, uuid: str) -> None:
        self._uuid = uuid

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a partitioner restored from a cache key cannot partition")

    def uuid(self) -> str:
        return self._uuid


class _Partitioner(_UuidOnlyPartitioner):
    def __init__(self, partition: Callable[..., Any], uuid: str, base: Callable[..., Any] | None = None) -> None:
        super().__init__(uuid)
        self._partition = partition
        self._base = base

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        return self._partition(gm, joint_inputs, base=self._base, **kwargs)

    def __reduce__(self) -> tuple:
        return (_UuidOnlyPartitioner, (self._uuid,))


@contextlib.contextmanager
def fresh_cache_artifacts() -> Iterator[Callable[[], bytes | None]]:
    """Record the compile caches' artifacts of what runs inside on their own; yields `save()`, which
    returns them as `torch.compiler.load_cache_artifacts` bytes (None when nothing was recorded).

    Mirrors `CacheArtifactManager.with_fresh_cache` (`torch/compiler/_cache.py`): the mega-cache
    normally accumulates everything a process compiled, and `save_cache_artifacts()` hands all of it
    over. Inside, only this block's artifacts (AOTAutograd entry, FX graph entries, autotune results,
    on a miss and on a hit alike) are there. On the way out they are recorded again in the outer
    collection, so a user's own `torch.compiler.save_cache_artifacts()` still sees them.
    """
    from torch.compiler._cache import CacheArtifactManager

    captured: list[tuple[str, Any]] = []

    def save() -> bytes | None:
        for kind, artifacts in CacheArtifactManager._new_cache_artifacts.items():
            captured.extend((kind, a) for a in artifacts)
        result = torch.compiler.save_cache_artifacts()
        return None if result is None else result[0]

    with CacheArtifactManager.with_fresh_cache():
        yield save
        for kind, artifacts in CacheArtifactManager._new_cache_artifacts.items():
            captured.extend((kind, a) for a in artifacts)  # recorded after the last save()
    for kind, artifact in captured:
        if artifact not in CacheArtifactManager._seen_artifacts:
            CacheArtifactManager._new_cache_artifacts[kind].append(artifact)
            CacheArtifactManager._seen_artifacts.add(artifact)


KERNEL_LIBRARY = re.compile(r"^[a-z0-9]{2}/[a-z0-9]{52}(\.main)?\.so$")
"""A C++ kernel library's path inside the cache dir: `<2 chars>/c<51 chars of its hash>[.main].so`."""


def kernel_libraries(directory: str) -> set[str]:
    """Paths (relative to the Inductor cache dir `directory`) of the compiled C++ kernel libraries in it.

    Mirrors where `CppCodeCache` / `CppPythonBindingsCodeCache` (`torch/_inductor/codecache.py`,
    via `write()` and `get_path()`) put a kernel: `<cache dir>/<key[1:3]>/<key>.so`, the key a hash of
    the kernel's source and compile command. The path does not depend on the cache dir, so a library
    copied under the same relative path into another node's cache dir is found there and not built
    again. The mega-cache (`save_cache_artifacts`) holds the kernels' source but not the libraries:
    without them a node that loads another node's compile still runs the C++ compiler per kernel.
    """
    found = set()
    try:
        subdirs = [e.name for e in os.scandir(directory) if e.is_dir() and len(e.name) == 2]
    except OSError:
        return found
    for sub in subdirs:
        try:
            names = os.listdir(os.path.join(directory, sub))
        except OSError:
            continue
        found.update(f"{sub}/{n}" for n in names if KERNEL_LIBRARY.match(f"{sub}/{n}"))
    return found


# -- what this torch offers (python -m compile_core.doctor; compile-time refusals) ---------------------------


def capabilities() -> dict[str, tuple[bool, str]]:
    """What this torch's Inductor offers the layers above: `{feature: (available, how)}`.

    Each check asks for the names the functions above use (not the torch version); `how` is for people
    (`python -m compile_core.doctor` prints it), decisions read the boolean (`blocker`). Checked on torch
    2.11.0, 2.13.0 and 2.14.1, where every feature is available (some through our own stand-in).
    """
    return {name: check() for name, check in _CHECKS.items()}


@functools.cache
def _compile_fx_hook() -> tuple[bool, str]:
    from torch._inductor.compile_fx import compile_fx

    if "inner_compile" in inspect.signature(compile_fx).parameters:
        return True, "compile_fx(inner_compile=...): each forward/backward graph is seen before it is compiled"
    return False, "compile_fx takes no inner_compile: the compiled graphs cannot be watched"


@functools.cache
def _custom_partitioner() -> tuple[bool, str]:
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "custom_partitioner_fn") and hasattr(
        inductor_config, "unsafe_marked_cacheable_functions"
    ):
        return True, "custom_partitioner_fn and unsafe_marked_cacheable_functions: ddp='in_graph' partitions, cached"
    return False, "Inductor's config has no custom_partitioner_fn/unsafe_marked_cacheable_functions"


def _ordering() -> tuple[bool, str]:
    try:
        from torch._inductor.fx_passes.control_dependencies import control_deps, preserve_node_ordering  # noqa: F401
    except ImportError:
        return False, "no control_deps/preserve_node_ordering: in-graph all-reduces cannot be ordered"
    from torch._C import DispatchKey

    kernel = control_deps.py_kernels.get(DispatchKey.Autograd)
    if kernel is not None and not getattr(kernel, "_ours", False):
        return True, "control_deps pins the order of in-graph all-reduces"
    return True, "control_deps pins the order of in-graph all-reduces (this torch gives it no Autograd kernel: ours)"


def _isa_probe_memo() -> tuple[bool, str]:
    import torch._inductor.cpu_vec_isa as vec_isa

    if hasattr(vec_isa.VecISA, "_probe_load"):
        return True, "a CPU ISA probe library that loaded once is not probed again in a child process"
    return True, "VecISA has no separate load step: Inductor probes the CPU's ISA in each process, as it always did"


def _cache_artifacts() -> tuple[bool, str]:
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        CacheArtifactManager = None
    if CacheArtifactManager is not None and hasattr(CacheArtifactManager, "with_fresh_cache"):
        return True, "one compile's cache artifacts can be shipped to other ranks (compile once per job)"
    return False, "no CacheArtifactManager.with_fresh_cache: compiled pieces cannot be shipped between ranks"


_CHECKS: dict[str, Callable[[], tuple[bool, str]]] = {
    "inductor.compile_fx_hook": _compile_fx_hook,
    "inductor.custom_partitioner": _custom_partitioner,
    "inductor.ordering": _ordering,
    "inductor.isa_probe_memo": _isa_probe_memo,
    "inductor.cache_artifacts": _cache_artifacts,
}


def blocker(ddp_mode: str, *, backend: str = "inductor", nested_regions: bool = False) -> str | None:
    """Why `ddp=ddp_mode` with `backend` cannot work with this torch's Inductor (None when it can); for a
    compile-time refusal."""
    needed = []
    if ddp_mode == "in_graph":
        needed.append("inductor.ordering")  # the graph pass orders all-reduces on every backend
    if backend == "inductor":
        needed.append("inductor.compile_fx_hook")
        if ddp_mode == "in_graph":
            needed.append("inductor.custom_partitioner")
    why = [text for ok, text in (_CHECKS[key]() for key in needed) if not ok]
    return "; ".join(why) or None
