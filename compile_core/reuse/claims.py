"""Compile claims: processes sharing Inductor's cache directory compile each graph once.

Note [Compile claims]
---------------------
Background: the ranks of a node share one Inductor cache directory (the launcher makes it private
to the job). Inductor already shares the C++ build of a kernel between processes, but the Python
side (AOTAutograd tracing, lowering, code generation) is repeated by every process that compiles
the same graph. A process that finds a graph in the cache instead loads it in a fraction of the time.

Algorithm: a claim is an exclusive `flock` on `<cache dir>/ddp_compile/claims/<key>.lock`, plus a
small state file next to it saying who holds it and how it went (`ClaimState`: compiling, done,
failed, with the error).
  * `try_claim(key)` never waits: the caller compiles what it could claim first, and comes back to
    the rest later, so two processes work on different graphs at the same time;
  * `wait_claim(key)` waits for the holder, at most `timeout_s`, polling the lock. The lock is
    released when the holder finishes, fails, or dies (the kernel drops a dead process's flock), so
    the waiter learns the outcome from the state file: done (load it: a cache hit), failed or died
    (compile it yourself). After the timeout it returns without a claim: compile it yourself.
The caller compiles while holding the claim and marks it `done()` or `failed(error)`; a claim
released without either (the holder died) reads as died.

Notes: the state file is replaced atomically (write, then rename), so a reader never sees half of
it. Claims live as long as the cache directory; a state from an earlier job only says how that job
went, and a claim is always taken again before compiling. Used where no process group joins the
processes (several processes of a node without torch.distributed); in a distributed job the claims
go through the job's store instead and span every node (compile_core/reuse/store_claims.py). Nothing here
knows what a graph, a rank or a bucket is: the caller names itself (`me`) and what it compiles.

Debugging: `ls <cache dir>/ddp_compile/claims/`; each `*.state` is one JSON line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import json
import os
import socket
import time
from typing import Any, Callable


class ClaimState(enum.Enum):
    """What a claim's holder last said about it (decisions read this; `Holder.state` is for people)."""

    COMPILING = "compiling"
    DONE = "done"
    FAILED = "failed"


class WaitEnd(enum.Enum):
    """How waiting for a claim's holder ended (decisions read this; `Wait.outcome` is for people)."""

    DONE = "done"
    """The holder compiled it: load it (a cache hit)."""
    FAILED = "failed"
    """The holder's compile failed (the error says why)."""
    DIED = "died"
    """The holder went away while compiling."""
    TIMED_OUT = "timed out"


def _failed_text(error: str) -> str:
    return f"failed: {error}"[:300]


def wait_text(end: WaitEnd | None, error: str) -> str:
    """done, failed: <why>, died, or timed out; "" before the wait ended."""
    if end is None:
        return ""
    return _failed_text(error) if end is WaitEnd.FAILED else end.value


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who held (or holds) a claim, from its state file."""

    who: str
    """The holder's own name for itself (`rank 0`)."""
    pid: int
    host: str
    kind: ClaimState
    error: str = ""
    """Why its compile failed (FAILED only), for people."""

    @property
    def state(self) -> str:
        """compiling, done, or failed: <why> (for people)."""
        return _failed_text(self.error) if self.kind is ClaimState.FAILED else self.kind.value

    def describe(self) -> str:
        return f"{self.who} (pid {self.pid})"

    @classmethod
    def from_record(cls, who: str, data: dict[str, Any]) -> Holder:
        """From a state record (`state_record`); KeyError/ValueError/TypeError when it is not one."""
        return cls(
            who=who,
            pid=int(data["pid"]),
            host=str(data["host"]),
            kind=ClaimState(data["state"]),
            error=str(data.get("error", "")),
        )


def state_record(kind: ClaimState, error: str = "") -> dict[str, Any]:
    """The JSON-ready state a claim holder publishes: its kind, and the error when it failed."""
    return {"state": kind.value, **({"error": error[:300]} if kind is ClaimState.FAILED else {})}


