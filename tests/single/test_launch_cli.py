"""Unit checks of the launcher's pieces that need no process group: argument parsing, GPU counting,
the node-side Inductor cache prelude, and the per-rank failure record."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launch import args as launch_args
from launch import cli
from launch.components import cache_prelude, trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cvd, expected", [("", 0), ("0", 1), ("0,1,3", 3), ("-1", 0), ("0,-1,2", 1)])
def test_visible_gpus_follows_cuda_visible_devices(monkeypatch, cvd, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)
    assert cli.visible_gpus() == expected


def test_auto_is_two_gloo_ranks_without_gpus(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_args, "visible_gpus", lambda: 0)
    script = tmp_path / "s.py"
    script.write_text("")
    cfg = cli.parse_args([str(script), "--lr", "1"])
    assert (cfg.nproc_per_node, cfg.dist_backend, cfg.nnodes, cfg.script_args) == (2, "gloo", "1", ("--lr", "1"))


def test_auto_is_one_nccl_rank_per_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(launch_args, "visible_gpus", lambda: 4)
    script = tmp_path / "s.py"
    script.write_text("")
    cfg = cli.parse_args(["--nproc-per-node", "auto", str(script)])
    assert (cfg.nproc_per_node, cfg.dist_backend) == (4, "nccl")


def test_elastic_j_is_split_into_nnodes_and_nproc(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    cfg = cli.parse_args(["-j", "1:4x8", "--scheduler", "slurm", str(script)])
    assert (cfg.nnodes, cfg.nproc_per_node, cfg.j, cfg.rdzv_port) == ("1:4", 8, "1:4x8", 29500)


def test_component_rejects_bad_arguments_with_the_fix():
    with pytest.raises(ValueError, match="exactly one"):
        trainer(script="a.py", m="a")
    with pytest.raises(ValueError, match="dist_backend='mpi'"):
        trainer(script="a.py", dist_backend="mpi")
    with pytest.raises(ValueError, match="Invalid format for -j"):
        trainer(script="a.py", j="2y")


def test_the_renamed_backend_variable_is_refused_wherever_it_is_set(monkeypatch, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    renamed = "DDP_COMPILE_BACKEND was renamed to DDP_COMPILE_DIST_BACKEND"
    with pytest.raises(launch_args.UsageError, match=renamed + ".*--env"):
        cli.parse_args(["--env", "DDP_COMPILE_BACKEND=gloo", str(script)])
    with pytest.raises(ValueError, match=renamed + ".*in env"):
        trainer(script="a.py", env={"DDP_COMPILE_BACKEND": "gloo"})
    monkeypatch.setenv("DDP_COMPILE_BACKEND", "gloo")
    with pytest.raises(launch_args.UsageError, match=renamed + ".*the environment.*--dist-backend"):
        cli.parse_args([str(script)])
    with pytest.raises(ValueError, match=renamed):
        trainer(script="a.py")
    assert cli.main([str(script)]) == launch_args.USAGE_EXIT  # one line, exit 2, nothing started
    monkeypatch.delenv("DDP_COMPILE_BACKEND")
    assert trainer(script="a.py").roles[0].env["DDP_COMPILE_DIST_BACKEND"] == "gloo"


def _prelude(cache: Path) -> subprocess.CompletedProcess:
    script = cache_prelude(str(cache)) + ' && echo "CACHE=$TORCHINDUCTOR_CACHE_DIR"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)


def test_prelude_creates_a_private_cache(tmp_path):
    cache = tmp_path / "a" / "cache"
    res = _prelude(cache)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"CACHE={cache}"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_prelude_refuses_a_symlinked_cache(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "cache"
    link.symlink_to(target)
    res = _prelude(link)
    assert res.returncode == 2
    assert "is a symlink or not owned by" in res.stderr


def test_prelude_empties_and_repairs_a_group_writable_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "sub").mkdir(parents=True)
    (cache / "sub" / "kernel.so").write_text("planted")
    cache.chmod(0o770)
    res = _prelude(cache)
    assert res.returncode == 0, res.stderr
    assert "was group/world-writable" in res.stderr
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and list(cache.iterdir()) == []


def _worker(tmp_path: Path, body: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "user_script.py"
    script.write_text(body)
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(error_file), RANK="3", LOCAL_RANK="1", GROUP_RANK="1")
    res = subprocess.run(
        [sys.executable, "-m", "launch.worker", "script", str(script), "--x", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return res, error_file.parent


def test_worker_records_rank_and_user_traceback(tmp_path):
    res, err_dir = _worker(tmp_path, "import sys\nraise KeyError(sys.argv[1:])\n")
    assert res.returncode == 1
    info = json.loads((err_dir / "launch_failure.json").read_text())
    assert (info["rank"], info["local_rank"], info["exception"]) == (3, 1, "KeyError: ['--x', '1']")
    assert info["traceback"].splitlines()[1].strip().startswith(f'File "{tmp_path}/user_script.py"')
    assert (err_dir / "error.json").exists()  # torchelastic's own record, for torchrun's summary
    assert cli.find_failures(str(tmp_path))[0]["rank"] == 3


def test_worker_treats_sys_exit_zero_as_success(tmp_path):
    res, err_dir = _worker(tmp_path, "import sys\nprint(sys.argv[0].endswith('user_script.py'))\nsys.exit(0)\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"
    assert not (err_dir / "launch_failure.json").exists()


def test_launcher_imports_neither_torch_nor_the_compile_stack(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    probe = (
        "import sys\n"
        "from launch import cli\n"
        f"cfg = cli.parse_args(['--dry-run', {str(script)!r}])\n"
        "cli.build_app(cfg, 'probe')\n"
        "heavy = {'torch', 'compile_core', 'ddp', 'aot', 'inductor'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_a_torchrun_command_line_parses_as_ours(monkeypatch, tmp_path):
    """`torchrun --standalone --nproc_per_node=2 ...` with `python -m launch` in its place: torchrun's spellings of
    the options we share (underscores, `--module`) and its single-node flag mean what they mean there."""
    monkeypatch.setattr(launch_args, "visible_gpus", lambda: 0)
    script = tmp_path / "s.py"
    script.write_text("")
    ours = cli.parse_args(["--nproc-per-node", "3", "--max-restarts", "1", "--log-dir", "L", str(script), "--x"])
    theirs = cli.parse_args(
        ["--standalone", "--nproc_per_node=3", "--max_restarts=1", "--log_dir", "L", str(script), "--x"]
    )
    same = ("nnodes", "nproc_per_node", "max_restarts", "log_dir", "script_args", "rdzv_endpoint", "target")
    assert [getattr(theirs, f) for f in same] == [getattr(ours, f) for f in same]
    assert cli.parse_args(["--module", "json.tool"]).module is True
    endpoint = cli.parse_args(["--nnodes", "2", "--rdzv_endpoint", "h:29400", "--rdzv_id", "job1", str(script)])
    assert (endpoint.rdzv_endpoint, endpoint.rdzv_id) == ("h:29400", "job1")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--master_addr=h", "--master_port=29500", "--node_rank=0"], "--master_addr is torchrun's.*--rdzv-endpoint"),
        (["--node-rank", "1"], "--node-rank is torchrun's.*--rdzv-endpoint MASTER_ADDR:MASTER_PORT"),
        (["--rdzv_backend=c10d"], "--rdzv_backend is torchrun's.*drop it"),
        (["--tee", "3"], "--tee is torchrun's.*--log-dir"),
        (["--no-python"], "--no-python is torchrun's.*-m"),
        (["--standalone", "--nnodes", "2"], "--standalone is a single node.*drop --nnodes"),
        (["--standalone", "--rdzv-endpoint", "h:1"], "--standalone is a single node"),
    ],
)
def test_torchrun_options_we_lack_are_refused_by_name_with_the_fix(tmp_path, argv, match):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(launch_args.UsageError, match=match):
        cli.parse_args([*argv, str(script)])
