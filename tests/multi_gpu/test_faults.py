"""Fault suite, launcher cases: a rank SIGKILLed mid-step, and a rank hung after step 2 under
`python -m launch --hang-timeout`. Each asserts the outcome (which rank, why), the wall time from the fault
to the launcher's exit, and that no process of the job is left.

Every job runs a rank script written to tmp_path under a directory whose name is a unique marker; the
launcher's processes carry it in their command line or environment. On any exit from a test (including a
pytest-timeout, which raises inside the test) the fixture kills every process still carrying the marker:
torchx starts each node in its own session and torchrun each rank in its own, so killing the launcher's
process group would not be enough.
"""

from __future__ import annotations

import re
import socket
import textwrap

import pytest

from tests.multi_gpu.launch_jobs import LaunchJob, launch_job_fixture

pytestmark = pytest.mark.multi_gpu


# Steps: heartbeat, all-reduce, print. FAULT picks what rank 1 does once steps 1 and 2 are done.
RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    import torch
    import torch.distributed as dist
    from launch import heartbeat

    backend = os.environ["DDP_COMPILE_DIST_BACKEND"]
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = "cuda"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    fault = os.environ["FAULT"]


    def hang_forever():
        print(f"FAULT_AT {time.time():.3f}", flush=True)
        time.sleep(3600)  # the line the hang report must show


    t = torch.ones(4, device=device)
    for step in range(1, 1000):
        if rank == 1 and step == 3:
            time.sleep(1.0)  # let rank 0 enter step 3's all-reduce first: it must be blocked in a collective
            if fault == "sigkill":
                print(f"FAULT_AT {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "hang":
                hang_forever()
        heartbeat.beat()
        dist.all_reduce(t)
        print(f"rank {rank} step {step} done", flush=True)
        if step == 2:
            time.sleep(0.5)
    """
)


_job = pytest.fixture(launch_job_fixture("faulttest", RANK_SCRIPT))


@pytest.fixture
def fault_job(_job: LaunchJob):
    """`fault_job(fault, *launch_args)` runs the rank script through the launcher; returns (result, end time)."""

    def run(fault: str, *launch_args: str, timeout: float):
        return _job.run(*launch_args, env={"FAULT": fault}, timeout=timeout)

    run.marker, run.script = _job.marker, _job.script
    return run


def _fault_time(stdout: str) -> float:
    m = re.search(r"FAULT_AT (\d+\.\d+)", stdout)
    assert m, f"rank 1 never reached the fault; stdout:\n{stdout[-3000:]}"
    return float(m.group(1))


@pytest.mark.timeout(180)
def test_sigkilled_rank_is_named_with_its_signal(fault_job):
    res, end = fault_job("sigkill", timeout=150)
    after_fault = end - _fault_time(res.stdout)
    print(f"SIGKILL: launcher exited {after_fault:.1f} s after the kill")

    assert res.returncode == 1, res.stderr
    assert after_fault <= 60, f"{after_fault:.1f} s from the kill to the launcher's exit"
    assert "rank 0 step 2 done" in res.stdout  # the kill came mid-run, after step 2
    summary = [line for line in res.stderr.splitlines() if line.startswith("launch: job FAILED")]
    assert summary == [
        f"launch: job FAILED: rank 1 (local rank 1 on {socket.gethostname()}) was killed by signal SIGKILL (9)"
    ], res.stderr


@pytest.mark.timeout(180)
def test_hung_rank_is_named_with_host_and_stack(fault_job):
    hang_timeout = 10
    res, end = fault_job("hang", "--hang-timeout", str(hang_timeout), timeout=150)
    after_fault = end - _fault_time(res.stdout)
    print(f"hang: launcher exited {after_fault:.1f} s after rank 1 stopped (hang timeout {hang_timeout} s)")

    assert res.returncode == 3, res.stderr
    assert after_fault <= hang_timeout + 30, f"{after_fault:.1f} s from the hang to the launcher's exit"
    lines = res.stderr.splitlines()
    summary = [line for line in lines if line.startswith("launch: job HUNG")]
    assert len(summary) == 1, res.stderr
    assert re.fullmatch(
        rf"launch: job HUNG: rank 1 \(host {re.escape(socket.gethostname())}, pid \d+\) made no progress for "
        r"\d+\.\d s \(last heartbeat: step\) -- stopping the job",
        summary[0],
    ), summary[0]
    idle = float(re.search(r"for (\d+\.\d) s", summary[0]).group(1))
    assert hang_timeout <= idle <= hang_timeout + 10
    stack = "\n".join(line for line in lines if line.startswith("  [rank1] "))
    sleep_line = RANK_SCRIPT.splitlines().index("    time.sleep(3600)  # the line the hang report must show") + 1
    assert f'File "{fault_job.script}", line {sleep_line} in hang_forever' in stack, res.stderr
    assert "launch.worker" not in stack and "runpy" not in stack  # trampoline frames are left out
