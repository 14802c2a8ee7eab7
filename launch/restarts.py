"""Restarts: what a script tells the launcher when it resumes, and what the launcher makes of a run whose
job torchrun restarted (`--max-restarts K`).

Note [Restart report]
---------------------
Background: with `--max-restarts K`, torchrun restarts every rank of the job (each node's agent stops
its ranks and joins a new rendezvous) when one fails or dies; the script then resumes from its
checkpoint. torchrun itself says little about it: the ranks' log directories gain an `attempt_<N>`
per restart, and the node whose rank failed logs one line at ERROR, `failed (exitcode: E)
local_rank: L (pid: P) of binary: ...`, before restarting. Which global rank that was, on which
node, and from which step the job went on are nowhere.

Algorithm (the launcher, after the run, from the local scheduler's log dir):
  * attempts: the `attempt_<N>` directories; each rank writes `launch_rank.json` there at start
    (launch.worker: global rank, local rank, node, host, pid) and, when it resumes,
    `launch_resume.json` (`record_resumed(step, where)`);
  * per restart N (attempt N-1 ended, attempt N began): the failed ranks are the `failed (exitcode
    ...)` lines of attempt N-1's torchrun logs (pid -> global rank through attempt N-1's rank files)
    and the exceptions recorded in attempt N-1 (launch_failure.json); the root cause is picked as for
    a failed job (launch/failures.py: a rank killed by a signal before the peers' consequent errors);
  * the step resumed from: the step in attempt N's `launch_resume.json` (the lowest, should ranks
    differ).
Printed as `launch: restart N of K: rank R (local rank L on node G, host H) <reason>; resumed from
step S` before the job's own outcome line.

Notes: `record_resumed` writes beside the torchelastic error file, so it is a no-op outside torchrun.
Nothing here imports torch.

Debugging: the JSON files under `<log dir>/<app>/<role>/<node>/.../attempt_<N>/<local rank>/`.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import os
import re
import sys
import time
from typing import Optional

RESUME_FILE = "launch_resume.json"
# torchrun (glog format): "E1124 10:24:56.779000 11541 .../multiprocessing/api.py:1002] failed (exitcode: -9)
# local_rank: 0 (pid: 11553) of binary: ..."
_FAILED_RE = re.compile(
    r"^E(?P<md>\d{4}) (?P<hms>\d\d:\d\d:\d\d\.\d+) .*\] failed \(exitcode: (?P<code>-?\d+)\) "
    r"local_rank: (?P<local_rank>\d+) \(pid: (?P<pid>\d+)\)",
    re.MULTILINE,
)


@dataclasses.dataclass(frozen=True)
class Restart:
    """One restart of the job: why (the root-cause failure of the attempt before), and where it went on."""

    number: int
    """1 for the first restart."""
    cause: Optional[dict]
    """The root-cause failure (launch/failures.py's format: rank, local_rank, host, kind, ...); None: not found."""
    node: Optional[int]
    """The node (group rank) of that rank."""
    resumed_step: Optional[int]
    """The step the restarted ranks resumed from (None: the script did not say)."""


def record_resumed(step: int, where: str = "") -> None:
    """Tell the launcher this rank resumed at `step` (from the checkpoint `where`); a no-op outside torchrun."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file:
        return
    from launch.worker import per_pid

    info = {
        "step": int(step),
        "where": where,
        "rank": int(os.environ.get("RANK", "-1")),
        "pid": os.getpid(),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "time": time.time(),
    }
    try:
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
        with open(os.path.join(os.path.dirname(error_file), per_pid(RESUME_FILE, os.getpid())), "w") as f:
            json.dump(info, f)
    except OSError:
        pass  # a convenience for the launcher's summary; never stop the rank over it


def _load(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _generations(starts: list[dict]) -> list[list[dict]]:
    """Rank starts grouped into attempts: a rank number starting again opens the next attempt."""
    generations: list[list[dict]] = []
    for start in sorted(starts, key=lambda s: s.get("time", 0.0)):
        if not generations or any(s["rank"] == start["rank"] for s in generations[-1]):
            generations.append([])
        generations[-1].append(start)
    return generations


def _torchrun_failures(log_root: str, year: int) -> list[dict]:
    """Every `failed (exitcode ...)` line torchrun logged, from each node's log."""
    out = []
    for path in sorted(glob.glob(os.path.join(log_root, "*", "*", "stderr.log"))):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for m in _FAILED_RE.finditer(text):
            try:
                stamp = datetime.datetime.strptime(f"{year}{m['md']} {m['hms']}", "%Y%m%d %H:%M:%S.%f").timestamp()
            except ValueError:
                stamp = 0.0
            code = int(m["code"])
            out.append(
                {
                    "pid": int(m["pid"]),
                    "local_rank": int(m["local_rank"]),
                    "exitcode": code,
                    "time": stamp,
                    "kind": "signal" if code < 0 else "exit",
                    "root": False,
                }
            )
    return out


def find_restarts(log_root: str) -> tuple[list[Restart], set[int]]:
    """The restarts of a local run (see the Note) and the pids of its last attempt's ranks."""
    from launch.failures import order_failures
    from launch.worker import FAILURE_FILE, RANK_FILE, per_pid

    def records(name: str) -> list[dict]:
        pattern = per_pid(name, 0).replace(".0.", ".*.")
        return [d for p in glob.glob(os.path.join(log_root, "**", pattern), recursive=True) if (d := _load(p))]

    starts = [s for s in records(RANK_FILE) if "rank" in s and "pid" in s]
    generations = _generations(starts)
    if not generations:
        return [], set()
    year = datetime.datetime.fromtimestamp(generations[0][0].get("time", time.time())).year
    by_pid = {s["pid"]: s for s in starts}
    raised = {d["pid"]: {**d, "kind": "exception"} for d in records(FAILURE_FILE) if "pid" in d}
    exits = _torchrun_failures(log_root, year)
    resumed = {d.get("pid"): d for d in records(RESUME_FILE)}
    restarts = []
    for number in range(1, len(generations)):
        before = {s["pid"] for s in generations[number - 1]}
        exceptions = [raised[p] for p in before if p in raised]
        signals = []
        for e in exits:
            if e["pid"] in before:
                who = by_pid[e["pid"]]
                signals.append({**e, "rank": who["rank"], "host": who.get("host", "?")})
        ordered = order_failures(exceptions, signals)
        cause = ordered[0] if ordered else None
        node = by_pid.get(cause["pid"], {}).get("group_rank") if cause else None
        steps = [resumed[s["pid"]]["step"] for s in generations[number] if s["pid"] in resumed]
        restarts.append(Restart(number=number, cause=cause, node=node, resumed_step=min(steps) if steps else None))
    return restarts, {s["pid"] for s in generations[-1]}


def report_restarts(restarts: list[Restart], max_restarts: int) -> None:
    """One line per restart on stderr: who died and why, and the step the job resumed from."""
    from launch.failures import reason

    for r in restarts:
        if r.cause is None:
            who = "a rank failed (no record of which)"
        else:
            node = f"node {r.node}, " if r.node is not None else ""
            who = (
                f"rank {r.cause['rank']} (local rank {r.cause['local_rank']} on {node}host "
                f"{r.cause.get('host', '?')}) {reason(r.cause)}"
            )
        step = (
            f"resumed from step {r.resumed_step}"
            if r.resumed_step is not None
            else "the script reported no resume step (launch.restarts.record_resumed)"
        )
        print(f"launch: restart {r.number} of {max_restarts}: {who}; {step}", file=sys.stderr)