@dataclasses.dataclass
class Wait:
    """How a `wait_claim` went."""

    seconds: float = 0.0
    """Time spent waiting."""
    holder: Holder | None = None
    """Who held the claim when the wait started (None: nobody said)."""
    end: WaitEnd | None = None
    """How the wait ended (None: it did not wait)."""
    error: str = ""
    """Why the holder failed (FAILED), for people."""

    @property
    def outcome(self) -> str:
        """done (the holder compiled it), failed: <why>, died (released while compiling), or timed out."""
        return wait_text(self.end, self.error)


class Claim:
    """An exclusive claim on one key; mark it `done()` or `failed()`, then `release()`."""

    def __init__(self, claims: "CompileClaims", key: str, fd: int, previous: Holder | None) -> None:
        self._claims = claims
        self.key = key
        self._fd = fd
        self.previous = previous
        """The state the last holder left (None: nobody compiled this key in this directory yet)."""

    def capturing(self) -> contextlib.AbstractContextManager:
        """Around the compile (the store claims capture it to ship it; here the cache dir is shared)."""
        return contextlib.nullcontext()

    def done(self, meta: dict | None = None) -> None:
        self._claims._write_state(self.key, ClaimState.DONE)

    def failed(self, error: str) -> None:
        self._claims._write_state(self.key, ClaimState.FAILED, error)

    def release(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


class CompileClaims:
    """Claims on keys in one directory, for one process named `me` (see the Note)."""

    def __init__(self, directory: str, *, me: str, timeout_s: float, poll_s: float = 0.05) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: expected seconds > 0")
        self.directory = directory
        self.me = me
        self.timeout_s = float(timeout_s)
        self.poll_s = poll_s
        os.makedirs(directory, exist_ok=True)

    def try_claim(self, key: str) -> Claim | None:
        """The claim on `key` if nobody holds it now; never waits."""
        fd = os.open(self._path(key, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        previous = self.holder(key)
        self._write_state(key, ClaimState.COMPILING)
        return Claim(self, key, fd, previous)

    def wait_claim(
        self, key: str, *, on_wait: Callable[[Holder | None], None] = lambda h: None
    ) -> tuple[Claim | None, Wait]:
        """Wait (at most `timeout_s`) for the holder of `key`; None when the wait timed out."""
        wait = Wait()
        claim = self.try_claim(key)
        if claim is not None:
            return claim, wait
        wait.holder = self.holder(key)
        on_wait(wait.holder)
        start = time.monotonic()
        while True:
            time.sleep(self.poll_s)
            claim = self.try_claim(key)
            wait.seconds = time.monotonic() - start
            if claim is not None:
                previous = claim.previous
                if previous is None or previous.kind is ClaimState.COMPILING:
                    wait.end = WaitEnd.DIED
                elif previous.kind is ClaimState.DONE:
                    wait.end = WaitEnd.DONE
                else:
                    wait.end, wait.error = WaitEnd.FAILED, previous.error
                return claim, wait
            if wait.seconds >= self.timeout_s:
                wait.end = WaitEnd.TIMED_OUT
                return None, wait

    def holder(self, key: str) -> Holder | None:
        """What the state file of `key` says (None when there is none or it cannot be read)."""
        try:
            with open(self._path(key, "state")) as f:
                data = json.load(f)
            return Holder.from_record(str(data["who"]), data)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_state(self, key: str, kind: ClaimState, error: str = "") -> None:
        path = self._path(key, "state")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "who": self.me,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    **state_record(kind, error),
                    "time": time.time(),
                },
                f,
            )
        os.replace(tmp, path)

    def _path(self, key: str, suffix: str) -> str:
        if not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ValueError(f"claim key {key!r}: use letters, digits, '-' and '_' (it names a file)")
        return os.path.join(self.directory, f"{key}.{suffix}")
