"""Hang detection: ``python -m launch.watchdog --hang-timeout S [--first-step-timeout F] -- torchrun ...``.

Neither torchrun nor torchx notices a rank that stops making progress, and gloo waits 30 minutes before a
blocked collective fails. With ``--hang-timeout`` the torchx component (``launch.components.trainer``,
used by ``python -m launch``) starts torchrun on each node under this supervisor. It runs torchrun as its
child, forwards SIGTERM/SIGINT/SIGHUP to it, passes its exit code through, and meanwhile watches the
ranks' heartbeat records (``launch.heartbeat``) in ``DDP_LAUNCH_HEARTBEAT_DIR`` (a fresh private temp dir
when the variable is unset; removed at exit).

Note (the rules, also in docs/launch.md):

* Each rank has a *limit*: the first-step timeout while it has beaten fewer than twice (start-up, rendezvous,
  the whole first step including its compile) or while its last beat named the phase ``"compile"``; the
  hang timeout otherwise. A rank is *overdue* when its last beat (its start, before any beat) is older than
  its limit.
* The job is hung when **every** rank is overdue. One rank beating within its limit means the job still
  progresses (e.g. rank 0 evaluating alone while the others wait at a barrier), and a rank inside a long
  compile holds off the verdict for the ranks blocked on it.
* The stuck rank is the live rank whose last heartbeat is oldest; ranks that never beat count as oldest,
  earliest start first. The others are blocked on it. Ranks whose process is gone (finished) are overdue
  but never named.
* On a hang: every rank that registered a stack dump (``launch.worker`` does it: faulthandler on SIGUSR1
  into ``rank<R>.stack``) gets SIGUSR1; the stuck rank's stack is printed under the summary line
  ``launch: job HUNG: rank R ([node G, ]host H, pid P) made no progress for X s (last heartbeat: PHASE) -- stopping
  the job``; the verdict goes to ``hang.json`` (read by ``python -m launch``); torchrun gets SIGTERM (it
  stops its ranks), SIGKILL for it and the ranks after ``STOP_GRACE`` s; the exit code is ``HANG_EXIT``.
* The view is the heartbeat directory: the whole job under ``python -m launch`` locally (one directory for
  all ranks), one node on remote schedulers (a node-local directory: each node judges its own ranks, so
  on a multi-node hang every node reports its own oldest rank; the earliest report names the culprit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from launch.heartbeat import HEARTBEAT_DIR_ENV, Record, read_records, stack_path

HANG_EXIT = 3
VERDICT_FILE = "hang.json"
STOP_GRACE = 10.0  # seconds torchrun gets to stop its ranks after our SIGTERM, before SIGKILL
COMPILE_PHASE = "compile"


def default_first_step_timeout(hang_timeout: float) -> float:
    """Long grace for start-up and compiles: ten hang timeouts, at least 10 minutes (a cold Inductor
    compile of a real model takes minutes)."""
    return max(10.0 * hang_timeout, 600.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HangPolicy:
    """When a job counts as hung; validated on construction."""

    hang_timeout: float
    """Seconds without a heartbeat after a rank's first step before it counts as overdue."""
    first_step_timeout: Optional[float] = None
    """Seconds allowed before a rank's second beat and while it reports phase "compile";
    default max(10 x hang_timeout, 600)."""

    def __post_init__(self) -> None:
        if not _positive(self.hang_timeout):
            raise ValueError(f"hang timeout {self.hang_timeout!r}: expected a number of seconds > 0 (e.g. 300)")
        if self.first_step_timeout is None:
            object.__setattr__(self, "first_step_timeout", default_first_step_timeout(self.hang_timeout))
        elif not _positive(self.first_step_timeout) or self.first_step_timeout < self.hang_timeout:
            raise ValueError(
                f"first-step timeout {self.first_step_timeout!r}: expected seconds >= the hang timeout "
                f"({self.hang_timeout:g}); it covers start-up and compiles"
            )

    def limit(self, rec: Record) -> float:
        """The timeout that applies to `rec` right now (see the module Note)."""
        if rec.beats < 2 or rec.phase == COMPILE_PHASE:
            return self.first_step_timeout
        return self.hang_timeout


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hang:
    """A hang verdict."""

    stuck: Optional[Record]
    """The rank named as stuck; None when no rank has even started."""
    idle: float
    """Seconds since the stuck rank's last beat (or since the watch began when no rank started)."""

    def summary(self) -> str:
        """The one line a user sees."""
        r = self.stuck
        if r is None:
            return f"launch: job HUNG: no rank started within {self.idle:.1f} s -- stopping the job"
        last = "none since the rank started" if r.beats == 0 else r.phase
        node = f"node {r.node}, " if r.nodes > 1 else ""
        return (
            f"launch: job HUNG: rank {r.rank} ({node}host {r.host}, pid {r.pid}) made no progress for "
            f"{self.idle:.1f} s (last heartbeat: {last}) -- stopping the job"
        )


