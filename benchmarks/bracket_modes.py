"""The two modes that bracket every other mode's step time (they run inside a rank process).

`floor`: what a step costs with no communication at all: the strongest plain-PyTorch compile of the
same model and optimizer (`torch.compile(model)` + a `torch.compile`d `optimizer.step()`, the run's
backend), on every rank at once, each rank training its own copy on its own batches. No DDP object
exists in this mode, so no reducer hook runs either.

`comm_only`: what the step's communication costs with nothing else running: per step, one
all-reduce per DDP bucket of this model and cap (same element counts; fp16 under --comm-hook fp16,
whose all-reduce is 16-bit), issued back to back asynchronously, as DDP's reducer issues them, then
all waited for. Only the collectives: no division by the world size, no casts, no copies.

The bucket sizes are DDP's: torch's own `dist._compute_bucket_assignment_by_size` (the function
DDP's constructor and its reducer's rebuild call) over the trainable parameters in reverse
registration order, with the DDP object's limits (first bucket, then the cap). That is the layout
DDP's reducer rebuilds to after step 1 when gradients become ready in reverse order, as they do in
a GPT (checked against DDP's `rebuilt_bucket_sizes` on the comm and compute workloads' model; the
smoke test compares the buckets with the ones DDP's comm hook really saw). Our in-graph modes plan
their own buckets (`ddp/bucketing/`: the first one is 1 MiB clamped to the cap), so their count can
differ from DDP's by one; the bytes are the same.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.mode_context import ModeContext, ModeUnavailable, Step, autocast_region, compile_options
from examples.gpt import lm_loss

WIRE_DTYPES = {None: None, "fp16": torch.float16}
"""--comm-hook -> dtype comm_only all-reduces in (None: the parameters' own dtype)."""


def build_floor(ctx: ModeContext) -> Step:
    compiled = torch.compile(ctx.model, **compile_options(ctx))
    optimizer = ctx.optimizer

    @torch.compile(**compile_options(ctx))
    def optimizer_step() -> None:
        optimizer.step()

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_region(ctx):
            loss = lm_loss(compiled(x), y)
        loss.backward()
        optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Step(
        run=run,
        info=lambda: {
            "optimizer_compiled": "torch.compile(optimizer.step)",
            "note": "no DDP, no communication: each rank trains its own copy",
        },
    )


def ddp_buckets(ddp: DDP) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """DDP's buckets for this model and cap, in reduction order (see the module doc): (name, parameter) lists."""
    try:
        first_cap = ddp._bucket_config.first_bucket_bytes_cap
        cap = ddp.bucket_bytes_cap
        assign = dist._compute_bucket_assignment_by_size
    except AttributeError as err:
        raise ModeUnavailable(
            f"this torch has no DDP bucket layout to copy ({err}); comm_only needs "
            "DDP._bucket_config and dist._compute_bucket_assignment_by_size (torch 2.13)"
        ) from err
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored][::-1]
    limits = [first_cap, cap] if first_cap < cap else [cap]
    indices, _ = assign([p for _, p in named], limits, [False] * len(named))
    return [[named[i] for i in bucket] for bucket in indices]


def build_comm_only(ctx: ModeContext) -> Step:
    if ctx.ddp is None:
        raise ValueError("comm_only needs the DDP object (its caps and process group); the worker builds one")
    buckets = ddp_buckets(ctx.ddp)
    wire = WIRE_DTYPES[ctx.comm_hook]
    # zeros: sums stay zero, so no step ever reduces infinities or denormals (both can be slower to add)
    buffers = [
        torch.zeros(sum(p.numel() for _, p in b), dtype=wire or b[0][1].dtype, device=b[0][1].device) for b in buckets
    ]
    group = ctx.ddp.process_group
    no_loss = torch.zeros(())

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        works = [dist.all_reduce(buf, group=group, async_op=True) for buf in buffers]
        for work in works:
            work.wait()
        return no_loss

    def info() -> dict[str, Any]:
        return {
            "buckets": [[n for n, _ in b] for b in buckets],
            "bucket_bytes": [buf.numel() * buf.element_size() for buf in buffers],
            "wire_dtype": str(buffers[0].dtype).removeprefix("torch.") if buffers else None,
            "bucket_source": "dist._compute_bucket_assignment_by_size, parameters in reverse order, DDP's caps",
            "note": "all-reduces only: no forward, backward or optimizer",
        }

    return Step(run=run, info=info)


BRACKET_BUILDERS = {"floor": build_floor, "comm_only": build_comm_only}
"""Mode name -> builder, next to benchmarks.modes.BUILDERS."""
