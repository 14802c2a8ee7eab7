"""Rank agreement (ddp/agreement.py, Note [Rank agreement]) on 2 gloo ranks, without a model: how long a rank
waits for another that is compiling, and that it stops waiting for one that is not."""

from __future__ import annotations

import time

import pytest

from tests.ranks import run_ranks

pytestmark = pytest.mark.multi_gpu


def _late_peer(rank: int, world_size: int, compiling: float, silent: float) -> dict:
    """Rank 1 reaches the exchange after `compiling` s announced as a compile and `silent` s not announced;
    rank 0 waits with a 1 s timeout, on up to 8 s while rank 1 compiles. Returns what rank 0 saw."""
    import torch.distributed as dist

    from ddp.agreement import AgreementTimeouts, RankAgreement, RankTimeoutError

    agreement = RankAgreement(
        dist.group.WORLD, prefix="test", timeouts=AgreementTimeouts(first_timeout_s=8.0, timeout_s=1.0)
    )
    agreement.exchange("start", rank)  # both ranks begin together
    if rank == 1:
        with agreement.busy():
            time.sleep(compiling)
        time.sleep(silent)
        agreement.post("value", "one")
        return {}
    start = time.perf_counter()
    try:
        values = agreement.collect(agreement.post("value", "zero"), timeout_s=1.0, busy_up_to_s=8.0)
    except RankTimeoutError as err:
        return {"error": str(err), "seconds": time.perf_counter() - start}
    return {"values": values, "seconds": time.perf_counter() - start}


@pytest.mark.timeout(60)
def test_a_rank_waits_past_the_timeout_for_a_rank_that_announces_a_compile():
    seen = run_ranks(_late_peer, 3.5, 0.0, world_size=2, timeout=40)[0]
    assert seen.get("values") == {0: "zero", 1: "one"}, seen
    assert 3.0 < seen["seconds"] < 8.0, seen


@pytest.mark.timeout(60)
def test_a_rank_stops_waiting_after_the_timeout_for_a_rank_that_announces_no_compile():
    seen = run_ranks(_late_peer, 0.0, 6.0, world_size=2, timeout=40)[0]
    assert "rank(s) [1] did not reach 'value'" in seen.get("error", ""), seen
    assert "started or ended no compile" in seen["error"], seen
    assert seen["seconds"] < 4.0, seen  # one slice after the peer's announced compile ended, not 8 s


@pytest.mark.timeout(60)
def test_a_rank_stops_waiting_at_the_long_timeout_for_a_rank_that_compiles_on():
    seen = run_ranks(_late_peer, 12.0, 0.0, world_size=2, timeout=40)[0]
    assert "still compiling" in seen.get("error", ""), seen
    assert 7.5 < seen["seconds"] < 10.0, seen
