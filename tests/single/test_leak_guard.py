"""The suite's own leak guard (tests/procs.py, pytest_sessionfinish in tests/conftest.py) can fail.

Processes are found by a marker in their environment wherever they are in the process tree: in a
session of their own (as torchx and the benchmark runner start ranks) or orphaned after their parent
died. The last test runs a small pytest session that leaks a process and checks that the session
fails, names the process and kills it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.procs import SESSION_ENV, kill_marked, procs_with, session_leftovers

REPO = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()


@pytest.fixture
def marker():
    marker = f"leakguard_{uuid.uuid4().hex[:12]}"
    yield marker
    kill_marked(marker)  # whatever the test's outcome


def test_a_process_in_a_session_of_its_own_is_found_and_killed(marker):
    proc = subprocess.Popen(SLEEPER, env={**os.environ, "LEAK_TEST_MARKER": marker}, start_new_session=True)
    assert _wait_for(lambda: [p for p in procs_with(marker) if p.pid == proc.pid])
    killed = kill_marked(marker)
    assert [p.pid for p in killed] == [proc.pid]
    assert proc.wait(timeout=10) == -9
    assert procs_with(marker) == []


def test_an_orphan_is_a_leftover_and_a_live_helper_of_ours_is_not(marker):
    env = {**os.environ, "LEAK_TEST_MARKER": marker}
    # the parent starts a sleeper and exits at once: the sleeper is re-parented, out of our tree
    spawn = f"import subprocess; subprocess.Popen({SLEEPER!r}, start_new_session=True)"
    subprocess.run([sys.executable, "-c", spawn], env=env, check=True, timeout=30)
    orphans = _wait_for(lambda: procs_with(marker))
    assert len(orphans) == 1 and orphans[0].ppid != os.getpid()
    # a process below us named like multiprocessing's resource tracker is allowed while we live
    helper = subprocess.Popen([*SLEEPER, "multiprocessing.resource_tracker"], env=env)
    try:
        _wait_for(lambda: len(procs_with(marker)) == 2)
        assert [p.pid for p in session_leftovers(marker)] == [orphans[0].pid]
    finally:
        helper.kill()
        helper.wait()


def test_a_session_that_leaves_a_process_behind_fails_and_kills_it(tmp_path, marker):
    (tmp_path / "test_leaky.py").write_text(
        textwrap.dedent(f"""
        import subprocess, sys
        def test_leaks():
            subprocess.Popen({SLEEPER!r}, start_new_session=True)  # never killed by the test
    """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_COMPILE_TEST")}
    env[SESSION_ENV] = marker  # the inner session's marker (set before its conftest would make one)
    env["DDP_COMPILE_TEST_LEFTOVER_GRACE_S"] = "1"
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-q",
            str(tmp_path / "test_leaky.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stdout + res.stderr  # the test itself passed: the leak fails the run
    assert "1 passed" in res.stdout
    assert "1 process(es) started by the test session were still alive" in res.stdout
    assert "time.sleep(600)" in res.stdout
    assert procs_with(marker) == []  # and it was killed


def _spawn_then_fail_or_hang(rank: int, world_size: int, marker: str) -> None:
    import torch.distributed as dist

    subprocess.Popen(SLEEPER, env={**os.environ, "LEAK_TEST_MARKER": marker})  # a child of the rank
    dist.barrier()  # both children exist before anything fails
    if rank == 0:
        raise RuntimeError("deliberate failure on rank 0 (leak guard test)")
    time.sleep(600)  # rank 1 hangs, as a rank whose peer died does


@pytest.mark.multi_gpu
@pytest.mark.timeout(120)
def test_run_ranks_kills_every_rank_and_what_it_started(marker):
    from tests.ranks import run_ranks

    with pytest.raises(RuntimeError, match="(?s)rank 0 failed:.*deliberate failure"):
        run_ranks(_spawn_then_fail_or_hang, marker, world_size=2, timeout=90)
    # the hung rank 1, and both ranks' children (rank 0 exited but its child did not), are gone
    assert _wait_for(lambda: not procs_with(marker), timeout=5), [str(p) for p in procs_with(marker)]
    assert not [p for p in procs_with("spawn_main") if p.ppid == os.getpid()], "a rank is still alive"
