"""The launcher's hang watchdog (launch/watchdog.py): the grace rules of HangPolicy (a longer limit for start-up,
the first step and compiles), when find_hang calls a hang and which rank it names as stuck, how a rank's stack
is tagged, and that the watchdog process passes on its child's exit code and forwards SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch import heartbeat
from launch.heartbeat import Record
from launch.watchdog import Hang, HangPolicy, find_hang, format_stack

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)  # the slowest starts a worker (imports torch) or `python -m launch`


def _rec(rank: int, last: float, beats: int = 5, phase: str = "step", pid: int | None = None) -> Record:
    return Record(
        rank=rank, local_rank=rank, host="h", pid=pid or 1000 + rank, start=0.0, last=last, beats=beats, phase=phase
    )


POLICY = HangPolicy(hang_timeout=10)


def test_policy_defaults_and_limits():
    assert POLICY.first_step_timeout == 600
    assert HangPolicy(hang_timeout=120).first_step_timeout == 1200
    assert POLICY.limit(_rec(0, 0, beats=0)) == 600  # not beaten yet: start-up
    assert POLICY.limit(_rec(0, 0, beats=1)) == 600  # inside the first step
    assert POLICY.limit(_rec(0, 0, beats=7, phase="compile")) == 600
    assert POLICY.limit(_rec(0, 0, beats=2)) == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hang_timeout": 0}, "hang timeout 0"),
        ({"hang_timeout": -1.5}, "hang timeout -1.5"),
        ({"hang_timeout": float("nan")}, "hang timeout nan"),
        ({"hang_timeout": 10, "first_step_timeout": 5}, "first-step timeout 5"),
    ],
)
def test_policy_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HangPolicy(**kwargs)


def test_no_hang_while_any_rank_is_within_its_limit():
    # rank 0 evaluates alone (beating) while rank 1 waits at a barrier: progress, not a hang
    assert find_hang([_rec(0, 95.0), _rec(1, 50.0)], 100.0, POLICY, watch_start=0) is None
    # rank 1 compiles (long grace) while rank 0 waits for it in the all-reduce
    assert find_hang([_rec(0, 60.0), _rec(1, 50.0, phase="compile")], 100.0, POLICY, watch_start=0) is None


def test_hang_names_the_rank_with_the_oldest_heartbeat():
    hang = find_hang([_rec(0, 89.0), _rec(1, 88.5), _rec(2, 89.9)], 100.0, POLICY, watch_start=0)
    assert hang.stuck.rank == 1 and hang.idle == pytest.approx(11.5)
    assert hang.summary() == (
        "launch: job HUNG: rank 1 (host h, pid 1001) made no progress for 11.5 s "
        "(last heartbeat: step) -- stopping the job"
    )


def test_a_rank_that_never_beat_counts_as_oldest():
    recs = [_rec(0, 10.0), _rec(1, 700.0, beats=0, phase="start"), _rec(2, 5.0)]
    hang = find_hang(recs, 1400.0, POLICY, watch_start=0)
    assert hang.stuck.rank == 1
    assert "(last heartbeat: none since the rank started)" in hang.summary()


def test_finished_ranks_are_never_named():
    recs = [_rec(0, 50.0, pid=11), _rec(1, 80.0, pid=12)]
    hang = find_hang(recs, 100.0, POLICY, watch_start=0, alive=lambda pid: pid != 11)
    assert hang.stuck.rank == 1


def test_no_rank_started_uses_the_first_step_timeout():
    assert find_hang([], 599.0, POLICY, watch_start=0) is None
    hang = find_hang([], 601.0, POLICY, watch_start=0)
    assert hang.stuck is None and "no rank started within 601.0 s" in hang.summary()


def test_stack_is_tagged_and_trampoline_frames_dropped():
    stack = (
        "Current thread 0x1 (most recent call first):\n"
        '  File "/x/rank_script.py", line 9 in stuck\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
        '  File "/repo/launch/worker.py", line 117 in _run\n'
    )
    assert format_stack(1, stack) == [
        "launch: rank 1 stack at that moment (faulthandler, most recent call first):",
        "  [rank1] Current thread 0x1 (most recent call first):",
        '  [rank1]   File "/x/rank_script.py", line 9 in stuck',
    ]
    assert "no stack" in format_stack(1, "")[0]
    assert isinstance(Hang(stuck=None, idle=1.0).summary(), str)


def test_watchdog_passes_the_exit_code_and_forwards_sigterm(tmp_path):
    env = dict(os.environ)
    env.pop(heartbeat.HEARTBEAT_DIR_ENV, None)
    wd = [sys.executable, "-m", "launch.watchdog", "--hang-timeout", "5", "--"]
    res = subprocess.run([*wd, sys.executable, "-c", "import sys; sys.exit(7)"], cwd=REPO, env=env, timeout=60)
    assert res.returncode == 7
    marker = tmp_path / "got_term"
    child = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).touch(), sys.exit(5)))\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"
    )
    proc = subprocess.Popen([*wd, sys.executable, "-c", child], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 5 and marker.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
