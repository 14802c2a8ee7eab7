"""Pure bucket planning: FX graph + parameter sizes in, `BucketPlan` out (see planner.py's Note)."""

from ddp.bucketing.caps import DEFAULT_FIRST_BUCKET_BYTES, MiB, caps_from_mb, check_cap_mb, resolve_caps
from ddp.bucketing.planner import Bucket, BucketPlan, ParamInfo, plan_buckets

__all__ = [
    "DEFAULT_FIRST_BUCKET_BYTES",
    "MiB",
    "Bucket",
    "BucketPlan",
    "ParamInfo",
    "caps_from_mb",
    "check_cap_mb",
    "plan_buckets",
    "resolve_caps",
]
