"""DDP's reducer replaced by one we build, in one place (a home of private torch internals, like
`ddp/torch_ddp.py`): whether DDP's options let a replacement keep its behaviour (`reducer_swap_blocker`), a
reducer on our bucket layout (`install_reducer`, `cut_static_layout`), an idle one that frees DDP's gradient buckets
(`release_reducer_buckets`), and one with buckets again (`restore_reducer_buckets`).

Everything is read from torch 2.13's `torch/nn/parallel/distributed.py` (called `distributed.py` below) and
`reducer.cpp` unless a function says otherwise; `tests/single/test_torch_internals_ddp.py` has their canaries.
What we read of DDP without replacing anything (its parameters in the reducer's order, hooks, flags, the
buckets its reducer holds) is in `ddp/torch_ddp.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp.torch_ddp import comm_hooks, reducer_param_names, reducer_params


@dataclasses.dataclass(frozen=True)
class DDPOptionBlocker:
    """A DDP construction option that a reducer built by us cannot reproduce."""

    option: str
    """Which option: one of `BLOCKING_OPTIONS` (decisions read this, never `text`)."""
    text: str
    """The same, for people."""


BLOCKING_OPTIONS = ("python_reducer", "mixed_precision", "delayed_all_reduce", "sparse_gradients")


def reducer_swap_blocker(ddp: DistributedDataParallel) -> DDPOptionBlocker | None:
    """Why a replacement reducer could not keep DDP's behaviour (None when it can).

    Each flag is a DDP construction option the reducer we build cannot reproduce: the python
    reducer (`_use_python_reducer`), `mixed_precision` and delayed all-reduce parameters
    (`_delay_all_reduce_params`) (distributed.py, `__init__`). `static_graph` it reproduces (`install_reducer`).
    """
    if getattr(ddp, "_use_python_reducer", False):
        return DDPOptionBlocker("python_reducer", "DDP uses the python reducer")
    if getattr(ddp, "mixed_precision", None) is not None:
        return DDPOptionBlocker("mixed_precision", "DDP mixed_precision is set")
    if getattr(ddp, "_delay_all_reduce_params", None):
        return DDPOptionBlocker("delayed_all_reduce", "DDP has delayed all-reduce parameters")
    return None


def install_reducer(
    ddp: DistributedDataParallel,
    params: Sequence[torch.nn.Parameter],
    expect_sparse: Sequence[bool],
    layout: Sequence[Sequence[int]],
) -> bool:
    """Give `ddp` a new `Reducer` whose buckets are `layout` (indices into `params`), keeping its options.

    Mirrors `DistributedDataParallel._ddp_init_helper` (distributed.py): the `dist.Reducer` built
    there, its `dist.Logger`, and `register_comm_hook`'s re-registration through
    `dist._register_comm_hook`.

    A new reducer rebuilds its buckets once, after its first backward, from the order in which
    gradients became ready (`Reducer::rebuild_buckets` in `reducer.cpp`), cut by per-bucket byte
    caps that each dtype/device walks separately (`compute_bucket_assignment_by_size`). Left alone,
    that rebuild can move our boundaries (mixed dtypes, gradients produced outside any graph). So
    the rebuild is done right away, on our terms: parameters are handed to the reducer in bucket
    order, each bucket's caps are chosen so that it closes exactly at its last parameter, and
    `_push_all_rebuilt_params` + `_rebuild_buckets` (a broadcast from rank 0: every rank calls this
    together) freeze that layout (`has_rebuilt_bucket_`). Returns False when no cap list can
    reproduce the layout (several dtypes whose buckets need conflicting caps): then DDP's own
    rebuild runs after the first backward, as before.

    `static_graph=True` (mirrors `DistributedDataParallel._set_static_graph`): the new reducer is static, and its
    first synchronising backward must be a static graph's first, as DDP's own reducer's was (the caller arranges
    it: `ddp.torch_ddp.queue_static_graph_first_backward`). That backward reduces every bucket at its end, handing a
    comm hook bucket 0's index and parameters for each of them (`Reducer::delay_all_reduce`), so a hook counting
    iterations by `bucket.is_last()` (PowerSGD) would miss one. So, as DDP's own first backward does, it runs over
    one bucket per dtype and device (in `layout`'s order, a sparse gradient alone), and the caller cuts `layout`
    once that backward is over (`cut_static_layout`, with the caps chosen here). Returns True there too when the
    caps can reproduce `layout`.
    """
    new_layout, start = [], 0
    for bucket in layout:
        new_layout.append(list(range(start, start + len(bucket))))
        start += len(bucket)
    # Our order inside each bucket if caps can keep it; else each bucket's largest parameter last,
    # which widens the range of caps that close it there.
    for order in ([i for b in layout for i in b], [i for b in layout for i in _largest_last(params, b)]):
        ordered = [params[i] for i in order]
        caps = _rebuild_caps(ordered, new_layout)
        if caps is not None:
            break
    sparse = [expect_sparse[i] for i in order] if expect_sparse else []
    sizes = [_bucket_bytes(ordered, b) for b in new_layout]
    static = bool(getattr(ddp, "static_graph", False))
    first = _one_bucket_per_key(ordered, sparse) if static else new_layout
    first_sizes = [_bucket_bytes(ordered, b) for b in first] if static else sizes
    reducer, logger = _new_reducer(
        ddp, ordered, first, first_sizes, caps or sizes, sparse, reducer_param_names(ddp, ordered)
    )
    if static:
        reducer._set_static_graph()
        logger._set_static_graph()
    # With find_unused_parameters a dynamic-graph reducer never rebuilds: the layout is already final.
    frozen = (ddp.find_unused_parameters and not static) or caps is not None
    if caps is not None and not ddp.find_unused_parameters and not static:
        reducer._push_all_rebuilt_params()
        reducer._rebuild_buckets()
    ddp.reducer = reducer
    ddp.logger = logger
    # The new reducer has no hook yet: the ones registered on the old reducer must keep working.
    for hook, state in comm_hooks(ddp):
        logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(reducer, state, hook)
    ddp._has_rebuilt_buckets = True
    return frozen


def cut_static_layout(ddp: DistributedDataParallel) -> bool:
    """Cut the buckets of a static reducer `install_reducer` put in place to its layout, once its first backward is
    over (a broadcast from rank 0, as in `install_reducer`: every rank calls this together). False when the caps
    could not reproduce the layout or the reducer already rebuilt: DDP then rebuilds from the order gradients became
    ready, after its second backward."""
    ddp.reducer._push_all_rebuilt_params()
    return bool(ddp.reducer._rebuild_buckets())


def _one_bucket_per_key(params: Sequence[torch.nn.Parameter], sparse: Sequence[bool]) -> list[list[int]]:
    """Indices of `params` in one bucket per dtype and device, in order; a sparse gradient in a bucket alone."""
    by_key: dict[tuple, list[int]] = {}
    alone: list[list[int]] = []
    for i, p in enumerate(params):
        if sparse and sparse[i]:
            alone.append([i])
        else:
            by_key.setdefault((p.dtype, p.device), []).append(i)
    return alone + list(by_key.values())


def release_reducer_buckets(ddp: DistributedDataParallel) -> int:
    """Replace DDP's reducer by an idle one that holds no gradient buckets; returns the bytes released.

    For a DDP model whose gradients something else reduces (the compiled backward of ddp='in_graph'):
    DDP allocates a flat bucket buffer for every parameter's gradient when it is built
    (`Reducer::initialize_buckets` in `reducer.cpp`), a full copy of the gradients that sits unused.
    A `dist.Reducer` needs at least one parameter (`reducer.cpp`: "Expected at least one parameter"),
    so the idle one watches a one-element placeholder no graph uses: its single bucket is 1 element.
    DDP's forward only calls its reducer's `_rebuild_buckets` (false: nothing ever became ready) and,
    when it would synchronise, `prepare_for_forward`/`prepare_for_backward`, which the caller keeps off
    (`require_backward_grad_sync` is False during the forward). Options are DDP's own, as in
    `install_reducer`; the comm hook name stays in DDP's logging data.
    """
    params, _ = reducer_params(ddp)
    released = sum(p.numel() * p.element_size() for p in params)
    hook_name = ddp._get_ddp_logging_data().get("comm_hook") or None
    placeholder = torch.nn.Parameter(torch.zeros(1, device=params[0].device if params else None))
    size = [placeholder.element_size()]
    reducer, logger = _new_reducer(ddp, [placeholder], [[0]], size, size, [False], {0: "(idle reducer placeholder)"})
    if hook_name is not None:
        logger._set_comm_hook_name(str(hook_name))
    ddp.reducer = reducer
    ddp.logger = logger
    ddp._has_rebuilt_buckets = True
    return released


def restore_reducer_buckets(ddp: DistributedDataParallel) -> None:
    """Undo `release_reducer_buckets`: a reducer that reduces every parameter again, one bucket per dtype and
    device, the last parameters first (as gradients become ready), through `install_reducer` (its layout
    freeze is a broadcast from rank 0: every rank calls this together)."""
    params, sparse = reducer_params(ddp)
    by_key: dict[tuple, list[int]] = {}
    for i in reversed(range(len(params))):
        by_key.setdefault((params[i].dtype, params[i].device), []).append(i)
    install_reducer(ddp, params, sparse, list(by_key.values()))


def _new_reducer(
    ddp: DistributedDataParallel,
    params: Sequence[torch.nn.Parameter],
    bucket_indices: Sequence[Sequence[int]],
    bucket_bytes: Sequence[int],
    caps: Sequence[int],
    sparse: Sequence[bool],
    names: dict[int, str],
) -> tuple[Any, Any]:
    """A `dist.Reducer` over `params` in `bucket_indices` with `ddp`'s options, and its `dist.Logger`
    (as `DistributedDataParallel._ddp_init_helper` builds them; static_graph is set by `install_reducer`)."""
    cap, first_cap = _bucket_caps(ddp)
    # batched_grad_copy is a DDP option of torch 2.13 (its Reducer keyword came with it): passed where
    # this DDP has it, so older builds (the GPU machines lent here have 2.11) build the same Reducer.
    newer = {"batched_grad_copy": ddp.batched_grad_copy} if hasattr(ddp, "batched_grad_copy") else {}
    # The constructor hooks each parameter's AccumulateGrad node, which a parameter frozen since DDP wrapped
    # it has not got (the process dies in the constructor): it requires grad while the reducer is built, as
    # when DDP built its own. The reducer keeps the node, and the parameter finds it again once unfrozen.
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        reducer = dist.Reducer(
            params=list(params),
            bucket_indices=[list(b) for b in bucket_indices],
            per_bucket_size_limits=list(bucket_bytes),
            process_group=ddp.process_group,
            expect_sparse_gradients=list(sparse),
            bucket_bytes_cap=cap,
            find_unused_parameters=ddp.find_unused_parameters,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            param_to_name_mapping=names,
            first_bucket_bytes_cap=first_cap,
            skip_all_reduce_unused_params=getattr(ddp, "skip_all_reduce_unused_params", False),
            use_python_reducer=False,
            bucket_bytes_cap_list=list(caps),
            **newer,
        )
    finally:
        for p in frozen:
            p.requires_grad_(False)
    logger = dist.Logger(reducer)
    reducer.set_logger(logger)
    logger.set_construction_data_and_log(
        ddp.module.__class__.__name__,
        [] if ddp.device_ids is None else ddp.device_ids,
        -1 if ddp.output_device is None else ddp.output_device,
        _syncs_buffers(ddp),
        any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules()),
        False,
    )
    return reducer, logger


def _syncs_buffers(ddp: DistributedDataParallel) -> bool:
    """Whether DDP syncs buffers in its forward, as its Logger records it: `forward_sync_buffers`
    (torch 2.13), `broadcast_buffers` before it."""
    return bool(ddp.forward_sync_buffers if hasattr(ddp, "forward_sync_buffers") else ddp.broadcast_buffers)


def _bucket_caps(ddp: DistributedDataParallel) -> tuple[int, int]:
    """DDP's bucket cap and first-bucket cap in bytes: `ddp._bucket_config` (torch 2.13); before it,
    `bucket_bytes_cap` with the first bucket at `dist._DEFAULT_FIRST_BUCKET_BYTES` when the user left the
    cap at its default (what `_ddp_init_helper` passes the Reducer there)."""
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        return config.bucket_bytes_cap, config.first_bucket_bytes_cap
    cap = ddp.bucket_bytes_cap
    return cap, (dist._DEFAULT_FIRST_BUCKET_BYTES if getattr(ddp, "bucket_bytes_cap_default", False) else cap)


def _bucket_bytes(params: Sequence[torch.nn.Parameter], bucket: Sequence[int]) -> int:
    return max(1, sum(params[i].numel() * params[i].element_size() for i in bucket))


def _largest_last(params: Sequence[torch.nn.Parameter], bucket: Sequence[int]) -> list[int]:
    """The bucket's parameters with the largest one last: the widest range of caps that close it there."""
    big = max(bucket, key=lambda i: params[i].numel() * params[i].element_size())
    return [i for i in bucket if i != big] + [big]


def _rebuild_caps(params: Sequence[torch.nn.Parameter], layout: Sequence[Sequence[int]]) -> list[int] | None:
    """Per-bucket caps under which the rebuild walk reproduces `layout` exactly, or None.

    Each dtype/device walks the cap list from its start, its j-th bucket closing once its bytes reach
    caps[j]: caps[j] must lie in (bytes - last parameter's bytes, bytes] for the j-th bucket of
    every dtype/device.
    """
    per_key: dict[tuple, list[tuple[int, int]]] = {}
    for bucket in layout:
        key = (params[bucket[0]].dtype, params[bucket[0]].device)
        last = params[bucket[-1]].numel() * params[bucket[-1]].element_size()
        per_key.setdefault(key, []).append((_bucket_bytes(params, bucket), last))
    caps = []
    for j in range(max(len(v) for v in per_key.values())):
        bounds = [v[j] for v in per_key.values() if j < len(v)]
        high = min(size for size, _ in bounds)
        low = max(size - last for size, last in bounds)
        if not low < high:
            return None
        caps.append(high)
    return caps
