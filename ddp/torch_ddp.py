"""Every private piece of `DistributedDataParallel` this project relies on, and the private functional
collectives the in-graph all-reduce issues, in one place.

A torch upgrade that renames or reshapes one of these breaks us here and nowhere else, and
`tests/single/test_torch_internals_ddp.py` has one canary per function that fails with a message naming
the function and the torch file it mirrors. Everything is read from torch 2.13's
`torch/nn/parallel/distributed.py` (called `distributed.py` below) unless a function says otherwise.
Public DDP API (`register_comm_hook`, `no_sync`, `process_group`, `bucket_bytes_cap`, ...) is used
directly elsewhere and does not belong here. Replacing DDP's reducer by one we build (on our buckets, or an
idle one) is in `ddp/torch_ddp_reducer.py`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


@contextlib.contextmanager
def hidden_from_dynamo() -> Iterator[None]:
    """Clear DDP's "active module" slot while our own compiled code runs.

    Mirrors `DistributedDataParallel._active_ddp_module` / `_inside_ddp_forward` (distributed.py):
    Dynamo reads the slot and, when it is set and `optimize_ddp` is on, wraps the backend in its
    DDPOptimizer. Our backends split (or reduce) themselves, so the slot must look empty.
    """
    saved = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = None
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = saved


def active_ddp_module() -> DistributedDataParallel | None:
    """The DDP model whose forward is running now (None outside any); the slot `hidden_from_dynamo` clears
    (`DistributedDataParallel._get_active_ddp_module`, distributed.py)."""
    return DistributedDataParallel._get_active_ddp_module()


def comm_hooks(ddp: DistributedDataParallel) -> list[tuple[Callable[..., Any], Any]]:
    """(hook, state) pairs the user registered (`register_comm_hook` appends to `_comm_hooks`)."""
    return list(ddp._comm_hooks)


def builtin_comm_hook(ddp: DistributedDataParallel) -> str | None:
    """The name of a C++ comm hook registered with `_register_builtin_comm_hook`, else None.

    Mirrors `DistributedDataParallel._register_builtin_comm_hook` (distributed.py), which tells only
    DDP's logger (`_set_comm_hook_name`) and the reducer: `_comm_hooks` never lists it. The logger's
    record (`_get_ddp_logging_data()["comm_hook"]`) names every hook; a name with no Python hook
    behind it is a builtin one.
    """
    name = ddp._get_ddp_logging_data().get("comm_hook") or None
    if name is None or any(hook.__qualname__ == name for hook, _ in ddp._comm_hooks):
        return None
    return str(name)


def compress_wrapper_parts(hook: Callable[..., Any]) -> tuple[torch.dtype, Callable[..., Any]] | None:
    """(dtype, wrapped hook) for a hook made by `fp16_compress_wrapper` / `bf16_compress_wrapper`.

    Mirrors `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`: each wrapper returns a
    closure (`fp16_compress_wrapper_hook`, `bf16_compress_wrapper_hook`) over the wrapped `hook`.
    """
    dtypes = {"fp16_compress_wrapper_hook": torch.float16, "bf16_compress_wrapper_hook": torch.bfloat16}
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name not in dtypes or "hook" not in code.co_freevars:
        return None
    inner = hook.__closure__[code.co_freevars.index("hook")].cell_contents
    return dtypes[code.co_name], inner


def keep_static_graph_reducer_idle(ddp: DistributedDataParallel) -> None:
    """Stop a `static_graph=True` DDP from queueing its reducer's delayed all-reduce.

    Mirrors `_DDPSink.backward` and `_post_forward` (distributed.py): with static_graph, the first
    backward queues `reducer._delay_all_reduce` unless `_static_graph_delay_allreduce_enqueued` is
    set, and that call asserts the reducer was prepared for a backward, which it is not while our
    compiled backward reduces instead (`require_backward_grad_sync` is off during the forward).
    """
    ddp._static_graph_delay_allreduce_enqueued = True


def queue_static_graph_first_backward(ddp: DistributedDataParallel) -> None:
    """Make the backward of this forward a `static_graph=True` DDP's first again, for a reducer just put in place.

    Mirrors `_set_static_graph` and `_DDPSink.backward` (distributed.py): while
    `_static_graph_delay_allreduce_enqueued` is unset, DDP's forward routes its output through `_DDPSink`, whose
    backward queues `reducer._delay_all_reduce`: the reducer's first backward counts how often each gradient
    hook fires and reduces every bucket at its end. Only before a synchronising forward, on a reducer that has seen
    no backward: `_delay_all_reduce` asserts the reducer was prepared for a backward, which a `no_sync()` forward
    does not do, and a reducer counts the hooks of every backward until its first ends (`reducer.cpp`,
    `num_bwd_calls_`).
    """
    ddp._static_graph_delay_allreduce_enqueued = False


def ignored_names(ddp: DistributedDataParallel) -> frozenset[str]:
    """Fully qualified names DDP neither reduces nor broadcasts (`parameters_to_ignore`)."""
    return frozenset(getattr(ddp, "parameters_to_ignore", ()) or ())


def join_enabled(ddp: DistributedDataParallel) -> bool:
    """Whether `ddp.join()` (uneven inputs) is on: `Join` sets each joinable's `_join_config`
    (`torch/distributed/algorithms/join.py`), and DDP's forward then tells early-joined ranks, which
    shadow its reducer's all-reduces, whether to sync."""
    config = getattr(ddp, "_join_config", None)
    return bool(config is not None and config.enable)


