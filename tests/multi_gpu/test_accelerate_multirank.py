"""Hugging Face accelerate on 2 CPU ranks, started by `accelerate launch`: examples/accelerate_train.py
with the prepared DDP model compiled by `compile_core.integrations.accelerate.compile`, against the
same script without compile (`--no-compile`): same seed, same optimizer, rank-dependent data (the
prepared DataLoader shards it), 3 SGD steps.

`accelerate launch --cpu --num_processes 2` starts one process in accelerate 1.x (its multi-CPU path
wants mpirun), so the ranks come from `--multi_gpu` (torchrun) with ACCELERATE_USE_CPU=1, what
`--cpu` sets: two gloo ranks on CPU.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from launch.net import free_port
from tests.multi_gpu.script_jobs import REPO, assert_ok, run_script_job

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(420)]

pytest.importorskip("accelerate", reason='needs the [accelerate] extra: pip install -e ".[accelerate]"')
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors (installed with accelerate)")

STEPS = 3
RUNS = {"plain": ("--no-compile",), "split": ("--backend", "aot_eager", "--ddp-mode", "split")}


def accelerate_launch(*args: str) -> list[str]:
    """`accelerate launch ...` with this interpreter's accelerate (its console script when installed)."""
    script = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    head = [script] if script else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    return [*head, "launch", *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    results = {}
    for name, args in RUNS.items():
        cmd = accelerate_launch(
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            str(REPO / "examples" / "accelerate_train.py"),
            *args,
            "--steps",
            str(STEPS),
            "--out",
            str(out / name),
        )
        # HF_HOME: no accelerate config file of the machine's user is read.
        env = {"ACCELERATE_USE_CPU": "1", "HF_HOME": str(out / "hf_home")}
        results[name] = {
            "out": out / name,
            "log": assert_ok(run_script_job(cmd, prefix=f"accelerate_{name}", timeout=180, env=env)),
        }
    return results


def _params(run: dict, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run["out"] / f"params_rank{rank}.pt")


def test_accelerate_prepared_model_compiled_trains_like_accelerate_ddp(runs):
    for rank in (0, 1):
        ours, ref = _params(runs["split"], rank), _params(runs["plain"], rank)
        assert ours.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    for name, p in _params(runs["split"], 0).items():
        assert torch.equal(p, _params(runs["split"], 1)[name]), f"{name} differs between ranks"

    report = json.loads((runs["split"]["out"] / "report.json").read_text())
    assert (report["ddp_mode"], report["backend"]) == ("split", "aot_eager")
    assert report["graphs"][0]["pieces"] >= 3, report["graphs"]
    assert report["alignment"]["status"] == "aligned", report["alignment"]
    assert "compile report: backend=aot_eager ddp=split" in runs["split"]["log"]


def test_accelerate_save_model_keys_are_unchanged(runs):
    ours = safetensors_torch.load_file(runs["split"]["out"] / "model" / "model.safetensors")
    theirs = safetensors_torch.load_file(runs["plain"]["out"] / "model" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert not [k for k in ours if "_orig_mod" in k or k.startswith("module.")]
    for name, p in _params(runs["split"], 0).items():
        assert torch.equal(ours[name], p), name
