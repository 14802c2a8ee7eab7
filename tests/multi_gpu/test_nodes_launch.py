"""Two nodes on this machine through `python -m launch --nnodes 2 --nproc-per-node 1` (torchrun's c10d
rendezvous on localhost, each node its own Inductor cache dir and LOCAL_* environment): the demo survives a
SIGKILLed rank with `--max-restarts` and ends with the parameters of an uninterrupted run; a hang is named
by global rank and node; the same command, run once per "host" with `--rdzv-endpoint`, forms one job."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from launch.net import free_port
from tests.multi_gpu.launch_jobs import REPO, LaunchJob
from tests.procs import kill_marked

pytestmark = pytest.mark.multi_gpu

# The demo, with rank KILL_RANK SIGKILLing itself when it fetches the batch of step index KILL_STEP, in the
# job's first attempt only; every rank says what torchrun and the launcher gave it.
DEMO_WITH_KILL = textwrap.dedent(
    f"""
    import os, signal, sys
    sys.path.insert(0, {str(REPO)!r})
    import examples.train_gpt as demo

    print("ENV rank=%s local_rank=%s local_world=%s node=%s cache=%s" % tuple(os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHINDUCTOR_CACHE_DIR")), flush=True)
    kill_rank, kill_step = (int(v) for v in os.environ["KILL_AT"].split(":"))
    real = demo.synthetic_batch

    def batch(*args, step, rank, **kwargs):
        if (rank, step) == (kill_rank, kill_step) and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            print(f"KILLED rank {{rank}} at step index {{step}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, step=step, rank=rank, **kwargs)

    demo.synthetic_batch = batch
    demo.main()
    """
)
# Both modes end bit-identical to an uninterrupted run: `--mode compile` (compiled model, eager AdamW)
# and `--mode train_step` (compiled update: a resumed run compiles update 1 too, docs/launch.md, "Restarts").
TINY = [
    "--backend",
    "aot_eager",
    "--steps",
    "10",
    "--checkpoint-every",
    "3",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--vocab",
    "64",
    "--seq-len",
    "16",
    "--batch",
    "2",
    "--log-level",
    "WARNING",
]
TWO_NODES = ["--nnodes", "2", "--nproc-per-node", "1"]


@pytest.fixture
def job(tmp_path):
    jobs: list[LaunchJob] = []

    def make(prefix: str, script: str) -> LaunchJob:
        jobs.append(LaunchJob(tmp_path, prefix, script))
        return jobs[-1]

    yield make
    for j in jobs:
        j.kill()
    for j in jobs:
        j.assert_nothing_left()


def run_demo(j: LaunchJob, kill_at: str, mode: str):
    ckpt = j.workdir / "ckpt"
    res, _ = j.run(
        *TWO_NODES,
        "--max-restarts",
        "2",
        "--inductor-cache-dir",
        str(j.workdir / "cache"),
        env={"KILL_AT": kill_at},
        timeout=240,
        script_args=("--mode", mode, *TINY, "--checkpoint-dir", str(ckpt)),
    )
    final = ckpt / "step_00000010.pt"
    return res, torch.load(final, weights_only=True) if final.exists() else None


@pytest.mark.timeout(300)
def test_a_sigkilled_rank_on_node_1_is_survived_with_the_parameters_of_an_uninterrupted_run(job):
    # The demo's train_step mode: its model is compiled as in its compile mode (ddp="split"), and its update is
    # compiled too and resumed from the checkpoint's optimizer state; the compile mode would add nothing here.
    mode = "train_step"
    straight = job("nodes_straight", DEMO_WITH_KILL)
    killed = job("nodes_killed", DEMO_WITH_KILL)
    ref_res, ref = run_demo(straight, "9:99", mode)
    assert ref_res.returncode == 0, ref_res.stderr[-3000:]
    res, final = run_demo(killed, "1:5", mode)
    assert res.returncode == 0, res.stderr[-3000:]

    # Each node is a node of its own: LOCAL_RANK 0 on both, its own cache dir.
    envs = sorted(set(re.findall(r"ENV rank=(\d) local_rank=(\d) local_world=(\d) node=(\d) cache=(\S+)", res.stdout)))
    cache = killed.workdir / "cache"
    assert envs == [("0", "0", "1", "0", f"{cache}/node0"), ("1", "0", "1", "1", f"{cache}/node1")], envs
    # The kill came after the checkpoint of step 3 and before the one of step 6; the job resumed from 3.
    assert "KILLED rank 1 at step index 5" in res.stdout and "checkpoint: resuming from step 3" in res.stdout
    lines = [line for line in res.stderr.splitlines() if line.startswith("launch: ")]
    assert (
        f"launch: restart 1 of 2: rank 1 (local rank 0 on node 1, host {socket.gethostname()}) was killed by "
        "signal SIGKILL (9); resumed from step 3" in lines
    ), lines
    assert lines[-1] == "launch: job SUCCEEDED after 1 restart(s)", lines
    # Nothing lost: the same parameters and optimizer state as the run nobody killed, bit for bit.
    for name, value in ref["model"].items():
        assert torch.equal(final["model"][name], value), name
    for index, state in ref["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(final["optimizer"]["state"][index][key], value), (index, key)
    assert final["scheduler"] == ref["scheduler"] and final["step"] == ref["step"] == 10


HANG_SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch
    import torch.distributed as dist
    from launch import heartbeat

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    for step in range(1, 1000):
        if rank == 1 and step == 3:
            print(f"FAULT_AT {time.time():.3f}", flush=True)
            time.sleep(3600)
        heartbeat.beat()
        dist.all_reduce(t)
    """
)


@pytest.mark.timeout(180)
def test_a_hang_on_a_two_node_job_names_the_rank_and_its_node(job):
    j = job("nodes_hang", HANG_SCRIPT)
    res, _ = j.run(*TWO_NODES, "--hang-timeout", "8", timeout=150)
    assert res.returncode == 3, res.stderr[-3000:]
    summary = [line for line in res.stderr.splitlines() if line.startswith("launch: job HUNG")]
    assert len(summary) == 1 and re.fullmatch(
        rf"launch: job HUNG: rank 1 \(node 1, host {re.escape(socket.gethostname())}, pid \d+\) made no progress "
        r"for \d+\.\d s \(last heartbeat: step\) -- stopping the job",
        summary[0],
    ), res.stderr[-3000:]


HOST_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} node={os.environ['GROUP_RANK']} "
          f"sum={t.item():g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(180)
def test_the_same_command_on_each_host_forms_one_job_through_the_rendezvous_endpoint(job):
    j = job("nodes_hosts", HOST_SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    for h in (0, 1):
        Path(j.workdir / f"host{h}").mkdir()
    # Each "host" its own TMPDIR (its own default Inductor cache dir and scratch) and log dir: nothing shared
    # but the endpoint.
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "launch",
                *TWO_NODES,
                "--rdzv-endpoint",
                endpoint,
                "--log-dir",
                str(j.workdir / f"host{h}" / "logs"),
                str(j.script),
            ],
            cwd=REPO,
            env={**os.environ, "TMPDIR": str(j.workdir / f"host{h}")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for h in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        kill_marked(j.marker)
        pytest.fail("the two hosts' launchers did not finish within 120 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = sorted(m for out, _ in outs for m in re.findall(r"RESULT (rank=\d world=\d node=\d sum=\d+)", out))
    assert results == ["rank=0 world=2 node=0 sum=3", "rank=1 world=2 node=1 sum=3"], outs
