"""`bucket_cap_mb="auto"`: a bucket cap chosen from a measured all-reduce (pure: numbers in, a cap out).

Note [Automatic bucket cap]
---------------------------
Background: an all-reduce of n bytes takes about `latency + n / bandwidth` (both measured on the
model's process group at compile time, `ddp/link_probe.py`). Two things pull the cap in opposite
directions:
  * the fixed part: every bucket pays `latency` once (plus the reducer's and the piece's own per-bucket
    work), so buckets much smaller than `latency * bandwidth` spend their time waiting, not sending;
  * the tail: the last bucket can only start after the backward's last gradient, so its whole transfer
    is exposed, and a model cut into few buckets overlaps little of the backward.
Algorithm: the smallest cap whose fixed part is at most 10 % of its transfer (`9 * latency *
bandwidth`), raised to DDP's 1 MiB first-bucket size (below it per-bucket overheads dominate on every
link measured here), lowered so the model's gradients make at least four buckets, and never above
64 MiB. The first bucket keeps its own cap (1 MiB, or the user's `first_bucket_cap_mb`).
Notes: compute speed enters only through the four-bucket floor: the compile happens before any
backward has run. Every rank takes the slowest rank's timings, so every rank picks the same cap.
Debugging: `report().to_dict()["bucket_cap_auto"]` holds the measured latency, bandwidth and the
bound that decided.
"""

from __future__ import annotations

import dataclasses

from ddp.bucketing.caps import MiB

OVERHEAD_SHARE = 0.1
"""The largest share of a bucket's all-reduce time the fixed per-call cost may take."""
MIN_BUCKETS = 4
"""The fewest buckets the model's gradients should make, so the backward has something to overlap."""
FLOOR_BYTES = 1 * MiB
"""No automatic cap below DDP's first-bucket size."""
CEILING_BYTES = 64 * MiB
"""No automatic cap above this, whatever the latency."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoCap:
    """The chosen cap and what it was chosen from."""

    cap_bytes: int
    """The bucket cap picked."""
    latency_s: float
    """Fixed cost of one all-reduce, seconds (measured)."""
    bytes_per_s: float
    """All-reduce throughput for large buckets, bytes per second (measured)."""
    grad_bytes: int
    """Bytes of the gradients DDP reduces."""
    bound: str
    """Which bound decided: "latency", "floor", "buckets" or "ceiling"."""

    def to_dict(self) -> dict:
        return {
            "cap_bytes": self.cap_bytes,
            "latency_us": round(self.latency_s * 1e6, 1),
            "gbytes_per_s": round(self.bytes_per_s / 1e9, 4),
            "grad_bytes": self.grad_bytes,
            "bound": self.bound,
        }


def choose_cap(*, latency_s: float, bytes_per_s: float, grad_bytes: int) -> AutoCap:
    """The bucket cap for these link figures (Note [Automatic bucket cap])."""
    if not latency_s >= 0 or not bytes_per_s > 0 or grad_bytes < 0:
        raise ValueError(
            f"latency_s={latency_s}, bytes_per_s={bytes_per_s}, grad_bytes={grad_bytes}: "
            "need latency >= 0, bandwidth > 0 and gradient bytes >= 0"
        )
    cap, bound = (1 - OVERHEAD_SHARE) / OVERHEAD_SHARE * latency_s * bytes_per_s, "latency"
    if cap < FLOOR_BYTES:
        cap, bound = FLOOR_BYTES, "floor"
    most = max(FLOOR_BYTES, grad_bytes // MIN_BUCKETS)
    if cap > most:
        cap, bound = most, "buckets"
    if cap > CEILING_BYTES:
        cap, bound = CEILING_BYTES, "ceiling"
    return AutoCap(cap_bytes=int(cap), latency_s=latency_s, bytes_per_s=bytes_per_s, grad_bytes=grad_bytes, bound=bound)


def fit_link(sizes: tuple[int, int], seconds: tuple[float, float]) -> tuple[float, float]:
    """(latency s, bytes/s) of the line through two timed all-reduces (small size first)."""
    (s1, s2), (t1, t2) = sizes, seconds
    if not s2 > s1:
        raise ValueError(f"sizes={sizes}: the second all-reduce must be the larger one")
    if t2 <= t1:  # the larger one was not slower: latency-bound throughout, bandwidth unmeasurable
        return t1, s2 / max(t2, 1e-9)
    bandwidth = (s2 - s1) / (t2 - t1)
    return max(t1 - s1 / bandwidth, 0.0), bandwidth