def find_hang(
    records: Sequence[Record],
    now: float,
    policy: HangPolicy,
    *,
    watch_start: float,
    alive: Callable[[int], bool] = lambda pid: True,
) -> Optional[Hang]:
    """The verdict for these records at time `now`, or None while the job still progresses."""
    if not records:
        idle = now - watch_start
        return Hang(stuck=None, idle=idle) if idle > policy.first_step_timeout else None
    if any(now - r.last <= policy.limit(r) for r in records):
        return None
    candidates = [r for r in records if alive(r.pid)] or list(records)
    stuck = min(candidates, key=lambda r: (r.beats > 0, r.last, r.rank))
    return Hang(stuck=stuck, idle=now - stuck.last)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def dump_stacks(directory: str, records: Sequence[Record], want: int, wait: float = 3.0) -> str:
    """SIGUSR1 every live rank that registered a stack dump; return what rank `want` wrote ('' if none)."""
    sizes = {}
    for r in records:
        path = stack_path(directory, r.rank)
        if os.path.exists(path) and pid_alive(r.pid):
            sizes[r.rank] = os.path.getsize(path)
            try:
                os.kill(r.pid, signal.SIGUSR1)
            except OSError:
                sizes.pop(r.rank)
    if want not in sizes:
        return ""
    path, before = stack_path(directory, want), sizes[want]
    deadline, last_size, stable_since = time.monotonic() + wait, before, time.monotonic()
    while time.monotonic() < deadline:  # faulthandler writes from the signal handler: wait for it to settle
        size = os.path.getsize(path)
        if size != last_size:
            last_size, stable_since = size, time.monotonic()
        elif size > before and time.monotonic() - stable_since > 0.5:
            break
        time.sleep(0.05)
    with open(path, errors="replace") as f:
        f.seek(before)
        return f.read()


