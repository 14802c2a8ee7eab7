"""Pure bucket planning: FX graph + parameter sizes in, `BucketPlan` out (see planner.py's Note)."""
from ddp.bucketing.planner import (
    DEFAULT_FIRST_BUCKET_BYTES,
    MiB,
    Bucket,
    BucketPlan,
    ParamInfo,
    plan_buckets,
    resolve_caps,
)

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES",
    "MiB",
    "Bucket",
    "BucketPlan",
    "ParamInfo",
    "plan_buckets",
    "resolve_caps",
]
