"""Make DDP's gradient buckets coincide with our graph pieces.

Note [Bucket alignment]
-----------------------
Background: DDP's reducer all-reduces a bucket once every gradient in it is ready. A compiled piece
(forward + AOT backward run as one autograd Function) hands all of its parameter gradients to autograd
at once, when the piece's backward finishes. A bucket that spans two pieces therefore waits for the
second piece's backward, and the overlap of that bucket is lost.

DDP does not keep the buckets it was built with: with torch 2.13 defaults every parameter sits in one
bucket during iteration 1, and at the start of iteration 2 the reducer rebuilds its buckets from the
order in which gradients became ready, cutting at `first_bucket_bytes_cap` / `bucket_bytes_cap`.
PyTorch's DDPOptimizer plans its pieces in forward-graph order with the same caps but never looks at
the rebuilt buckets, so the two drift apart (offset boundaries, a different count).

Algorithm: once every graph of iteration 1 is planned, and before iteration 2 runs, we give the DDP
module a new `Reducer` whose buckets are exactly our plan (explicit `bucket_indices`) and whose
per-bucket caps for a later rebuild (`bucket_bytes_cap_list`, new in torch 2.13) are our buckets'
byte totals. Gradients of one piece become ready together, so a rebuild from the observed ready
order cuts at the same places. Comm hooks the user registered on the old reducer are registered again.
Every rank must reduce the same buckets: the ranks exchange their layouts first and all take rank 0's
(DDP does the same when it rebuilds); a rank whose own plan differed is named in the report.

Notes: we leave the reducer alone (and say why in the report) when DDP is in a mode the swap cannot
preserve: the python reducer, mixed precision, delayed all-reduce params, or a bucket that mixes
dtypes or devices. Parameters that no graph touched (used eagerly between graph breaks, or unused)
go to one trailing bucket so that every parameter is still reduced.

Debugging: `CompiledModel.report()` lists planned buckets; tests record DDP's real buckets through a
comm hook and compare.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)


def alignment_blocker(ddp: DistributedDataParallel, buckets: Sequence[Sequence[torch.nn.Parameter]]) -> str | None:
    """Why the reducer of `ddp` cannot be rebuilt to `buckets` (None when it can)."""
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP uses the python reducer"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP mixed_precision is set"
    if getattr(ddp, "_delay_all_reduce_params", None):
        return "DDP has delayed all-reduce parameters"
    if getattr(ddp, "static_graph", False):
        return "DDP static_graph=True keeps its own bucket order"
    for i, bucket in enumerate(buckets):
        keys = {(p.dtype, p.device) for p in bucket}
        if len(keys) > 1:
            return f"bucket {i} mixes dtypes/devices {sorted(map(str, keys))}"
    return None


def agree_across_ranks(ddp: DistributedDataParallel, layout: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Every rank must reduce the same buckets: adopt rank 0's layout, as DDP does when it rebuilds.

    Returns (the layout to use, the ranks whose own plan differed). On a gloo group a monitored barrier
    first names any rank that never reaches this point, instead of hanging in the exchange.
    """
    group = ddp.process_group
    world = dist.get_world_size(group)
    if world == 1:
        return layout, []
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, wait_all_ranks=True)
    layouts: list = [None] * world
    dist.all_gather_object(layouts, layout, group=group)
    differing = [rank for rank, other in enumerate(layouts) if other != layouts[0]]
    return layouts[0], differing


def rebuild_reducer(
    ddp: DistributedDataParallel, buckets: Sequence[Sequence[torch.nn.Parameter]]
) -> tuple[list[list[int]], list[int]]:
    """Replace `ddp.reducer` by one whose buckets are `buckets` (in backward order).

    Parameters DDP reduces but that no bucket names are appended as a last bucket. Returns the bucket
    layout used (lists of indices into DDP's parameter list; rank 0's where ranks disagree) and the ranks
    whose plan differed from rank 0's. A collective: every rank calls it, between iterations only.
    """
    parameters, expect_sparse = ddp._build_params_for_reducer()
    index_of = {id(p): i for i, p in enumerate(parameters)}
    layout: list[list[int]] = []
    seen: set[int] = set()
    for bucket in buckets:
        idx = [index_of[id(p)] for p in bucket if id(p) in index_of and index_of[id(p)] not in seen]
        seen.update(idx)
        if idx:
            layout.append(idx)
    rest = [i for i in range(len(parameters)) if i not in seen]
    # Leftovers are split by dtype/device: the reducer wants one of each per bucket.
    by_key: dict[tuple, list[int]] = {}
    for i in rest:
        by_key.setdefault((parameters[i].dtype, parameters[i].device), []).append(i)
    layout.extend(by_key.values())
    layout, differing = agree_across_ranks(ddp, layout)

    def nbytes(indices: list[int]) -> int:
        return sum(parameters[i].numel() * parameters[i].element_size() for i in indices)

    caps = [max(1, nbytes(b)) for b in layout]
    config = ddp._bucket_config
    reducer = dist.Reducer(
        parameters,
        layout,
        caps,
        ddp.process_group,
        expect_sparse,
        config.bucket_bytes_cap,
        ddp.find_unused_parameters,
        ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(parameters),
        config.first_bucket_bytes_cap,
        getattr(ddp, "skip_all_reduce_unused_params", False),
        False,
        caps,
        getattr(ddp, "batched_grad_copy", False),
    )
    logger = dist.Logger(reducer)
    reducer.set_logger(logger)
    has_sync_bn = any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())
    logger.set_construction_data_and_log(
        ddp.module.__class__.__name__,
        [] if ddp.device_ids is None else ddp.device_ids,
        -1 if ddp.output_device is None else ddp.output_device,
        ddp.forward_sync_buffers,
        has_sync_bn,
        False,
    )
    ddp.reducer = reducer
    ddp.logger = logger
    # The new reducer has no hook yet: the ones registered on the old reducer must keep working.
    for hook, state in ddp._comm_hooks:
        logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(reducer, state, hook)
    # Our buckets are final: mark DDP as rebuilt so that its own bookkeeping agrees.
    ddp._has_rebuilt_buckets = True
    if differing:
        log.warning("ddp: ranks %s planned other buckets than rank 0; every rank uses rank 0's", differing)
    log.info("ddp: reducer rebuilt with %d bucket(s) aligned to compiled pieces", len(layout))
    return layout, differing
