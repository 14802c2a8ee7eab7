"""The benchmark's bracket (benchmarks/bracket.py): the floor and comm_only modes bound every other mode's step
time, giving each its overhead over the floor and the share of communication it hid, clamped with the side
named; also what is reported when part of the bracket is missing, and the bracket's table cells and line."""

from __future__ import annotations

import pytest


def _timed(ms: float, **extra) -> dict:
    return {"status": "ok", "step_ms": ms, **extra}


def test_comm_hidden_is_the_share_of_comm_only_the_mode_did_not_add_and_is_clamped_with_its_side():
    from benchmarks.bracket import hidden_share

    # floor 100 ms, comm_only 40 ms: 110 ms hid 3/4 of the communication, 140 ms none, 100 ms all
    assert hidden_share(110.0, 100.0, 40.0) == (pytest.approx(0.75), pytest.approx(0.75), None)
    assert hidden_share(140.0, 100.0, 40.0)[0] == pytest.approx(0.0)
    assert hidden_share(100.0, 100.0, 40.0)[0] == pytest.approx(1.0)
    # slower than floor + comm_only: clamped to 0, the raw value kept and the side named
    assert hidden_share(160.0, 100.0, 40.0) == (0.0, pytest.approx(-0.5), "below")
    # faster than the floor: clamped to 1
    assert hidden_share(90.0, 100.0, 40.0) == (1.0, pytest.approx(1.25), "above")


def test_bracket_gives_every_other_finished_mode_its_overhead_and_comm_hidden():
    from benchmarks.bracket import bracket

    modes = {
        "floor": _timed(200.0),
        "comm_only": _timed(50.0),
        "eager": _timed(240.0),
        "ours_step": _timed(210.0),
        "torch_savvy": _timed(300.0),
        "ours_in_graph": {"status": "failed", "error": "boom"},
    }
    b = bracket(modes)
    assert (b["floor_ms"], b["comm_only_ms"], b["upper_ms"], b["missing"]) == (200.0, 50.0, 250.0, [])
    assert set(b["modes"]) == {"eager", "ours_step", "torch_savvy"}  # not the bracket, not the failed mode
    eager = b["modes"]["eager"]
    assert eager["over_floor_ms"] == pytest.approx(40.0) and eager["over_floor_pct"] == pytest.approx(20.0)
    assert eager["comm_hidden"] == pytest.approx(0.2) and eager["clamped"] is None
    assert b["modes"]["ours_step"]["comm_hidden"] == pytest.approx(0.8)
    savvy = b["modes"]["torch_savvy"]
    assert (savvy["comm_hidden"], savvy["clamped"]) == (0.0, "below")
    assert savvy["comm_hidden_raw"] == pytest.approx(-1.0)


def test_bracket_without_comm_only_still_gives_overhead_and_says_what_is_missing():
    from benchmarks.bracket import (
        bracket,
        bracket_line,
        comm_hidden_cell,
        over_floor_cell,
    )

    b = bracket(
        {"floor": _timed(100.0), "comm_only": {"status": "failed", "error": "timed out"}, "eager": _timed(130.0)}
    )
    assert b["upper_ms"] is None and b["missing"] == ["comm_only failed: timed out"]
    assert b["modes"]["eager"] == {"over_floor_ms": pytest.approx(30.0), "over_floor_pct": pytest.approx(30.0)}
    assert over_floor_cell(b, "eager") == "+30.0 (+30%)" and comm_hidden_cell(b, "eager") == "-"
    assert "comm hidden needs both" in bracket_line(b) and "comm_only failed" in bracket_line(b)
    none = bracket({"eager": _timed(130.0)})
    assert none["modes"] == {} and "floor not run (add it to --modes)" in bracket_line(none)
    assert over_floor_cell(none, "eager") == "-"


def test_bracket_cells_and_line_name_the_clamped_side():
    from benchmarks.bracket import (
        bracket,
        bracket_line,
        comm_hidden_cell,
        over_floor_cell,
    )

    b = bracket(
        {
            "floor": _timed(100.0),
            "comm_only": _timed(20.0),
            "slow": _timed(150.0),
            "fast": _timed(95.0),
            "mid": _timed(110.0),
        }
    )
    assert comm_hidden_cell(b, "mid") == "50"
    assert comm_hidden_cell(b, "slow") == "0 (raw -150: slower than floor + comm_only)"
    assert comm_hidden_cell(b, "fast") == "100 (raw 125: faster than floor)"
    assert over_floor_cell(b, "fast") == "-5.0 (-5%)"
    assert over_floor_cell(b, "floor") == comm_hidden_cell(b, "comm_only") == "bracket"
    line = bracket_line(b)
    assert "floor 100.0 ms" in line and "floor + comm_only 120.0 ms" in line and "clamped to 0-100 %" in line
