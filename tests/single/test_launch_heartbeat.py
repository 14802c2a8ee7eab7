"""The launcher's heartbeat writer (launch/heartbeat.py), no process group needed: a no-op costing microseconds
when heartbeats are off, one record per rank updated in place at microsecond cost, no beats from forked
children, bad phase names refused, an unwritable directory warned about once, foreign files ignored, and a
launch.worker rank that records itself and dumps its stack on SIGUSR1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import timeit
from pathlib import Path

import pytest

from launch import heartbeat
from launch.watchdog import dump_stacks

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
