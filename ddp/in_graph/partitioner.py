"""The AOTAutograd partition step of `ddp="in_graph"`: min-cut, then the in-graph all-reduce pass.

AOTAutograd calls a partition function on the joint forward+backward graph; Inductor accepts one
as `custom_partitioner_fn` (after its own joint-graph passes), aot_eager as `partition_fn`. Ours
runs the min-cut rematerialization partitioner unchanged and then adds the bucketed all-reduce to
the backward it produced (ddp/in_graph/graph_pass.py). Its `uuid` names everything that shapes
the output graphs (this package's code, the bucket plan, the process group, the world size, the
accumulation inputs, the hook after the all-reduces), so compiled artifacts from a cache are only
reused when they are the same.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

import torch.fx as fx

from aot.torch_graphs import has_input_descriptors
from ddp.bucketing.grad_buckets import GradBucketPlan
from ddp.in_graph.graph_pass import add_accumulated, insert_bucketed_all_reduce
from ddp.in_graph.hooks import AfterReduce


def _code_hash() -> str:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(here.glob("*.py")) + sorted((here.parent / "bucketing").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


_CODE_HASH = _code_hash()


class InGraphPartitioner:
    """`(joint, joint_inputs, **kwargs) -> (forward, backward)` with the plan's all-reduces in backward."""

    def __init__(
        self,
        plan: GradBucketPlan,
        *,
        group_name: str,
        world_size: int,
        wire_dtype: Any = None,
        accumulated_input_of: Mapping[int, int] | None = None,
        after_reduce: AfterReduce | None = None,
        on_partitioned: Callable[[list[str]], None] = lambda after: None,
    ) -> None:
        self.plan = plan
        self.after_reduce = after_reduce
        self.group_name = group_name
        self.world_size = world_size
        self.wire_dtype = wire_dtype
        self.accumulated_input_of = dict(accumulated_input_of or {})
        self.on_partitioned = on_partitioned

    def __call__(
        self, joint: fx.GraphModule, joint_inputs: Any, *, base: Callable[..., Any] | None = None, **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """`base`: the partition step to build on (a user's own Inductor `custom_partitioner_fn`), else min-cut."""
        from functorch.compile import min_cut_rematerialization_partition

        kwargs.setdefault("compiler", "inductor")  # what Inductor passes, and min-cut's own default
        partition = base or min_cut_rematerialization_partition
        if not has_input_descriptors(joint.graph):
            # The body of a nested compile region (invoke_subgraph). AOTAutograd partitions each body on its
            # own, with the same partition step, before the graph that calls it. Its inputs are the region's,
            # not the graph's (no input descriptors), and the gradients of the parameters it reads leave
            # through the calling graph's backward, where they are bucketed: partition the body as it is.
            return partition(joint, joint_inputs, **kwargs)
        if self.accumulated_input_of:
            add_accumulated(joint, self.accumulated_input_of)
        forward, backward = partition(joint, joint_inputs, **kwargs)
        after = insert_bucketed_all_reduce(
            backward,
            self.plan,
            group_name=self.group_name,
            world_size=self.world_size,
            forward=forward,
            after_reduce=self.after_reduce,
            wire_dtype=self.wire_dtype,
        )
        self.on_partitioned(after)
        return forward, backward

    def inductor_requirements(self) -> dict[str, object]:
        """Inductor options this graph is wrong without (inductor/compilers.py lets them overrule the user's).

        With work after the all-reduces (the optimizer update inside the backward), no layout optimization:
        with it, Inductor hands a convolution's weight to the backward as a copy in channels-last order, the
        tensor the update then writes, and the parameter itself kept its old value (HF Swin's patch embedding
        missed every update from update 2 on, CPU, torch 2.13)."""
        return {} if self.after_reduce is None else {"layout_optimization": False}

    def uuid(self) -> str:
        plan = [(b.params, b.input_indices, b.nbytes, b.key) for b in self.plan.buckets]
        hook = None if self.after_reduce is None else self.after_reduce.cache_key()
        key = repr(
            (
                _CODE_HASH,
                plan,
                self.group_name,
                self.world_size,
                str(self.wire_dtype),
                sorted(self.accumulated_input_of.items()),
                hook,
            )
        )
        return hashlib.sha256(key.encode()).hexdigest()
