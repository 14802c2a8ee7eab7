"""The launcher's failure report (launch/failures.py): parsing torchrun's failure summary, and choosing the root
cause among a rank's exception and the other ranks' exits (a killed rank before the survivor that raised after
it, an earlier exception before a later kill, SIGTERM deaths as teardown), with the reason worded per kind."""

from __future__ import annotations

import pytest

from launch.failures import order_failures, parse_torchrun_summary, reason

pytestmark = pytest.mark.timeout(120)  # the slowest starts a worker (imports torch) or `python -m launch`


TORCHRUN_SUMMARY = """\
[0]:[rank0]: RuntimeError: Connection closed by peer
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
launch.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_12:28:47
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4311)  (SIGTERM)
  error_file: /tmp/x/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_12:28:47
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4312)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4312
============================================================
"""


def test_torchrun_summary_is_parsed():
    entries = parse_torchrun_summary(TORCHRUN_SUMMARY)
    assert [(e["rank"], e["exitcode"], e["pid"], e["root"], e["kind"]) for e in entries] == [
        (0, -15, 4311, False, "signal"),
        (1, -9, 4312, True, "signal"),
    ]


def _exc(rank: int, t: float) -> dict:
    return {
        "rank": rank,
        "local_rank": rank,
        "host": "h",
        "time": t,
        "kind": "exception",
        "exception": "RuntimeError: Connection closed by peer",
        "traceback": "",
    }


def test_a_killed_rank_is_the_root_cause_not_the_survivor_that_raised_after_it():
    exits = parse_torchrun_summary(TORCHRUN_SUMMARY)
    t = exits[1]["time"]
    # rank 0 raised 0.3 s after the second torchrun stamped: a consequence of rank 1's death
    ordered = order_failures([_exc(0, t + 0.3)], exits)
    assert [f["rank"] for f in ordered] == [1, 0]
    assert reason(ordered[0]) == "was killed by signal SIGKILL (9)"


def test_an_exception_well_before_a_kill_stays_the_root_cause():
    exits = parse_torchrun_summary(TORCHRUN_SUMMARY)
    t = exits[1]["time"]
    ordered = order_failures([_exc(0, t - 30)], exits)  # e.g. torchrun's SIGKILL of a rank ignoring SIGTERM
    assert [f["rank"] for f in ordered] == [0, 1]


def test_sigterm_deaths_are_teardown_unless_nothing_else_failed():
    exits = parse_torchrun_summary(TORCHRUN_SUMMARY)
    assert [f["rank"] for f in order_failures([_exc(1, 0.0)], exits[:1])] == [1]
    only_term = order_failures([], exits[:1])
    assert reason(only_term[0]) == "was killed by signal SIGTERM (15)"


def test_plain_exit_code_is_reported():
    f = {"rank": 2, "local_rank": 0, "host": "h", "pid": 5, "exitcode": 3, "time": 0.0, "root": True, "kind": "exit"}
    assert reason(order_failures([], [f])[0]) == "exited with code 3"
