"""Bucket caps: the one place where a cap given by the user (MiB) or by DDP (bytes) is checked.

DDP cuts gradient buckets at `bucket_cap_mb` (25 MiB by default) and keeps a smaller first bucket
(1 MiB by default, `first_bucket_bytes_cap`) so the gradients ready first start their all-reduce
early. Any cap > 0 is accepted here (DDP's own DDPOptimizer asserts below 1 MiB); the first cap
defaults to 1 MiB clamped to the bucket cap, and may never exceed it.
"""

from __future__ import annotations

import numbers
from typing import Any

MiB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB
"""DDP's default cap for the first bucket (the gradients that are ready first)."""


def check_cap_mb(name: str, value: Any) -> None:
    """A cap in MiB as a user gives it: a number > 0, or None for DDP's own value."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number of MiB (e.g. 25 or 0.5), or None for DDP's value")
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0 MiB (e.g. 25 or 0.5), or None for DDP's value")


def caps_from_mb(
    bucket_cap_mb: float | None, first_bucket_cap_mb: float | None, *, default_cap_bytes: int
) -> tuple[int, int]:
    """(bucket cap, first-bucket cap) in bytes from the user's MiB values; None = `default_cap_bytes`
    (the DDP object's cap) for the bucket cap, 1 MiB clamped to it for the first."""
    check_cap_mb("bucket_cap_mb", bucket_cap_mb)
    check_cap_mb("first_bucket_cap_mb", first_bucket_cap_mb)
    cap = int(bucket_cap_mb * MiB) if bucket_cap_mb is not None else int(default_cap_bytes)
    first = None if first_bucket_cap_mb is None else int(first_bucket_cap_mb * MiB)
    if first is not None and first > cap:
        source = "" if bucket_cap_mb is not None else ", from the DDP object"
        raise ValueError(
            f"first_bucket_cap_mb={first_bucket_cap_mb} is larger than the bucket cap ({cap / MiB:.3g} MiB{source}); "
            "the first bucket may only be smaller: lower first_bucket_cap_mb or raise bucket_cap_mb"
        )
    return resolve_caps(max(cap, 1), first)


def resolve_caps(bucket_cap_bytes: int, first_bucket_cap_bytes: int | None) -> tuple[int, int]:
    """Validate the caps; the first bucket's cap defaults to DDP's 1 MiB, clamped to the cap."""
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes={bucket_cap_bytes}: must be > 0")
    if first_bucket_cap_bytes is None:
        first_bucket_cap_bytes = min(DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_bytes)
    if first_bucket_cap_bytes <= 0:
        raise ValueError(f"first_bucket_cap_bytes={first_bucket_cap_bytes}: must be > 0")
    if first_bucket_cap_bytes > bucket_cap_bytes:
        raise ValueError(
            f"first_bucket_cap_bytes={first_bucket_cap_bytes} exceeds bucket_cap_bytes={bucket_cap_bytes}; "
            "the first bucket may only be smaller than (or equal to) the others"
        )
    return bucket_cap_bytes, first_bucket_cap_bytes
