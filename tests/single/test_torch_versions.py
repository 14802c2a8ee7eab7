"""The supported torch range (2.11 to 2.14): `python -m compile_core.doctor`, and modes refused at compile time
on a torch that lacks what they need (simulated: every supported version has everything)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.procs import SESSION_ENV

ROOT = Path(__file__).resolve().parents[2]


def _doctor(*args: str) -> subprocess.CompletedProcess:
    # The doctor's own pytest run is a session of its own: with this session's marker it would take this
    # session's processes (the doctor, this pytest) for its leftovers and kill them (tests/procs.py).
    env = {k: v for k, v in os.environ.items() if k != SESSION_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "compile_core.doctor", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_the_doctor_names_the_versions_every_mode_and_runs_a_canary():
    from compile_core.config import DDP_MODES

    done = _doctor("-k", "test_tree_leaves_flattens_outputs")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"torch        {torch.__version__}" in out, out
    for what in ("triton", "NCCL", "CUDA build", "cpu:"):
        assert what in out, f"{what!r} missing:\n{out}"
    for mode in DDP_MODES:
        assert f"[ok] ddp={mode!r}" in out, f"ddp={mode!r} missing:\n{out}"
    assert "[ok] aot.requires_grad_guards" in out and "[ok] inductor.ordering" in out, out
    assert "1 passed" in out and out.rstrip().endswith("== OK"), out


@pytest.mark.timeout(300)
def test_the_doctor_exits_non_zero_when_a_canary_fails(tmp_path):
    canaries = tmp_path / "tests" / "single" / "test_broken.py"
    canaries.parent.mkdir(parents=True)
    canaries.write_text("def test_torch_changed():\n    assert False, 'a private name moved'\n")
    done = _doctor("--canaries", str(canaries))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED" in done.stdout and "1 failed" in done.stdout and "CANARIES FAILED" in done.stdout, done.stdout


def test_a_mode_this_torch_cannot_run_is_refused_at_compile_time_naming_the_version_and_the_fix(monkeypatch):
    from compile_core.config import CompileConfig
    from ddp import torch_ddp

    table = dict(torch_ddp.capabilities())
    table["ddp.functional_collectives"] = (False, "no _c10d_functional.all_reduce/wait_tensor ops (simulated)")
    monkeypatch.setattr(torch_ddp, "capabilities", lambda: table)
    with pytest.raises(ValueError) as refused:
        CompileConfig(ddp="in_graph", backend="aot_eager")
    message = str(refused.value)
    assert f"torch {torch.__version__}" in message and "(simulated)" in message, message
    assert "pip install torch==2.13.0" in message and "ddp='split'" in message, message
    CompileConfig(ddp="split", backend="aot_eager")  # what does not need it still works
