"""`python -m launch` and the torchx component, end to end (gloo on CPU, nccl when GPUs are visible).

Every job runs a tiny script written to tmp_path whose path carries a unique marker, so the tests can
prove that no rank, torchrun or bash process survives the job (scan of /proc/*/cmdline for the marker).
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from launch.net import free_port
from tests.procs import kill_marked, procs_with

pytestmark = pytest.mark.multi_gpu

REPO = Path(__file__).resolve().parents[2]

# One rank script for every test: its behaviour is picked through the environment.
RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist

    backend = os.environ["DDP_COMPILE_DIST_BACKEND"]  # set by the launcher: nccl with enough GPUs, else gloo
    if backend == "nccl":
        import torch
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per rank
    dist.init_process_group(backend)
    rank = dist.get_rank()
    print(f"rank {rank}/{dist.get_world_size()} up, cache={os.environ.get('TORCHINDUCTOR_CACHE_DIR')}, "
          f"argv={sys.argv[1:]}", flush=True)
    if os.environ.get("FAIL_RANK") == str(rank):
        raise ValueError(f"deliberate failure on rank {rank} (launch test)")
    if os.environ.get("HANG"):
        print(f"rank {rank} ready to hang", flush=True)
        time.sleep(600)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _assert_no_leftovers(marker: str, grace: float = 5.0) -> None:
    """No process carrying `marker` survives (after `grace` seconds to exit); any that does is killed
    first, then reported, so a failing test leaves nothing running either."""
    deadline = time.monotonic() + grace
    while (left := procs_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        kill_marked(marker)
    assert not left, "processes left behind: " + "; ".join(map(str, left))


@pytest.fixture
def job(tmp_path: Path):
    """A rank script at a marker-bearing path; `job.run(*launch_args, env=...)` runs it through the CLI."""
    marker = f"launchtest_{uuid.uuid4().hex[:12]}"
    workdir = tmp_path / marker
    workdir.mkdir()
    script = workdir / "rank_script.py"
    script.write_text(RANK_SCRIPT)

    class Job:
        def __init__(self) -> None:
            self.marker, self.script, self.workdir = marker, script, workdir

        def cmd(self, *launch_args: str, script_args: tuple[str, ...] = ()) -> list[str]:
            return [
                sys.executable,
                "-m",
                "launch",
                "--rdzv-port",
                str(free_port()),
                "--log-dir",
                str(workdir / "logs"),
                *launch_args,
                str(script),
                *script_args,
            ]

        def run(
            self, *launch_args: str, env: dict | None = None, timeout: float = 120, script_args: tuple[str, ...] = ()
        ) -> subprocess.CompletedProcess:
            return _run(self.cmd(*launch_args, script_args=script_args), env=env, timeout=timeout, marker=marker)

    yield Job()
    _assert_no_leftovers(marker)


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    return env


def _run(cmd: list[str], *, marker: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the launcher in its own session; on a timeout (or any exception, pytest-timeout's included)
    kill it and every process carrying the job's `marker`: torchx's local scheduler starts the replicas
    in sessions of their own, out of reach of the launcher's process group."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_marked(marker)
        out, err = proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            pytest.fail(f"launcher did not finish within {timeout}s; stdout:\n{out}\nstderr:\n{err}")
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.compat
@pytest.mark.timeout(180)
def test_two_rank_job_succeeds_and_repairs_an_open_cache_dir(job):
    # A pre-existing world-writable cache with a planted file: must be emptied and made private.
    cache = job.workdir / "inductor_cache"
    cache.mkdir()
    (cache / "planted.so").write_text("not ours")
    cache.chmod(0o777)

    res = job.run("--nproc-per-node", "2", "--inductor-cache-dir", str(cache), script_args=("--flag", "x y"))

    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert f"[{rank}]:rank {rank}/2 up, cache={cache}, argv=['--flag', 'x y']" in res.stdout
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert not (cache / "planted.so").exists()
    assert "was group/world-writable" in res.stdout + res.stderr


@pytest.mark.timeout(180)
def test_failing_rank_is_named_with_its_exception(job):
    t0 = time.monotonic()
    res = job.run("--nproc-per-node", "2", env={"FAIL_RANK": "1"}, timeout=90)
    elapsed = time.monotonic() - t0

    assert res.returncode != 0
    assert elapsed < 90
    summary = [line for line in res.stderr.splitlines() if line.startswith("launch: job FAILED")]
    assert summary == [
        "launch: job FAILED: rank 1 (local rank 1 on "
        f"{socket.gethostname()}) raised ValueError: deliberate failure on rank 1 (launch test)"
    ]
    assert "[rank1] ValueError: deliberate failure on rank 1" in res.stderr  # the traceback's last line


@pytest.mark.timeout(120)
def test_sigterm_stops_every_rank(job):
    proc = subprocess.Popen(
        job.cmd("--nproc-per-node", "2"),
        cwd=REPO,
        env=_env({"HANG": "1"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        ready = 0
        deadline = time.monotonic() + 60
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            ready += "ready to hang" in line
        assert ready == 2, "ranks never reached the hang point"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_marked(job.marker)  # the ranks (sleeping 600 s) live in sessions of their own
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "got SIGTERM; stopping every rank" in out
    _assert_no_leftovers(job.marker)


@pytest.mark.timeout(60)
def test_dry_run_prints_torchrun_command_and_starts_nothing(job):
    res = job.run("--nproc-per-node", "2", "--dry-run", env={"HANG": "1"}, timeout=40)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    torchrun = lines[lines.index("torchrun command (run on each of 1 node(s)):") + 1].strip()
    assert torchrun.startswith("torchrun ") and "--nproc_per_node 2" in torchrun
    assert f"-m launch.worker script {job.script}" in torchrun
    assert "rank 0/2 up" not in res.stdout
    assert not (job.workdir / "logs").exists()  # nothing was scheduled


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/train_missing.py"], "does not exist"),
        (["--nproc-per-node", "0", "SCRIPT"], "--nproc-per-node 0"),
        (["-j", "2y3", "SCRIPT"], "-j '2y3'"),
        (["--scheduler", "no_such_scheduler", "SCRIPT"], "no_such_scheduler"),
    ],
    ids=["missing-script", "nproc-0", "malformed-j", "unknown-scheduler"],
)
def test_bad_input_is_one_line_and_exit_2(job, args, message):
    args = [str(job.script) if a == "SCRIPT" else a for a in args]
    t0 = time.monotonic()
    res = _run(
        [sys.executable, "-m", "launch", "--log-dir", str(job.workdir / "logs"), *args], timeout=40, marker=job.marker
    )
    assert res.returncode == 2
    assert res.stdout == ""
    assert len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith("launch: error: ") and message in res.stderr
    assert not (job.workdir / "logs").exists()  # rejected before anything was scheduled
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_component_passes_torchx_validation():
    from torchx.specs import file_linter, finder

    path = str(REPO / "launch" / "components.py")
    assert file_linter.validate(path, "trainer") == []
    component = finder.get_component(f"{path}:trainer")
    app = component.fn(script="examples/train_gpt.py", j="1:2x4", gpu=4)
    role = app.roles[0]
    assert (role.min_replicas, role.num_replicas, role.name) == (1, 2, "train_gpt")
    assert role.env["DDP_COMPILE_DIST_BACKEND"] == "nccl"
    assert role.env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert "exec torchrun" in role.args[1] and "--nnodes 1:2" in role.args[1]


@pytest.mark.timeout(60)
def test_component_is_registered_next_to_dist():
    from torchx.specs import finder

    # The entry point comes with `pip install -e .` (the README's set-up), so it must be there.
    components = finder.get_components()
    assert {"ddp_compile.trainer", "dist.ddp"} <= set(components), sorted(components)


@pytest.mark.timeout(300)
def test_demo_job_runs_compiled_and_learns(tmp_path):
    # The demo's own model, data and number of steps (aot_eager: Inductor's cold compile is a minute here):
    # its printed loss must fall well below ln(vocab), which uniform random tokens never let it do.
    marker = f"launchdemo_{uuid.uuid4().hex[:12]}"
    res = _run(
        [
            sys.executable,
            "-m",
            "launch",
            "--nproc-per-node",
            "2",
            "--rdzv-port",
            str(free_port()),
            "--log-dir",
            str(tmp_path / marker),
            "--env",
            f"LAUNCH_TEST_MARKER={marker}",
            "--inductor-cache-dir",
            str(tmp_path / "inductor_cache"),
            str(REPO / "examples" / "train_gpt.py"),
            "--backend",
            "aot_eager",
        ],
        timeout=240,
        marker=marker,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = {int(m[0]): float(m[1]) for m in re.findall(r"^\[0\]:step +(\d+)/\d+ +loss (\S+)", res.stdout, re.M)}
    steps = max(losses)
    assert 1 in losses and f"[0]:summary: {steps} steps" in res.stdout, res.stdout[-3000:]
    assert abs(losses[1] - math.log(1024)) < 0.5, losses  # a model that knows nothing yet
    assert losses[steps] < 0.6 * losses[1], losses
    # the report comes once, after DDP's buckets were aligned to the compiled pieces
    assert res.stdout.count("compile report (rank 0)") == 1
    assert "DDP bucket alignment:" in res.stdout and "DDP bucket alignment: pending" not in res.stdout
    assert "compile_core: graph_0" in res.stdout + res.stderr  # rank 0's compile progress, shown by default
    _assert_no_leftovers(marker)
