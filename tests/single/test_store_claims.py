"""Job-wide claims through a store (compile_core/reuse/store_claims.py) and shipped compiles (inductor/artifacts.py),
with ranks played by threads sharing one in-process store, each with its own cache dir (its "node")."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed as dist

from compile_core.reuse.store_claims import StoreClaims
from inductor import artifacts

LIB = "ab/c" + "x" * 51 + ".main.so"  # where Inductor would put a kernel library


def claims(store, rank: int, directory, **kw) -> StoreClaims:
    kw = {"timeout_s": 20.0, "dead_after_s": 10.0, "poll_s": 0.01, **kw}
    return StoreClaims(store, rank=rank, directory=str(directory), **kw)


def waiting_in_thread(c: StoreClaims, key: str):
    out: dict = {}

    def run():
        out["claim"], out["wait"] = c.wait_claim(key, on_wait=lambda h: out.setdefault("announced", h))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_the_leader_ships_its_compile_and_a_rank_on_another_node_installs_it(tmp_path):
    store = dist.HashStore()
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    leader, other = claims(store, 0, node0), claims(store, 1, node1)
    claim = leader.try_claim("k1")
    assert claim is not None and other.try_claim("k1") is None  # one rank of the job holds it
    t, out = waiting_in_thread(other, "k1")
    with claim.capturing():  # "compiling": Inductor builds a kernel library in the leader's cache dir
        (node0 / "ab").mkdir()
        (node0 / LIB).write_bytes(b"\x7fELF kernel")
        time.sleep(0.3)
    claim.done({"pair": {"forward": 3}})
    claim.release()
    t.join(10)
    wait = out["wait"]
    assert out["claim"] is None and wait.outcome == "done", wait
    assert out["announced"].who == "rank 0" and wait.leader_rank == 0
    assert wait.installed_bytes > 0 and wait.meta == {"pair": {"forward": 3}}
    assert (node1 / LIB).read_bytes() == b"\x7fELF kernel"  # the library came along: no C++ build there


def test_a_failed_leader_is_taken_over_by_one_waiter(tmp_path):
    store = dist.HashStore()
    leader = claims(store, 0, tmp_path / "a")
    claim = leader.try_claim("k2")
    t, out = waiting_in_thread(claims(store, 1, tmp_path / "b"), "k2")
    time.sleep(0.2)
    claim.failed("RuntimeError: boom")
    claim.release()
    t.join(10)
    assert out["claim"] is not None, out  # rank 1 holds the claim now and compiles
    assert out["wait"].outcome == "failed: RuntimeError: boom" and out["claim"].previous.who == "rank 0"
    out["claim"].release()


def test_a_silent_leader_is_declared_dead_within_the_bound_and_named(tmp_path):
    store = dist.HashStore()
    leader = claims(store, 0, tmp_path / "a")
    claim = leader.try_claim("k3")
    leader._liveness.release()  # the leader's process stops beating (dead or hung), its claim stays
    start = time.monotonic()
    got, wait = claims(store, 1, tmp_path / "b", dead_after_s=0.5).wait_claim("k3")
    assert got is not None and wait.outcome == "died" and wait.holder.who == "rank 0"
    assert 0.5 <= time.monotonic() - start < 5
    got.release()
    del claim


def test_a_live_leader_is_waited_for_at_most_the_timeout(tmp_path):
    store = dist.HashStore()
    leader = claims(store, 0, tmp_path / "a")
    claim = leader.try_claim("k4")
    got, wait = claims(store, 1, tmp_path / "b", timeout_s=0.6).wait_claim("k4")
    assert got is None and wait.outcome == "timed out" and 0.6 <= wait.seconds < 5 and wait.holder.who == "rank 0"
    claim.release()


def test_a_damaged_shipment_is_compiled_here_not_installed(tmp_path):
    store = dist.HashStore()
    claim = claims(store, 0, tmp_path / "a").try_claim("k5")
    claim.done()
    claim.release()
    store.set("ddp_compile/compile/k5/blob/0/0", b"DDPCA001 tampered")  # not what the hash says
    got, wait = claims(store, 1, tmp_path / "b").wait_claim("k5")
    assert got is None and "sha256" in wait.outcome
    assert wait.outcome.startswith("failed: its compile could not be installed here"), wait.outcome


def test_unpack_refuses_foreign_truncated_and_path_escaping_blobs(tmp_path):
    (tmp_path / "ab").mkdir()
    (tmp_path / LIB).write_bytes(b"lib")
    blob = artifacts.pack(artifacts.Capture(cache=b"mega", libraries=[LIB]), str(tmp_path), {"x": 1})
    un = artifacts.unpack(blob)
    assert (un.cache, un.libraries, un.meta) == (b"mega", {LIB: b"lib"}, {"x": 1})
    with pytest.raises(ValueError, match="not a shipped compile"):
        artifacts.unpack(b"PK\x03\x04" + blob[4:])
    with pytest.raises(ValueError, match="header accounts for"):
        artifacts.unpack(blob[:-1])
    evil = blob.replace(LIB.encode(), b"../../../../etc/x.so".ljust(len(LIB), b"_"))
    with pytest.raises(ValueError, match="not a kernel library path"):
        artifacts.unpack(evil)
    target = tmp_path / "other"
    os.makedirs(target)
    assert artifacts.install(artifacts.Unpacked(cache=b"", libraries={LIB: b"lib"}, meta={}), str(target)) == 1
    assert (target / LIB).read_bytes() == b"lib" and oct((target / LIB).stat().st_mode & 0o777) == "0o600"
