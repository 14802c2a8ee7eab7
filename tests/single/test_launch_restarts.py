"""The launcher's restart report (launch/restarts.py) from a local run's log tree, as torchrun and
launch.worker leave it: which rank died and why, on which node, and the step the job resumed from."""

from __future__ import annotations

import json
import time

from launch.restarts import find_restarts, report_restarts


def rank_file(
    root,
    node_dir: str,
    attempt: int,
    rank: int,
    pid: int,
    t: float,
    *,
    node: int | None = None,
    local: int = 0,
    **extra,
) -> None:
    d = root / "torchelastic" / "job" / node_dir / f"attempt_{attempt}" / str(local)
    d.mkdir(parents=True, exist_ok=True)
    info = {
        "rank": rank,
        "local_rank": local,
        "group_rank": rank if node is None else node,
        "host": "vm",
        "pid": pid,
        "time": t,
    }
    (d / f"launch_rank.{pid}.json").write_text(json.dumps(info))
    for name, value in extra.items():
        (d / f"{name}.{pid}.json").write_text(json.dumps({**value, "pid": pid}))


def node_log(root, node: int, text: str) -> None:
    d = root / "job" / str(node)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stderr.log").write_text(text)


def glog(t: float, pid: int, code: int) -> str:
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(t)) + ".250000"
    return (
        f"E{stamp} 4242 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {code}) "
        f"local_rank: 0 (pid: {pid}) of binary: /venv/bin/python3.11\n"
    )


def test_a_sigkilled_rank_on_node_1_is_named_with_the_step_the_job_resumed_from(tmp_path, capsys):
    t0 = time.time() - 100
    # attempt 0: ranks 0 (node 0) and 1 (node 1); rank 1 is SIGKILLed, rank 0 then fails on the broken pipe
    rank_file(tmp_path, "n0", 0, 0, 100, t0)
    rank_file(tmp_path, "n1", 0, 1, 101, t0 + 0.1)
    exc = {"rank": 0, "local_rank": 0, "host": "vm", "time": t0 + 30.4, "exception": "RuntimeError: Connection reset"}
    (tmp_path / "torchelastic/job/n0/attempt_0/0/launch_failure.100.json").write_text(json.dumps({**exc, "pid": 100}))
    node_log(tmp_path, 1, "noise\n" + glog(t0 + 30, 101, -9))
    node_log(tmp_path, 0, glog(t0 + 31, 100, 1))
    # attempt 1 (node 0's agent restarted for the membership change: same attempt dir, new pid)
    rank_file(tmp_path, "n0", 0, 0, 200, t0 + 40, launch_resume={"step": 6})
    rank_file(tmp_path, "n1", 1, 1, 201, t0 + 40.1, launch_resume={"step": 6})

    restarts, last = find_restarts(str(tmp_path))
    assert last == {200, 201} and len(restarts) == 1
    r = restarts[0]
    assert (r.cause["rank"], r.cause["kind"], r.cause["exitcode"], r.node, r.resumed_step) == (1, "signal", -9, 1, 6)
    report_restarts(restarts, 3)
    assert capsys.readouterr().err.splitlines() == [
        "launch: restart 1 of 3: rank 1 (local rank 0 on node 1, host vm) was killed by signal SIGKILL (9); "
        "resumed from step 6"
    ]


def test_no_restart_and_a_script_that_never_says_where_it_resumed(tmp_path, capsys):
    t0 = time.time() - 100
    rank_file(tmp_path, "n0", 0, 0, 100, t0, node=0)
    rank_file(tmp_path, "n0", 0, 1, 101, t0, node=0, local=1)
    assert find_restarts(str(tmp_path)) == ([], {100, 101})
    rank_file(tmp_path, "n0", 1, 0, 300, t0 + 50, node=0)
    rank_file(tmp_path, "n0", 1, 1, 301, t0 + 50, node=0, local=1)
    node_log(tmp_path, 0, glog(t0 + 20, 101, 3).replace("local_rank: 0", "local_rank: 1"))
    restarts, _ = find_restarts(str(tmp_path))
    report_restarts(restarts, 1)
    assert capsys.readouterr().err.strip() == (
        "launch: restart 1 of 1: rank 1 (local rank 1 on node 0, host vm) exited with code 3; "
        "the script reported no resume step (launch.restarts.record_resumed)"
    )
