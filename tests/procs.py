"""Find and kill the processes a test started, wherever they ended up in the process tree.

Ranks do not stay children of the test: torchx's local scheduler and the benchmark runner start them in
sessions of their own, and a rank whose parent died is re-parented to init. What they all keep is their
environment (and usually their command line), so every multi-process test tags what it starts with a
marker there, and `procs_with(marker)` finds it by scanning /proc.

The whole test session carries one marker too, `SESSION_ENV` (set in tests/conftest.py before any
xdist worker starts, so every process the suite starts inherits it): at the end of the session, any
process still carrying it is a leak (see `pytest_sessionfinish` in tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

SESSION_ENV = "DDP_COMPILE_TEST_SESSION"
"""Environment variable holding this test session's marker (a uuid)."""

# Processes that legitimately live as long as the pytest process that started them, and exit with it.
_HELPERS = (
    "multiprocessing.resource_tracker",  # started by multiprocessing for spawned ranks
    "torch._inductor.compile_worker",  # Inductor's parallel-compile pool
    "exec(eval(sys.stdin.readline()))",  # an xdist worker (execnet gateway)
)


@dataclasses.dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    cmdline: str

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}): {self.cmdline[:300]}"


def _ppid(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after ")"
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def all_procs() -> list[Proc]:
    procs = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            pid = int(entry.name)
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            procs.append(Proc(pid, _ppid(pid), cmdline))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or a kernel thread we cannot read
    return procs


def procs_with(marker: str, *, exclude: set[int] | None = None) -> list[Proc]:
    """Live processes whose command line or environment contains `marker` (this process excluded)."""
    skip = {os.getpid()} | (exclude or set())
    needle = marker.encode()
    found = []
    for proc in all_procs():
        if proc.pid in skip:
            continue
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ or marker in proc.cmdline:
            found.append(proc)
    return found


def descendants(pid: int, procs: list[Proc] | None = None) -> set[int]:
    """Every live process below `pid` in the process tree."""
    children: dict[int, list[int]] = {}
    for p in procs if procs is not None else all_procs():
        children.setdefault(p.ppid, []).append(p.pid)
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def kill_pids(pids) -> None:
    """SIGKILL each process (and its process group when it leads one); ignore the ones already gone."""
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            if os.getpgid(pid) == pid and pid != os.getpgid(0):
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_trees(pids) -> None:
    """Kill these processes and everything below them."""
    pids = list(pids)
    procs = all_procs()
    every = set(pids)
    for pid in pids:
        every |= descendants(pid, procs)
    kill_pids(every)


def kill_marked(marker: str) -> list[Proc]:
    """Kill every process carrying `marker`, with whatever it started; return what was killed."""
    marked = procs_with(marker)
    kill_trees(p.pid for p in marked)
    return marked


def session_leftovers(marker: str) -> list[Proc]:
    """Processes of this test session that are still alive: marked, not this process, not its helpers.

    Helpers (multiprocessing's resource tracker, Inductor's compile workers, xdist workers) are allowed
    only while they hang below this process: those exit with it. The same helper anywhere else was left
    behind by a process that is gone.
    """
    procs = all_procs()
    mine = descendants(os.getpid(), procs)
    return [p for p in procs_with(marker) if not (p.pid in mine and any(h in p.cmdline for h in _HELPERS))]


def wait_for_leftovers(marker: str, grace_s: float) -> list[Proc]:
    """`session_leftovers`, after giving exiting processes up to `grace_s` seconds to go."""
    deadline = time.monotonic() + grace_s
    while (left := session_leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