def has_gradient_hooks(param: torch.Tensor) -> bool:
    """Whether a hook transforms or reads `param`'s local gradient before DDP would reduce it.

    `Tensor.register_hook` on a leaf keeps its hooks in `_backward_hooks` and
    `register_post_accumulate_grad_hook` in `_post_accumulate_grad_hooks` (`torch/_tensor.py`); both
    run at the parameter's AccumulateGrad, where eager DDP's reducer hook also sits, so in eager DDP
    they see the rank's own gradient. A removed hook leaves an empty dict behind.
    """
    return bool(getattr(param, "_backward_hooks", None)) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


_REDUCER_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""DDP object -> (parameters, sparse flags) its own reducer was built with (see `reducer_params`)."""


def reducer_params(ddp: DistributedDataParallel) -> tuple[list[torch.nn.Parameter], list[bool]]:
    """The parameters DDP's reducer indexes, in its order, and their sparse-gradient flags.

    Mirrors `DistributedDataParallel._build_params_for_reducer` (distributed.py) as DDP ran it when it
    built its reducer: bucket layouts given to a `Reducer` are lists of indices into exactly this list.
    Running that method later drops a parameter frozen since (`requires_grad_(False)` after wrapping), which
    DDP's reducer still holds and reduces once the script unfreezes it (a fine-tuning schedule). So the first
    call checks the count against the one DDP logged when it built its reducer (`num_parameter_tensors`)
    and, where they differ, reads the parameters from the reducer's buckets; every later call returns the same
    list (the reducers we install in place of DDP's reduce the same parameters).
    """
    known = _REDUCER_PARAMS.get(ddp)
    if known is None:
        params, sparse = ddp._build_params_for_reducer()
        built_with = ddp._get_ddp_logging_data().get("num_parameter_tensors")
        if built_with is not None and built_with != len(params):
            params, sparse = _params_in_buckets(ddp, list(params), list(sparse))
        known = _REDUCER_PARAMS[ddp] = (list(params), list(sparse))
    return list(known[0]), list(known[1])


def _params_in_buckets(
    ddp: DistributedDataParallel, now: list[torch.nn.Parameter], sparse_now: list[bool]
) -> tuple[list[torch.nn.Parameter], list[bool]]:
    """The parameters in the buckets of DDP's reducer (`Reducer::get_grad_buckets` with zeros: a moment's
    allocation of the gradients' bytes), in `_build_params_for_reducer`'s order."""
    try:
        held = {id(p) for bucket in ddp.reducer._get_zeros_like_grad_buckets() for p in bucket.parameters()}
    except RuntimeError as err:  # a sparse gradient's bucket has no flat buffer to copy
        log.warning(
            "ddp: some parameters' requires_grad changed after DDP wrapped the model, and its reducer's buckets "
            "cannot be read (%s): a parameter frozen after wrapping and unfrozen later will not be reduced; "
            "freeze parameters before wrapping the model in DDP",
            err,
        )
        return now, sparse_now
    owners: dict[int, tuple[torch.nn.Module, torch.nn.Parameter]] = {}
    for module in ddp.module.modules():
        for param in module.parameters(recurse=False):
            if id(param) in held:
                owners.setdefault(id(param), (module, param))  # a shared parameter: its first module
    return [p for _, p in owners.values()], [_sparse_gradient(m) for m, _ in owners.values()]


def reducer_param_names(ddp: DistributedDataParallel, params: list[torch.nn.Parameter]) -> dict[int, str]:
    """Index in `params` -> the parameter's name in the wrapped module, the `param_to_name_mapping` a `Reducer`
    takes. Mirrors `DistributedDataParallel._build_debug_param_to_name_mapping` (distributed.py), which
    refuses a parameter frozen since DDP built its reducer (it reads `requires_grad` now; see `reducer_params`)."""
    index = {id(p): i for i, p in enumerate(params)}
    names: dict[int, str] = {}
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in index:
                names.setdefault(index[id(param)], f"{module_name}.{param_name}")
    if len(names) != len(params):
        missing = [i for i in range(len(params)) if i not in names]
        raise ValueError(f"ddp: parameters {missing} of the reducer are not in the wrapped module")
    return names


def _sparse_gradient(module: torch.nn.Module) -> bool:
    # `produces_sparse_gradient` inside `_build_params_for_reducer` (distributed.py)
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and bool(module.sparse)


def reducer_bucket_elements(ddp: DistributedDataParallel) -> int:
    """Elements in the gradient buckets DDP's reducer holds (for tests; see `_bucket_copies`)."""
    return sum(buffer.numel() for buffer in _bucket_copies(ddp))


def reducer_bucket_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of the gradient buckets DDP's reducer holds (see `_bucket_copies`: call it outside anything measured)."""
    return sum(buffer.numel() * buffer.element_size() for buffer in _bucket_copies(ddp))


def _bucket_copies(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    """A zero copy of each bucket buffer of DDP's reducer (`Reducer::get_grad_buckets` with zeros, exposed as
    `_get_zeros_like_grad_buckets`): it allocates the buckets' bytes for a moment."""
    return [bucket.buffer() for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def default_store() -> dist.Store:
    """The key-value store the default process group was initialised with.

    Mirrors `torch.distributed.distributed_c10d._get_default_store`. Exchanges through the store
    never enter a process group's collective sequence, so a rank that takes part alone cannot
    pair up with another rank's gradient all-reduce; it times out instead.
    """
    return dist.distributed_c10d._get_default_store()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the current backward pass has finished (call from inside the backward).

    Mirrors DDP's reducer and `_DDPSink` (distributed.py), which finish their work through
    `Variable._execution_engine.queue_callback`.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def functional_all_reduce_ops() -> tuple[Any, Any]:
    """(all_reduce, wait_tensor): the functional collective ops an FX graph can hold.

    Mirrors `torch.ops._c10d_functional.all_reduce.default(tensor, reduce_op, group_name)` and
    `wait_tensor.default(tensor)` (`torch/csrc/distributed/c10d/Functional.cpp`, registered by
    `torch/distributed/_functional_collectives.py`), which Inductor lowers and schedules like any op.
    """
    ops = torch.ops._c10d_functional
    return ops.all_reduce.default, ops.wait_tensor.default


def functional_all_reduce_sum(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `tensor` over `group`, as a new (lazily waited) tensor; `tensor` is left alone.

    Mirrors `torch.distributed._functional_collectives.all_reduce(tensor, "sum", group)`, what DDP's
    python reducer issues per gradient under compiled autograd (`distributed.py`).
    """
    import torch.distributed._functional_collectives as fcol

    return fcol.all_reduce(tensor, "sum", group)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by `group_name`.

    Mirrors `torch.distributed.distributed_c10d._resolve_process_group`, which the functional
    collectives themselves use to turn the name in the graph back into a group at run time.
    """
    return dist.distributed_c10d._resolve_process_group(group_name)


def register_pending(tensor: torch.Tensor, wait: Callable[[], None]) -> None:
    """Make `_c10d_functional.wait_tensor(tensor)` call `wait()` before it returns `tensor`.

    Mirrors the functional collectives' work registry: `torch._C._distributed_c10d._register_work`
    (`torch/csrc/distributed/c10d/Functional.cpp`: `wait_tensor` takes the work registered for the
    tensor's storage and waits for it) and `PythonCallbackWork` (`CallbackWork.cpp`: its `wait(timeout)`
    calls the Python callback, which returns whether it succeeded).
    """
    c10d = torch._C._distributed_c10d

    def callback(timeout: Any) -> bool:
        wait()
        return True

    c10d._register_work(tensor, c10d.PythonCallbackWork(callback))


# -- what this torch offers (python -m compile_core.doctor; compile-time refusals) ---------------------------


@functools.cache
def capabilities() -> dict[str, tuple[bool, str]]:
    """What this torch's DDP and c10d offer the layers above: `{feature: (available, how)}`.

    Each check asks for the names the functions above and those of `ddp/torch_ddp_reducer.py` use (not the
    torch version); `how` is for people
    (`python -m compile_core.doctor` prints it), decisions read the boolean (`blocker`). Checked on torch
    2.11.0, 2.13.0 and 2.14.1, where every feature is available.
    """
    found: dict[str, tuple[bool, str]] = {}
    doc = (getattr(dist, "Reducer", None) and dist.Reducer.__init__.__doc__) or ""
    wanted = ("bucket_indices", "per_bucket_size_limits", "bucket_bytes_cap_list", "param_to_name_mapping")
    missing = [k for k in wanted if f"{k}:" not in doc]
    if not hasattr(DistributedDataParallel, "_build_params_for_reducer"):
        missing.append("DistributedDataParallel._build_params_for_reducer")
    found["ddp.reducer_layout"] = (
        (True, "dist.Reducer takes a bucket layout and per-bucket caps: DDP's reducer can be rebuilt on our buckets")
        if not missing
        else (False, f"DDP's reducer cannot be rebuilt on given buckets (missing: {', '.join(missing)})")
    )
    batched = "batched_grad_copy" in inspect.signature(DistributedDataParallel.__init__).parameters
    found["ddp.batched_grad_copy"] = (
        True,
        "DDP's batched_grad_copy is passed on to the reducers we build"
        if batched
        else "this DDP has no batched_grad_copy option: our reducers are built without it, as DDP builds its own",
    )
    ops = getattr(torch.ops, "_c10d_functional", None)
    functional = all(hasattr(ops, name) for name in ("all_reduce", "wait_tensor")) if ops is not None else False
    found["ddp.functional_collectives"] = (
        (True, "_c10d_functional.all_reduce/wait_tensor: collectives a compiled graph can hold")
        if functional
        else (False, "no _c10d_functional.all_reduce/wait_tensor ops: a graph cannot issue its own all-reduce")
    )
    return found


_NEEDED_BY_MODE = {
    "split": ("ddp.reducer_layout",),
    "in_graph": ("ddp.reducer_layout", "ddp.functional_collectives"),
}
"""The features of `capabilities` each `ddp=` mode cannot work without (modes not listed need none)."""


def blocker(ddp_mode: str, *, backend: str = "inductor", nested_regions: bool = False) -> str | None:
    """Why `ddp=ddp_mode` cannot work with this torch's DDP (None when it can); for a compile-time refusal."""
    table = capabilities()
    why = [table[key][1] for key in _NEEDED_BY_MODE.get(ddp_mode, ()) if not table[key][0]]
    return "; ".join(why) or None
