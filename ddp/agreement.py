"""Ranks agree on a value before acting on it: bounded in time, and every failure names the rank.

Note [Rank agreement]
---------------------
Background: every rank must all-reduce the same buckets in the same order; if one rank planned
differently (a graph break, a recompile or a compile failure on that rank only), a collective
pairs with the wrong collective and either hangs until the process group's timeout (30 minutes on
gloo) or silently sums unrelated gradients.

Algorithm: each rank writes its value under `<prefix>/<topic>/<n>/<rank>` in the default
process group's store, where `n` counts this topic's exchanges on this rank, then waits for the
keys of the other ranks of the group with a bounded timeout (the store's own wait: nothing polls).
Once exchange n is complete, every rank has finished reading exchange n-1, so each rank deletes
its key of n-1: the store holds at most two keys per rank and topic however long the job runs.
The exchange goes through the store,
not through a collective of the group, so a rank that enters it alone cannot be paired with
another rank's all-reduce: it times out, and the error lists the ranks whose key never came.
Values that differ raise an error naming each rank that differs from the lowest rank and how.
`exchange` is `post` (write, return at once) followed by `collect` (wait for the others): a caller that
can post at one point and collect at a later one, after a collective every rank passes, never waits
for a rank that is busy somewhere the user's script does not synchronise (Note [Bucket alignment]).

Notes: timeouts: `first_timeout_s` for the first exchange of a topic (ranks may still be compiling:
the default is long), `timeout_s` after. Both come from `AgreementTimeouts`, whose defaults can be
set per job with `DDP_COMPILE_FIRST_TIMEOUT_S` / `DDP_COMPILE_TIMEOUT_S`. A group of one rank
exchanges nothing.

Waiting for a rank that may be compiling: a rank that compiled in the middle of a run cannot know
whether the others compiled too (they will come, late) or ran what was agreed before (they wait in
their collectives for this rank, and will never come). Each rank announces its compiles (`busy()`:
one store write when one starts and one when it ends; rare, so free in steady state). A `collect`
given `busy_up_to_s` waits `timeout_s`, then goes on waiting, in slices of `timeout_s` up to
`busy_up_to_s` in all, only while a missing rank is inside a compile or started or ended one during the
last slice; a missing rank that announced nothing for a whole slice is reported as not compiling.

Debugging: the error message carries the topic, the exchange number and each rank's value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
from typing import Any, Callable, Iterator

import torch.distributed as dist

from ddp import torch_ddp


class RankAgreementError(RuntimeError):
    """Ranks that must agree do not: raised before any collective could pair up wrongly."""


class RankTimeoutError(RankAgreementError):
    """Some ranks never reached an exchange within its timeout."""

    def __init__(self, message: str, *, compiling: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.compiling = compiling
        """The missing ranks that were compiling when the wait ended (see `RankAgreement.collect`)."""


class RankMismatchError(RankAgreementError):
    """Ranks reached an exchange with values that must be equal but are not."""


def env_seconds(name: str, default: float) -> float:
    """A number of seconds > 0 from the environment variable `name` (`default` when unset)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds > 0") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds > 0")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgreementTimeouts:
    """How long a rank waits for the others at an exchange."""

    first_timeout_s: float = dataclasses.field(
        default_factory=lambda: env_seconds("DDP_COMPILE_FIRST_TIMEOUT_S", 900.0)
    )
    """The first exchange of a topic (other ranks may still be compiling)."""
    timeout_s: float = dataclasses.field(default_factory=lambda: env_seconds("DDP_COMPILE_TIMEOUT_S", 120.0))
    """Every later exchange."""

    def __post_init__(self) -> None:
        for name in ("first_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"AgreementTimeouts.{name}={value!r}: expected a number of seconds > 0")


@dataclasses.dataclass(frozen=True)
class PostedValue:
    """This rank's value of exchange `n` on `topic`, posted and not yet collected (`RankAgreement.post`)."""

    topic: str
    n: int
    value: Any


class RankAgreement:
    """Exchanges values between the ranks of `group` through the default store (see the Note)."""

    def __init__(self, group: Any, *, prefix: str, timeouts: AgreementTimeouts | None = None) -> None:
        self.group = group
        self.prefix = prefix
        self.timeouts = timeouts or AgreementTimeouts()
        self.ranks = dist.get_process_group_ranks(group) if dist.is_initialized() else [0]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._counts: dict[str, int] = {}
        self._busy_depth = 0
        self._busy_changes = 0

    def exchange(self, topic: str, value: Any, *, timeout_s: float | None = None) -> dict[int, Any]:
        """Every rank's value (global rank -> value); raises `RankTimeoutError` naming missing ranks."""
        return self.collect(self.post(topic, value), timeout_s=timeout_s)

    def post(self, topic: str, value: Any) -> PostedValue:
        """Write this rank's value of the next exchange on `topic` and return at once; `collect` reads the
        others' later. For a value every rank posts before a point all ranks pass (a collective), so that
        collecting after that point never waits for a rank that needs this one to progress."""
        n = self._counts.get(topic, 0)
        self._counts[topic] = n + 1
        if len(self.ranks) > 1:
            torch_ddp.default_store().set(f"{self.prefix}/{topic}/{n}/{self.rank}", pickle.dumps(value))
        return PostedValue(topic=topic, n=n, value=value)

    def collect(
        self, posted: PostedValue, *, timeout_s: float | None = None, busy_up_to_s: float | None = None
    ) -> dict[int, Any]:
        """Every rank's value of the exchange `posted` belongs to; raises `RankTimeoutError` naming missing ranks.
        With `busy_up_to_s`, waits past the timeout while a missing rank is compiling (see the Note)."""
        topic, n = posted.topic, posted.n
        if len(self.ranks) == 1:
            return {self.rank: posted.value}
        timeout = timeout_s or (self.timeouts.first_timeout_s if n == 0 else self.timeouts.timeout_s)
        store = torch_ddp.default_store()
        base = f"{self.prefix}/{topic}/{n}"
        keys = {r: f"{base}/{r}" for r in self.ranks}
        others = [keys[r] for r in self.ranks if r != self.rank]
        waited, seen = 0.0, (self._busy_states() if busy_up_to_s is not None else {})
        while True:
            wait = timeout if busy_up_to_s is None else min(timeout, max(busy_up_to_s - waited, 1e-3))
            try:
                store.wait(others, datetime.timedelta(seconds=wait))  # blocks in the store: no polling
                break
            except RuntimeError:  # the store's timeout (DistStoreError), or a store that went away
                missing = [r for r in self.ranks if r != self.rank and not store.check([keys[r]])]
                if not missing:
                    raise
            waited += wait
            if busy_up_to_s is None:
                raise RankTimeoutError(
                    f"rank {self.rank}: rank(s) {missing} did not reach '{topic}' (exchange {n}) within "
                    f"{waited:.0f}s; they are stuck, dead, or took another path (a graph break, recompile or "
                    "compile failure on that rank only). Raise DDP_COMPILE_FIRST_TIMEOUT_S / DDP_COMPILE_TIMEOUT_S "
                    "if they are only slow to compile"
                ) from None
            now = self._busy_states()
            compiling = [r for r in missing if now.get(r, (False, 0))[0] or now.get(r) != seen.get(r)]
            if not compiling:
                raise RankTimeoutError(
                    f"rank {self.rank}: rank(s) {missing} did not reach '{topic}' (exchange {n}) within "
                    f"{waited:.0f}s and started or ended no compile in the last {wait:.0f}s: they are stuck, "
                    "dead, or took another path than this rank (a graph break or recompile on this rank only). "
                    "Raise DDP_COMPILE_TIMEOUT_S if they are only slow"
                ) from None
            if waited >= busy_up_to_s:
                raise RankTimeoutError(
                    f"rank {self.rank}: rank(s) {missing} did not reach '{topic}' (exchange {n}) within "
                    f"{waited:.0f}s; rank(s) {compiling} were still compiling. Raise DDP_COMPILE_FIRST_TIMEOUT_S "
                    "if they are only slow to compile",
                    compiling=tuple(compiling),
                ) from None
            seen = now
        values = {r: pickle.loads(store.get(keys[r])) for r in self.ranks}
        if n > 0:
            # Every rank wrote exchange n, so every rank is done reading n-1: our old key can go,
            # and a long run keeps at most two keys per rank and topic in the store.
            store.delete_key(f"{self.prefix}/{topic}/{n - 1}/{self.rank}")
        return values

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """This rank compiles inside the block: the other ranks' `collect(..., busy_up_to_s=...)` wait for it
        (see the Note). One store write on entry and one on exit."""
        self._busy_depth += 1
        self._announce_busy()
        try:
            yield
        finally:
            self._busy_depth -= 1
            self._announce_busy()

    def _announce_busy(self) -> None:
        self._busy_changes += 1
        self.publish("busy", (self._busy_depth > 0, self._busy_changes))

    def _busy_states(self) -> dict[int, tuple[bool, int]]:
        return self.peek("busy")

    def publish(self, topic: str, value: Any) -> None:
        """Leave this rank's latest `value` for others to `peek` at (never waits)."""
        if len(self.ranks) > 1:
            torch_ddp.default_store().set(f"{self.prefix}/{topic}/latest/{self.rank}", pickle.dumps(value))

    def peek(self, topic: str) -> dict[int, Any]:
        """The latest value each rank published on `topic` (ranks that published nothing are absent)."""
        if len(self.ranks) == 1:
            return {}
        store = torch_ddp.default_store()
        keys = {r: f"{self.prefix}/{topic}/latest/{r}" for r in self.ranks}
        return {r: pickle.loads(store.get(k)) for r, k in keys.items() if store.check([k])}

    def agree(
        self,
        topic: str,
        value: Any,
        *,
        describe: Callable[[Any], str] = repr,
        timeout_s: float | None = None,
        busy_up_to_s: float | None = None,
    ) -> None:
        """Raise `RankMismatchError` naming each rank whose value differs from the lowest rank's (`timeout_s`,
        `busy_up_to_s`: see `collect`)."""
        values = self.collect(self.post(topic, value), timeout_s=timeout_s, busy_up_to_s=busy_up_to_s)
        first = min(values)
        differing = [r for r in sorted(values) if values[r] != values[first]]
        if differing:
            lines = [f"rank {r}: {describe(values[r])}" for r in [first, *differing]]
            raise RankMismatchError(
                f"rank {self.rank}: ranks {differing} differ from rank {first} on '{topic}' "
                f"(exchange {self._counts[topic] - 1}):\n  " + "\n  ".join(lines)
            )
