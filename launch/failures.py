"""Which rank failed first, and why: read the per-rank records of a local run and print one summary line.

Sources, all under the local scheduler's log dir of the app:

* ``launch_failure.json`` (written by ``launch.worker`` when the user's code raises): global rank, host,
  exception, traceback, exact time. Without the trampoline, torchelastic's ``error.json`` (``@record``).
* torchrun's failure summary in each node's ``<role>/<replica>/stderr.log``: one entry per failed rank with
  its exit code, negative for a death by signal (``exitcode : -9 (pid: 4127)  (SIGKILL)``). A rank killed
  by the OS (SIGKILL, OOM) writes nothing itself, so this is the only place its death is told.
* ``launch_rank.json`` (written by ``launch.worker`` at start): the rank's host name (torchrun's summary
  says ``localhost`` on hosts whose fqdn resolves so).

Note (root cause): when one rank dies, its peers fail a moment later (gloo: "Connection closed by peer")
and torchrun then sends SIGTERM to the rest. So, in this order:

* a rank that raised is described by its exception (even if torchrun then reports it as SIGTERMed);
* deaths by SIGTERM are torchrun's own teardown: reported only when nothing else failed;
* a death by another signal (SIGKILL, SIGSEGV, SIGABRT...) is the root cause unless an exception was
  recorded more than ``SIGNAL_MARGIN`` s before torchrun noticed the death: torchrun stamps whole seconds,
  and the peers' consequent exceptions come milliseconds after the death, so a plain time comparison would
  often blame the survivor. A later signal (torchrun's SIGKILL for a rank ignoring SIGTERM, 30 s on) is not.
* otherwise the earliest event wins (exceptions carry exact times; plain exit codes count from the end of
  the second torchrun stamped).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import signal
import sys
from typing import Optional

SIGNAL_MARGIN = 2.0
_ENTRY_RE = re.compile(
    r"^\s*time\s*:\s*(?P<time>\S+)\s*\n"
    r"\s*host\s*:\s*(?P<host>\S+)\s*\n"
    r"\s*rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local_rank>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<exitcode>-?\d+) \(pid: (?P<pid>\d+)\)",
    re.MULTILINE,
)
_ROOT_HEADER = "Root Cause (first observed failure):"


def find_failures(log_root: str) -> list[dict]:
    """Per-rank exception records under a local log dir, earliest first."""
    from launch.worker import FAILURE_FILE

    failures = []
    for path in glob.glob(os.path.join(log_root, "**", FAILURE_FILE), recursive=True):
        info = _load_json(path)
        if isinstance(info, dict):
            failures.append({**info, "kind": "exception", "path": path})
    if not failures:  # scripts launched without launch.worker but decorated with @record themselves
        for path in glob.glob(os.path.join(log_root, "**", "attempt_*", "*", "error.json"), recursive=True):
            try:
                msg = _load_json(path)["message"]
                local_rank = int(os.path.basename(os.path.dirname(path)))
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(msg, str):  # the error file's message is a dict or, for some writers, a string
                msg = {"message": msg, "extraInfo": {}}
            failures.append(
                {
                    "rank": local_rank,
                    "local_rank": local_rank,
                    "host": "?",
                    "time": os.path.getmtime(path),
                    "exception": msg.get("message", "?"),
                    "kind": "exception",
                    "traceback": msg.get("extraInfo", {}).get("py_callstack", ""),
                    "path": path,
                }
            )
    return sorted(failures, key=lambda f: f.get("time", 0.0))


def parse_torchrun_summary(text: str) -> list[dict]:
    """The failed ranks in torchrun's ChildFailedError summary(ies) within `text`."""
    out = []
    for m in _ENTRY_RE.finditer(text):
        before = text[: m.start()]
        root = before.rfind(_ROOT_HEADER) > before.rfind("Failures:")
        try:
            stamp = datetime.datetime.strptime(m["time"], "%Y-%m-%d_%H:%M:%S").timestamp()
        except ValueError:
            stamp = 0.0
        code = int(m["exitcode"])
        out.append(
            {
                "rank": int(m["rank"]),
                "local_rank": int(m["local_rank"]),
                "host": m["host"],
                "pid": int(m["pid"]),
                "exitcode": code,
                "time": stamp,
                "root": root,
                "kind": "signal" if code < 0 else "exit",
            }
        )
    return out


