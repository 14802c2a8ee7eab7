"""Run a script that starts its own ranks (Lightning's script launcher, `accelerate launch`) from a test.

Those frameworks start the other ranks themselves (Lightning re-runs the script, accelerate goes
through torchrun), so the test cannot hold their pids. Every process of a job inherits a marker in
its environment instead; whatever happens (success, failure, timeout, pytest-timeout's exception),
every process carrying it is killed before the call returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launch.net import free_port
from tests.procs import kill_marked, procs_with

REPO = Path(__file__).resolve().parents[2]
MARKER_ENV = "DDP_COMPILE_SCRIPT_JOB"
"""Environment variable carrying a job's marker (inherited by every rank the job starts)."""
_RANK_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""Inherited rank variables would make the frameworks believe they were launched as a rank already."""


def run_script_job(
    cmd: list[str], *, prefix: str, timeout: float, env: dict[str, str] | None = None, grace_s: float = 10.0
) -> subprocess.CompletedProcess:
    """Run `cmd` in the repo root (stdout and stderr together); fail the test after `timeout` seconds."""
    marker = f"{prefix}_{uuid.uuid4().hex[:12]}"
    base = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    full_env = {
        **base,
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "MASTER_PORT": str(free_port()),
        MARKER_ENV: marker,
        **(env or {}),
    }
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_marked(marker)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout:.0f}s; output:\n{out[-6000:]}")
    finally:
        if proc.poll() is None:  # pytest-timeout (or Ctrl-C) interrupted communicate()
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + grace_s  # ranks still exiting after the launcher returned
        while procs_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        kill_marked(marker)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def example(name: str) -> list[str]:
    """The command that runs examples/`name` with this interpreter."""
    return [sys.executable, str(REPO / "examples" / name)]


def assert_ok(result: subprocess.CompletedProcess) -> str:
    """The job's output; fails the test with its tail when the job failed."""
    assert result.returncode == 0, f"{' '.join(result.args)} exited {result.returncode}:\n{result.stdout[-6000:]}"
    return result.stdout
