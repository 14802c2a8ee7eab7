"""Job-wide compile claims through a key-value store: one rank of the whole job compiles a graph, every
other rank, on every node, loads it from the bytes that rank ships through the store.

Note [Job-wide claims]
----------------------
Background: file claims (compile_core/reuse/claims.py) make the ranks of one node compile each graph once;
they share a cache dir, nothing else. Ranks on other nodes cannot see that dir, so each node
compiled everything again. The job's c10d store (the one its process group was made with, reached
by every rank on every node) carries both the claim and the compiled result.

Algorithm, for a key K (what is compiled) and keys under `<prefix>/<K>/`:
  * claim: `compare_set(claim, "", me)`: the first rank to arrive becomes the leader, whatever its
    node; the others learn who it is from the same call.
  * leader: compiles under `artifacts.capture`, then publishes the packed compile
    (inductor/artifacts.py) in chunks of `CHUNK` bytes under `blob/<leader>/<i>` and, last, its
    state `state/<leader>` = done (with size and sha256), or failed: why. While it holds claims, a
    thread of the leader bumps `<prefix>/alive/<rank>` every `BEAT_S` s.
  * waiter: polls the leader's state. Done: it fetches the chunks, checks their hash and installs
    them into its own cache dir (skipped when the leader shares its host and cache dir: the files
    are there already), then compiles as usual and gets a cache hit. Failed, or no liveness bump for
    `dead_after_s` (the leader died or hangs): it takes the claim over with
    `compare_set(claim, leader, me)` and compiles (one waiter wins; the others wait for it). After
    `timeout_s` in all it compiles without a claim. Every wait names the rank waited for.
Notes: the keys live as long as the store (torchrun's store is per restart attempt). Values are
strings or bytes; ranks are named by global rank (`me`). Nothing here knows what a graph, a bucket
or a process group is: the caller passes the store, its rank and its cache dir.

Debugging: the store keys above; a waiter logs whom it waits for, and `Wait` records how it ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator

from compile_core.reuse.claims import ClaimState, Holder, WaitEnd, state_record, wait_text
from inductor import artifacts

log = logging.getLogger(__name__)

CHUNK = 1 << 20
"""Bytes per store value when a compile is shipped."""
BEAT_S = 1.0
"""How often a rank holding claims bumps its liveness counter."""


@dataclasses.dataclass
class StoreWait:
    """How a `wait_claim` went."""

    seconds: float = 0.0
    """Time spent waiting (fetching and installing included)."""
    holder: Holder | None = None
    """The leader waited for (the last one, after a takeover)."""
    end: WaitEnd | None = None
    """How the wait ended: done, failed, died (no liveness for dead_after_s), or timed out."""
    error: str = ""
    """Why it failed (FAILED), for people."""
    leader_rank: int | None = None
    """The global rank of that leader."""
    installed_bytes: int = 0
    """Bytes of its compile installed here (0: none, or the leader shares this cache dir)."""
    meta: dict = dataclasses.field(default_factory=dict)
    """What the leader attached to its compile (`done(meta)`), when it was installed here."""

    @property
    def outcome(self) -> str:
        """done, failed: <why>, died, or timed out (for people)."""
        return wait_text(self.end, self.error)


class _Liveness:
    """A thread that bumps `<prefix>/alive/<rank>` while this rank holds at least one claim."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key
        self.holders = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def hold(self) -> None:
        with self.lock:
            self.holders += 1
            if self.thread is None:
                self.stop.clear()
                self.store.add(self.key, 1)  # at once: a waiter arriving now sees a live leader
                self.thread = threading.Thread(target=self._run, name="ddp-compile-liveness", daemon=True)
                self.thread.start()

    def release(self) -> None:
        with self.lock:
            self.holders -= 1
            if self.holders > 0 or self.thread is None:
                return
            thread, self.thread = self.thread, None
            self.stop.set()
        thread.join()

    def _run(self) -> None:
        while not self.stop.wait(BEAT_S):
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store went away (process group destroyed): stop beating
                return


class StoreClaim:
    """The claim on one key, held by this rank: compile inside `capturing()`, then `done()` or `failed()`,
    then `release()`."""

    def __init__(self, claims: "StoreClaims", key: str, previous: Holder | None) -> None:
        self._claims = claims
        self.key = key
        self.previous = previous
        """The leader this rank took the claim over from (None: it was the first)."""
        self._captured: artifacts.Capture | None = None
        self._released = False

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        with artifacts.capture(self._claims.directory) as captured:
            yield
        self._captured = captured

    def done(self, meta: dict[str, Any] | None = None) -> None:
        """Publish what was compiled (inside `capturing()`) for every other rank."""
        captured = self._captured or artifacts.Capture()
        self._claims._publish(self.key, artifacts.pack(captured, self._claims.directory, meta))

    def failed(self, error: str) -> None:
        self._claims._set_state(self.key, ClaimState.FAILED, error)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._claims._liveness.release()


