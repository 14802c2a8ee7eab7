"""Run a rank script through `python -m launch` from a test, and leave nothing behind.

The script lives under a directory named after a unique marker; every process of the job carries the
marker (command line or environment), which is how a timed-out or failed test finds and kills them:
torchx starts each node in a session of its own and torchrun each rank in its own, so killing the
launcher's process group is not enough.
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


class LaunchJob:
    """A rank script at a marker-bearing path under `tmp_path`; `run()` launches it on 2 ranks."""

    def __init__(self, tmp_path: Path, prefix: str, script_text: str) -> None:
        self.marker = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.workdir = tmp_path / self.marker
        self.workdir.mkdir()
        self.script = self.workdir / "rank_script.py"
        self.script.write_text(script_text)

    def run(
        self, *launch_args: str, env: dict | None = None, timeout: float = 150, script_args: tuple[str, ...] = ()
    ) -> tuple[subprocess.CompletedProcess, float]:
        """(result, wall time of the launcher's exit); fails the test after `timeout`, killing everything."""
        cmd = [
            sys.executable,
            "-m",
            "launch",
            "--nproc-per-node",
            "2",
            "--rdzv-port",
            str(free_port()),
            "--log-dir",
            str(self.workdir / "logs"),
            *launch_args,
            str(self.script),
            *script_args,
        ]
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_marked(self.marker)
            out, err = proc.communicate()
            pytest.fail(f"launcher did not finish within {timeout}s; stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.time()

    def assert_nothing_left(self, grace: float = 5.0) -> None:
        deadline = time.monotonic() + grace
        while (left := procs_with(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes left behind: {left}"

    def kill(self) -> None:
        kill_marked(self.marker)  # also on a pytest-timeout, which raises inside the test


def launch_job_fixture(prefix: str, script_text: str):
    """A pytest fixture body: yields a `LaunchJob`, then checks and cleans up."""

    def fixture(tmp_path: Path):
        job = LaunchJob(tmp_path, prefix, script_text)
        try:
            yield job
            job.assert_nothing_left()
        finally:
            job.kill()

    return fixture
