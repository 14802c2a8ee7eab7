"""Compile claims between processes (compile_core/reuse/claims.py): no compiler, plain processes and files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from compile_core.reuse.claims import CompileClaims

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


HOLDER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("claims", sys.argv[1])
claims = sys.modules["claims"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(claims)
directory, how, seconds = sys.argv[2], sys.argv[3], float(sys.argv[4])
claim = claims.CompileClaims(directory, me="rank 0", timeout_s=60).try_claim("k1")
assert claim is not None
print("claimed", flush=True)
time.sleep(seconds)
if how == "die":
    os._exit(1)  # the kernel drops the flock; the state still says "compiling"
claim.failed("RuntimeError: boom") if how == "fail" else claim.done()
claim.release()
"""


def _start_holder(tmp_path, how: str, seconds: float) -> subprocess.Popen:
    # A bare interpreter loading only claims.py (no torch): it claims within a fraction of a second.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            str(REPO / "compile_core" / "reuse" / "claims.py"),
            str(tmp_path),
            how,
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "claimed", "the holder never claimed"
    return proc


@pytest.mark.parametrize("how,outcome", [("done", "done"), ("fail", "failed: RuntimeError: boom"), ("die", "died")])
def test_a_waiter_learns_how_the_holder_ended(tmp_path, how, outcome):
    proc = _start_holder(tmp_path, how, 1.0)
    try:
        claims = CompileClaims(str(tmp_path), me="rank 1", timeout_s=30)
        assert claims.try_claim("k1") is None  # held: the caller moves on to other work first
        seen = []
        claim, wait = claims.wait_claim("k1", on_wait=seen.append)
        assert claim is not None and wait.outcome == outcome
        assert seen and seen[0].who == "rank 0" and seen[0].pid == proc.pid
        assert wait.holder.describe() == f"rank 0 (pid {proc.pid})"
        assert 0.2 < wait.seconds < 20
        claim.done()
        claim.release()
        assert claims.holder("k1").state == "done" and claims.holder("k1").who == "rank 1"
    finally:
        proc.wait(10)


def test_a_hung_holder_is_given_up_on_after_the_timeout(tmp_path):
    proc = _start_holder(tmp_path, "done", 30.0)
    try:
        claims = CompileClaims(str(tmp_path), me="rank 1", timeout_s=1.0)
        start = time.monotonic()
        claim, wait = claims.wait_claim("k1")
        assert claim is None and wait.outcome == "timed out"
        assert 1.0 <= wait.seconds < 5 and time.monotonic() - start < 6
        assert wait.holder is not None and wait.holder.state == "compiling"
    finally:
        proc.kill()
        proc.wait(10)


def test_claims_reject_bad_keys_and_timeouts(tmp_path):
    with pytest.raises(ValueError, match="timeout_s"):
        CompileClaims(str(tmp_path), me="r", timeout_s=0)
    with pytest.raises(ValueError, match="claim key"):
        CompileClaims(str(tmp_path), me="r", timeout_s=1).try_claim("../x")