class StoreClaims:
    """Claims on keys shared by every rank of a job through `store` (see the Note)."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        directory: str,
        timeout_s: float,
        dead_after_s: float,
        poll_s: float = 0.05,
        prefix: str = "ddp_compile/compile",
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("dead_after_s", dead_after_s), ("poll_s", poll_s)):
            if not value > 0:
                raise ValueError(f"{name}={value!r}: expected seconds > 0")
        self.store = store
        self.rank = rank
        self.me = f"rank {rank}"
        self.directory = directory
        self.timeout_s = float(timeout_s)
        self.dead_after_s = float(dead_after_s)
        self.poll_s = poll_s
        self.prefix = prefix
        self._liveness = _Liveness(store, f"{prefix}/alive/{rank}")

    # -- claiming ----------------------------------------------------------------------------------

    def try_claim(self, key: str) -> StoreClaim | None:
        """The claim on `key` if no rank of the job took it yet; never waits."""
        got = self._decode(self.store.compare_set(self._k(key, "claim"), "", str(self.rank)))
        return self._take(key, None) if got == self.rank else None

    def wait_claim(
        self, key: str, *, on_wait: Callable[[Holder | None], None] = lambda h: None
    ) -> tuple[StoreClaim | None, StoreWait]:
        """Wait for the leader of `key` (at most `timeout_s`): None and outcome `done` once its compile
        is installed here; a claim when the leader failed or died and this rank took over; None and
        `timed out` after the timeout."""
        wait = StoreWait()
        leader = self._decode(self.store.compare_set(self._k(key, "claim"), "", str(self.rank)))
        if leader == self.rank:
            return self._take(key, None), wait
        start = time.monotonic()
        announced = False
        while True:
            wait.leader_rank = leader
            holder = self.holder(key, leader)
            wait.holder = holder or Holder(who=f"rank {leader}", pid=0, host="?", kind=ClaimState.COMPILING)
            if not announced:
                on_wait(wait.holder)
                announced = True
            end, error = self._watch(key, leader, start)
            wait.seconds = time.monotonic() - start
            if end is WaitEnd.DONE:
                wait.holder = self.holder(key, leader) or wait.holder
                try:
                    wait.installed_bytes, wait.meta = self._fetch_and_install(key, leader)
                    wait.end = WaitEnd.DONE
                except (ValueError, OSError) as err:  # compile it here rather than trust it
                    wait.end, wait.error = WaitEnd.FAILED, f"its compile could not be installed here: {err}"
                wait.seconds = time.monotonic() - start
                return None, wait
            if end is WaitEnd.TIMED_OUT:
                wait.end = end
                return None, wait
            # failed or died: take the claim over, unless another waiter did first
            got = self._decode(self.store.compare_set(self._k(key, "claim"), str(leader), str(self.rank)))
            if got == self.rank:
                wait.end, wait.error = end, error
                return self._take(key, wait.holder), wait
            log.info(
                "compile_core: rank %d: rank %d took over %s from rank %d; waiting for it", self.rank, got, key, leader
            )
            leader, announced = got, False

    def holder(self, key: str, leader: int) -> Holder | None:
        """What `leader` last said about `key` (None before it said anything)."""
        state_key = self._k(key, f"state/{leader}")
        if not self.store.check([state_key]):
            return None
        try:
            data = json.loads(self.store.get(state_key))
            return Holder.from_record(f"rank {leader}", data)
        except (ValueError, KeyError, TypeError):
            return None

    # -- internals ---------------------------------------------------------------------------------

    def _take(self, key: str, previous: Holder | None) -> StoreClaim:
        self._liveness.hold()
        self._set_state(key, ClaimState.COMPILING)
        return StoreClaim(self, key, previous)

    def _watch(self, key: str, leader: int, start: float) -> tuple[WaitEnd, str]:
        """Poll until the leader is done, failed or silent too long, or the wait times out: (how, error)."""
        alive_key = f"{self.prefix}/alive/{leader}"
        last_count, last_change = None, time.monotonic()
        while True:
            holder = self.holder(key, leader)
            if holder is not None and holder.kind is ClaimState.DONE:
                return WaitEnd.DONE, ""
            if holder is not None and holder.kind is ClaimState.FAILED:
                return WaitEnd.FAILED, holder.error
            now = time.monotonic()
            count = self.store.add(alive_key, 0)  # reads the counter (creating it at 0)
            if count != last_count:
                last_count, last_change = count, now
            elif now - last_change > self.dead_after_s:
                return WaitEnd.DIED, ""
            if now - start > self.timeout_s:
                return WaitEnd.TIMED_OUT, ""
            time.sleep(self.poll_s)

    def _set_state(self, key: str, kind: ClaimState, error: str = "", **extra: Any) -> None:
        value = {
            **state_record(kind, error),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cache_dir": self.directory,
            "time": time.time(),
            **extra,
        }
        self.store.set(self._k(key, f"state/{self.rank}"), json.dumps(value))

    def _publish(self, key: str, blob: bytes) -> None:
        chunks = [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            self.store.set(self._k(key, f"blob/{self.rank}/{i}"), chunk)
        self._set_state(
            key, ClaimState.DONE, chunks=len(chunks), bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest()
        )

    def _fetch_and_install(self, key: str, leader: int) -> tuple[int, dict]:
        data = json.loads(self.store.get(self._k(key, f"state/{leader}")))
        if data.get("host") == socket.gethostname() and data.get("cache_dir") == self.directory:
            return 0, {}  # the leader wrote into this very cache dir
        blob = b"".join(self.store.get(self._k(key, f"blob/{leader}/{i}")) for i in range(int(data["chunks"])))
        if hashlib.sha256(blob).hexdigest() != data["sha256"]:
            raise ValueError(
                f"rank {self.rank}: the compile rank {leader} shipped for {key} arrived damaged "
                f"({len(blob)} bytes, expected {data['bytes']}); its sha256 differs"
            )
        unpacked = artifacts.unpack(blob)
        artifacts.install(unpacked, self.directory)
        return len(blob), unpacked.meta

    def _k(self, key: str, what: str) -> str:
        return f"{self.prefix}/{key}/{what}"

    @staticmethod
    def _decode(value: Any) -> int:
        return int(value.decode() if isinstance(value, bytes) else value)
