"""Unit checks of the launcher's failure and hang machinery that need no process group: the heartbeat
writer, the watchdog's grace rules and stuck-rank choice, the root-cause order of failures, the
--hang-timeout arguments and the component's hang options."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import timeit
from pathlib import Path

import pytest

from launch import cli, components, heartbeat
from launch.failures import order_failures, parse_torchrun_summary, reason
from launch.heartbeat import Record
from launch.net import free_port
from launch.watchdog import Hang, HangPolicy, dump_stacks, find_hang, format_stack

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)  # the slowest starts a worker (imports torch) or `python -m launch`


@pytest.fixture
def hb_env(monkeypatch, tmp_path):
    """Heartbeats on, into tmp_path, as global rank 3; the writer is reset before and after."""
    heartbeat._reset_for_tests()
    monkeypatch.setenv(heartbeat.HEARTBEAT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    yield tmp_path
    heartbeat._reset_for_tests()


# --- heartbeat writer -------------------------------------------------------------------------------


def test_beat_is_a_cheap_no_op_without_the_env_var(monkeypatch, tmp_path):
    heartbeat._reset_for_tests()
    monkeypatch.delenv(heartbeat.HEARTBEAT_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    n = 100_000
    per_call = timeit.timeit(heartbeat.beat, number=n) / n
    assert per_call < 5e-6, f"{per_call * 1e6:.2f} us per no-op beat"
    assert heartbeat.start() is None and list(tmp_path.iterdir()) == []
    heartbeat._reset_for_tests()


def test_start_then_beats_update_one_record(hb_env):
    path = heartbeat.start()
    rec = heartbeat.read_record(path)
    assert (rec.rank, rec.local_rank, rec.pid, rec.beats, rec.phase) == (3, 1, os.getpid(), 0, "start")
    assert rec.last == rec.start
    heartbeat.beat()
    heartbeat.beat("compile")
    rec2 = heartbeat.read_records(str(hb_env))[0]
    assert (rec2.beats, rec2.phase) == (2, "compile") and rec2.last > rec.last
    heartbeat.beat()
    assert heartbeat.read_record(path).phase == "step"
    assert sorted(p.name for p in hb_env.iterdir()) == ["rank3"]  # written in place, no temp files left


def test_every_beat_lands_at_microsecond_cost(hb_env):
    # The "rate limit" is the memory map: each beat is a few stores into shared memory, no system call,
    # so every beat is visible (the watchdog needs exact last-beat times) and a training step pays ~1 us.
    heartbeat.beat()
    n = 50_000
    per_call = timeit.timeit(heartbeat.beat, number=n) / n
    assert per_call < 20e-6, f"{per_call * 1e6:.2f} us per beat"
    assert heartbeat.read_records(str(hb_env))[0].beats == n + 1


def test_a_forked_child_does_not_beat_for_the_rank(hb_env):
    heartbeat.beat()
    pid = os.fork()
    if pid == 0:  # child: e.g. a DataLoader worker calling a compiled model
        heartbeat.beat()
        os._exit(0)
    os.waitpid(pid, 0)
    assert heartbeat.read_records(str(hb_env))[0].beats == 1


def test_bad_phase_is_refused_with_the_fix(hb_env):
    with pytest.raises(ValueError, match="expected an ASCII name of 1 to 16 characters"):
        heartbeat.beat("a-phase-name-that-is-too-long")


def test_unwritable_dir_disables_heartbeats_with_one_warning(monkeypatch, tmp_path, capsys):
    heartbeat._reset_for_tests()
    monkeypatch.setenv(heartbeat.HEARTBEAT_DIR_ENV, str(tmp_path / "missing"))
    heartbeat.beat()
    heartbeat.beat()
    assert capsys.readouterr().err.count("this rank sends no heartbeats") == 1
    heartbeat._reset_for_tests()


def test_foreign_or_torn_files_are_ignored(tmp_path):
    (tmp_path / "rank0").write_bytes(b"not a record")
    (tmp_path / "rank1.stack").write_text("Thread ...")
    assert heartbeat.read_records(str(tmp_path)) == []


def test_worker_records_the_rank_and_dumps_its_stack_on_sigusr1(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    hb = tmp_path / "hb"
    hb.mkdir()
    err_dir = tmp_path / "attempt_0" / "1"
    env = dict(
        os.environ,
        TORCHELASTIC_ERROR_FILE=str(err_dir / "error.json"),
        RANK="5",
        LOCAL_RANK="1",
        **{heartbeat.HEARTBEAT_DIR_ENV: str(hb)},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.worker", "script", str(script)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        (rec,) = heartbeat.read_records(str(hb))
        assert (rec.rank, rec.local_rank, rec.pid, rec.beats, rec.phase) == (5, 1, proc.pid, 0, "start")
        assert json.loads((err_dir / "launch_rank.json").read_text())["rank"] == 5  # for the SIGKILL report
        stack = dump_stacks(str(hb), [rec], want=5)
        # line 2 (print) or 3 (sleep): under load the signal may land before the print call has returned
        assert re.search(rf'File "{re.escape(str(script))}", line [23] in <module>', stack), stack
        assert proc.poll() is None  # the dump does not disturb the rank
    finally:
        proc.kill()
        proc.wait()


# --- grace rules and the stuck rank -----------------------------------------------------------------


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


# --- failures: torchrun's summary and the root cause ------------------------------------------------

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


# --- arguments and the component --------------------------------------------------------------------


@pytest.fixture
def script(tmp_path):
    s = tmp_path / "s.py"
    s.write_text("")
    return str(s)


def test_hang_flags_are_parsed(script):
    cfg = cli.parse_args(["--hang-timeout", "30", "--hang-first-step-timeout", "900", script])
    assert (cfg.hang_timeout, cfg.hang_first_step_timeout) == (30.0, 900.0)
    assert cli.parse_args([script]).hang_timeout is None  # off by default


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hang-timeout", "0"], "--hang-timeout 0: expected a number of seconds > 0"),
        (["--hang-timeout", "-5"], "--hang-timeout -5: expected a number of seconds > 0"),
        (["--hang-timeout", "soon"], "--hang-timeout 'soon': expected a number of seconds > 0"),
        (["--hang-timeout", "inf"], "--hang-timeout inf: expected a number of seconds > 0"),
        (
            ["--hang-timeout", "60", "--hang-first-step-timeout", "30"],
            "--hang-first-step-timeout 30: expected seconds >= --hang-timeout (60)",
        ),
        (["--hang-first-step-timeout", "30"], "needs --hang-timeout"),
    ],
)
def test_bad_hang_values_are_usage_errors(script, flags, message):
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cli.parse_args([*flags, script])


def test_bad_hang_value_is_one_line_and_exit_2(script):
    res = subprocess.run(
        [sys.executable, "-m", "launch", "--hang-timeout", "0", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == ["launch: error: --hang-timeout 0: expected a number of seconds > 0 (e.g. 300)"]


def test_component_runs_torchrun_under_the_watchdog_only_when_asked():
    plain = components.trainer(script="a.py")
    assert "launch.watchdog" not in plain.roles[0].args[1]
    assert components.HEARTBEAT_DIR_ENV not in plain.roles[0].env
    app = components.trainer(script="a.py", hang_timeout=30, heartbeat_dir="/tmp/hb")
    cmd = app.roles[0].args[1]
    assert "exec python3 -m launch.watchdog --hang-timeout 30.0 -- torchrun " in cmd
    assert app.roles[0].env[components.HEARTBEAT_DIR_ENV] == "/tmp/hb"
    first = components.trainer(script="a.py", hang_timeout=30, hang_first_step_timeout=1200)
    assert "--hang-timeout 30.0 --first-step-timeout 1200.0 -- torchrun" in first.roles[0].args[1]
    assert components.HEARTBEAT_DIR_ENV == heartbeat.HEARTBEAT_DIR_ENV  # the component keeps its own copy
    # `torchx run ... --hang_timeout 30` hands the value over as the string "30" (torchx 0.7.0)
    assert "--hang-timeout 30.0 --" in components.trainer(script="a.py", hang_timeout="30").roles[0].args[1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hang_timeout": 0.0}, "hang_timeout=0.0: expected a number of seconds > 0"),
        (
            {"hang_timeout": 10.0, "hang_first_step_timeout": 1.0},
            "hang_first_step_timeout=1.0: expected seconds >= hang_timeout",
        ),
        ({"hang_timeout": "soon"}, "hang_timeout='soon': expected a number of seconds > 0"),
        ({"heartbeat_dir": "/tmp/hb"}, "need hang_timeout"),
    ],
)
def test_component_rejects_bad_hang_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        components.trainer(script="a.py", **kwargs)


def test_dry_run_shows_the_watchdog(script):
    res = subprocess.run(
        [sys.executable, "-m", "launch", "--dry-run", "--hang-timeout", "20", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "python3 -m launch.watchdog --hang-timeout 20.0 -- torchrun " in res.stdout


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


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    # An ephemeral port can be handed to any outgoing connection (gloo's) before the rendezvous binds it.
    import socket

    from launch.net import ephemeral_range

    low, high = ephemeral_range()
    for _ in range(20):
        port = free_port()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        assert 0 < port < 65536 and not low <= port <= high, (port, low, high)