def write_verdict(directory: str, hang: Hang, stack: str) -> None:
    r = hang.stuck
    verdict = {
        "summary": hang.summary(),
        "idle": hang.idle,
        "stack": stack,
        "time": time.time(),
        "stuck": dataclasses.asdict(r) if r is not None else None,
    }
    tmp = os.path.join(directory, f".{VERDICT_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(verdict, f)
    os.replace(tmp, os.path.join(directory, VERDICT_FILE))


def read_verdict(directory: str) -> Optional[dict]:
    """The hang verdict a watchdog left in `directory`, if any."""
    try:
        with open(os.path.join(directory, VERDICT_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# Frames every rank has below the user's code (our trampoline, runpy, torchelastic's @record): noise.
_TRAMPOLINE_FRAMES = ('File "<frozen runpy>"', '/launch/worker.py"', '/elastic/multiprocessing/errors/__init__.py"')


def format_stack(rank: Optional[int], stack: str) -> list[str]:
    """The stack under the summary line, each line tagged with the rank, launcher frames left out."""
    lines = [ln for ln in stack.rstrip().splitlines() if not any(t in ln for t in _TRAMPOLINE_FRAMES)]
    if not lines:
        return ["launch: (no stack: the rank did not register a stack dump; run it under launch.worker)"]
    tag = f"  [rank{rank}] "
    return [f"launch: rank {rank} stack at that moment (faulthandler, most recent call first):"] + [
        tag + line for line in lines
    ]


class _Supervisor:
    """torchrun as a child; the watch loop; the stop on a hang."""

    def __init__(self, cmd: Sequence[str], policy: HangPolicy) -> None:
        self.policy = policy
        self.own_dir = not os.environ.get(HEARTBEAT_DIR_ENV)
        self.dir = tempfile.mkdtemp(prefix="ddp_launch_heartbeat_") if self.own_dir else os.environ[HEARTBEAT_DIR_ENV]
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        # Own session: a scheduler's killpg reaches only us, and we forward it once. torchrun treats a second
        # SIGTERM during its shutdown as a new error, which can cut its cleanup of the ranks short.
        self.child = subprocess.Popen(
            list(cmd), env={**os.environ, HEARTBEAT_DIR_ENV: self.dir}, start_new_session=True
        )
        self.stopping = False  # set once a stop was forwarded: ranks going quiet then is not a hang
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._forward)

    def _forward(self, signum: int, frame) -> None:
        # The scheduler stops the job through us: torchrun must get the signal to stop its ranks.
        self.stopping = True
        if self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        try:
            return self._watch()
        finally:
            if self.own_dir:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _watch(self) -> int:
        watch_start = time.time()
        interval = min(1.0, self.policy.hang_timeout / 10)
        while True:
            rc = self.child.poll()
            if rc is not None:
                return rc
            if self.stopping:
                time.sleep(0.1)
                continue
            records = read_records(self.dir)
            hang = find_hang(records, time.time(), self.policy, watch_start=watch_start, alive=pid_alive)
            if hang is not None:
                return self._stop_hung(hang, records)
            time.sleep(interval)

    def _stop_hung(self, hang: Hang, records: Sequence[Record]) -> int:
        # Several "nodes" of one local job share a directory: the first watchdog to see the hang reports it.
        try:
            claim = os.path.join(self.dir, VERDICT_FILE + ".claim")
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            mine = True
        except FileExistsError:
            mine = False
        if mine:
            rank = hang.stuck.rank if hang.stuck else None
            stack = dump_stacks(self.dir, records, rank) if rank is not None else ""
            print("\n".join([hang.summary(), *format_stack(rank, stack)]), file=sys.stderr, flush=True)
            write_verdict(self.dir, hang, stack)
        else:
            print(
                "launch: job HUNG (reported by another node's watchdog) -- stopping this node",
                file=sys.stderr,
                flush=True,
            )
        self._stop_child(records)
        return HANG_EXIT

    def _stop_child(self, records: Sequence[Record]) -> None:
        self.child.send_signal(signal.SIGTERM)  # torchrun forwards it to its ranks and waits for them
        try:
            self.child.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            for r in records:  # a rank that ignores SIGTERM must not outlive the job
                if pid_alive(r.pid):
                    try:
                        os.kill(r.pid, signal.SIGKILL)
                    except OSError:
                        pass
            self.child.kill()
            self.child.wait()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.watchdog",
        description="Run torchrun (or any command) and stop it when its ranks stop beating.",
    )
    p.add_argument("--hang-timeout", type=float, required=True)
    p.add_argument("--first-step-timeout", type=float, default=None)
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS... (normally torchrun ...)")
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    if not cmd:
        p.error("missing the command to supervise (after --)")
    try:
        policy = HangPolicy(hang_timeout=ns.hang_timeout, first_step_timeout=ns.first_step_timeout)
    except ValueError as exc:
        p.error(str(exc))
    return _Supervisor(cmd, policy).run()


if __name__ == "__main__":
    sys.exit(main())
