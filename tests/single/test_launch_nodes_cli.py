"""Launcher options for jobs past one node, checked without starting ranks: several nodes on this host each
get their own Inductor cache dir, `--max-restarts` reaches torchrun with a fresh rendezvous store per
attempt, `--rdzv-endpoint` makes the command one host's node of a job, and slurm/kubernetes requests."""

from __future__ import annotations

import importlib.util
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torchx.specs as specs

from launch import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def role_of(argv: list[str]):
    cfg = cli.parse_args(argv)
    return cfg, cli.build_app(cfg, "run").roles[0]


def test_two_nodes_on_one_host_each_get_their_own_private_cache_dir(script, tmp_path):
    cfg, role = role_of(["--nnodes", "2", "--nproc-per-node", "1", "--inductor-cache-dir", str(tmp_path / "c"), script])
    assert role.num_replicas == 2 and cfg.node_cache_dirs
    dirs = []
    for replica in (0, 1):  # what torchx's local scheduler runs for each replica, macros filled in
        values = specs.macros.Values(img_root="", app_id="app", replica_id=str(replica), rank0_env="X")
        command = values.apply(role).args[1].partition(" && exec ")[0]
        res = subprocess.run(
            ["bash", "-c", command + ' && echo "$TORCHINDUCTOR_CACHE_DIR"'], capture_output=True, text=True, timeout=30
        )
        assert res.returncode == 0, res.stderr
        dirs.append(res.stdout.strip())
    assert dirs == [f"{tmp_path}/c/node0", f"{tmp_path}/c/node1"]
    assert all(stat.S_IMODE(Path(d).stat().st_mode) == 0o700 for d in dirs)
    _, one_node = role_of(["--nproc-per-node", "2", "--inductor-cache-dir", str(tmp_path / "c"), script])
    assert "node${replica_id}" not in one_node.args[1]  # one node: the ranks share the node's dir, as before


def test_max_restarts_reach_torchrun_with_a_fresh_store_per_attempt(script):
    _, role = role_of(["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "3", script])
    torchrun = role.args[1].partition(" && exec ")[2]
    assert torchrun.startswith("torchrun --max-restarts 3 --rdzv_backend c10d ")
    assert role.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # pytorch issue 135712
    _, plain = role_of(["--nnodes", "2", "--nproc-per-node", "1", script])
    assert "--max-restarts" not in plain.args[1] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plain.env


def test_rdzv_endpoint_makes_the_command_one_hosts_node_of_the_job(script):
    cfg, role = role_of(["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-endpoint", "node0.example:29400", script])
    torchrun = role.args[1].partition(" && exec ")[2]
    assert role.num_replicas == 1 and not cfg.node_cache_dirs
    assert (
        " --rdzv_endpoint node0.example:29400 --rdzv_id ddp_compile_node0_example_29400 --nnodes 2 "
        "--nproc_per_node 4 " in torchrun
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
        (["--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0': expected HOST:PORT"),
        (["--rdzv-id", "job7"], "only with --rdzv-endpoint"),
    ],
)
def test_bad_multi_node_input_is_one_line_and_exit_code_2(script, capsys, argv, words):
    assert cli.main([*argv, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def _dryrun(scheduler: str, *extra: str, cfg: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torchx.cli.main",
        "run",
        *extra,
        "--dryrun",
        "-s",
        scheduler,
        *cfg,
        "launch/components.py:trainer",
        "--script",
        "examples/train_gpt.py",
        "-j",
        "2x1",
        "--max_restarts",
        "2",
        "--env",
        "PATH=/opt/venv/bin:/usr/bin:/bin",
        "--",
        "--checkpoint-dir",
        "/shared/ckpt",
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_slurm_dry_run_is_two_nodes_with_restarts():
    res = _dryrun("slurm")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("#SBATCH --job-name=train_gpt-") == 2  # one hetjob group per node
    script = res.stdout.partition("# SBATCH_SCRIPT")[2]
    runs = [line for line in script.splitlines() if "exec torchrun" in line]
    assert len(runs) == 2, runs
    assert all("torchrun --max-restarts 2 " in r and "--nnodes 2 --nproc_per_node 1" in r for r in runs), runs
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r for r in runs), runs


@pytest.mark.skipif(
    importlib.util.find_spec("kubernetes") is None,
    reason="the kubernetes Python client (torchx's kubernetes scheduler needs it) is not installed",
)
def test_kubernetes_dry_run_is_two_tasks_with_restarts():
    res = _dryrun("kubernetes", "--workspace", "", cfg=("-cfg", "queue=default"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("torchrun --max-restarts 2 --rdzv_backend c10d") == 2
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in res.stdout