def find_exits(log_root: str) -> list[dict]:
    """Failed ranks as torchrun reported them in each node's stderr log, with hosts from launch_rank.json."""
    from launch.worker import RANK_FILE

    hosts = {}
    for path in glob.glob(os.path.join(log_root, "**", RANK_FILE), recursive=True):
        info = _load_json(path)
        if isinstance(info, dict) and "rank" in info:
            hosts[(info["rank"], info.get("pid"))] = info.get("host", "?")
    exits = []
    for path in sorted(glob.glob(os.path.join(log_root, "*", "*", "stderr.log"))):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for e in parse_torchrun_summary(text):
            e["host"] = hosts.get((e["rank"], e["pid"]), e["host"])
            exits.append(e)
    return exits


def order_failures(exceptions: list[dict], exits: list[dict]) -> list[dict]:
    """Every failure, root cause first (rules in the module Note)."""
    raised = {e["rank"] for e in exceptions}
    exits = [x for x in exits if x["rank"] not in raised]
    teardown = [x for x in exits if x["exitcode"] == -signal.SIGTERM]
    others = [x for x in exits if x["exitcode"] != -signal.SIGTERM]
    if exceptions or others:
        exits = others
    else:
        exits = teardown

    def effective_time(f: dict) -> float:
        if f["kind"] == "signal" and f["exitcode"] != -signal.SIGTERM:
            return f["time"] - SIGNAL_MARGIN
        if f["kind"] in ("signal", "exit"):
            return f["time"] + 1.0  # torchrun's stamp is the start of the second it noticed the exit
        return f.get("time", 0.0)

    return sorted([*exceptions, *exits], key=lambda f: (effective_time(f), not f.get("root", False), f["rank"]))


def reason(f: dict) -> str:
    """What happened to the rank, in words: 'raised ...', 'was killed by signal ...', 'exited with code ...'."""
    if f["kind"] == "exception":
        return f"raised {f['exception']}"
    if f["kind"] == "signal":
        try:
            name = signal.Signals(-f["exitcode"]).name
        except ValueError:
            name = "signal"
        return f"was killed by signal {name} ({-f['exitcode']})"
    return f"exited with code {f['exitcode']}"


def report_failure(failures: list[dict], status_text: str, log_dir: Optional[str]) -> None:
    """Print which rank failed first and why (stderr), then the other failing ranks."""
    err = sys.stderr
    if not failures:
        print(f"launch: job FAILED; no rank recorded a failure. {status_text}", file=err)
        return
    first = failures[0]
    print(
        f"launch: job FAILED: rank {first['rank']} (local rank {first['local_rank']} on {first['host']}) "
        f"{reason(first)}",
        file=err,
    )
    if first.get("kind", "exception") == "exception":
        print(f"launch: rank {first['rank']} traceback:", file=err)
        for line in first.get("traceback", "").rstrip().splitlines():
            print(f"  [rank{first['rank']}] {line}", file=err)
    elif first["exitcode"] == -signal.SIGKILL:
        print(
            "launch: SIGKILL comes from outside the rank: the kernel's OOM killer (see `dmesg`), a scheduler "
            "limit or a user",
            file=err,
        )
    for other in failures[1:]:
        print(f"launch: rank {other['rank']} also failed (later): {reason(other).removeprefix('raised ')}", file=err)
    if log_dir:
        print(f"launch: per-rank logs under {log_dir}", file=err)


def report_hang(verdict: dict, log_dir: Optional[str]) -> None:
    """Print a watchdog's hang verdict: the summary line, then the stuck rank's stack."""
    from launch.watchdog import format_stack

    stuck = verdict.get("stuck") or {}
    lines = [verdict.get("summary", "launch: job HUNG"), *format_stack(stuck.get("rank"), verdict.get("stack", ""))]
    if log_dir:
        lines.append(f"launch: per-rank logs and every rank's stack (rank*.stack) under {log_dir}")
    print("\n".join(lines), file=sys.stderr)


def _load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
