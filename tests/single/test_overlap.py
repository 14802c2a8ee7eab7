"""Pure tests of the overlap math, the timeline data and the alignment check (no process group)."""

from __future__ import annotations

import json

import pytest

from ddp.overlap import (
    BucketRecord,
    RecorderConfig,
    StepTimeline,
    check_alignment,
    covered_length,
    interval_union,
    overlap_stats,
    plot_timeline,
)

# -- interval math --------------------------------------------------------------------------------------


def test_interval_union_merges_overlapping_and_touching_intervals():
    assert interval_union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_interval_union_rejects_reversed_interval():
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        interval_union([(2, 1)])


def test_covered_length_clips_to_window():
    assert covered_length([(0, 4), (6, 10)], (2, 8)) == pytest.approx(4.0)


def test_fully_hidden_communication_is_100_percent():
    stats = overlap_stats(compute=(0.0, 10.0), comm=[(1.0, 3.0), (4.0, 6.0)])
    assert stats.fraction == pytest.approx(1.0)
    assert stats.exposed_s == pytest.approx(0.0)
    assert stats.backward_s == pytest.approx(10.0)


def test_communication_after_backward_is_exposed():
    # 2 s inside the window, 3 s after it
    stats = overlap_stats(compute=(0.0, 10.0), comm=[(8.0, 13.0)])
    assert stats.comm_s == pytest.approx(5.0)
    assert stats.hidden_s == pytest.approx(2.0)
    assert stats.exposed_s == pytest.approx(3.0)
    assert stats.percent == pytest.approx(40.0)


def test_queued_buckets_are_not_double_counted():
    # bucket 1 waits behind bucket 0: the intervals overlap, wall time with comm in flight is 4 s, not 7 s
    stats = overlap_stats(compute=(0.0, 2.0), comm=[(1.0, 4.0), (1.0, 5.0)])
    assert stats.comm_s == pytest.approx(4.0)
    assert stats.hidden_s == pytest.approx(1.0)
    assert stats.fraction == pytest.approx(0.25)


def test_no_communication_gives_no_fraction():
    stats = overlap_stats(compute=(0.0, 1.0), comm=[])
    assert stats.fraction is None and stats.percent is None
    assert json.dumps(stats.to_dict())  # stays JSON-ready (no NaN)


def test_reversed_compute_window_is_a_value_error():
    with pytest.raises(ValueError, match="compute window"):
        overlap_stats(compute=(2.0, 1.0), comm=[])


# -- timeline -------------------------------------------------------------------------------------------


def _timeline() -> StepTimeline:
    buckets = (
        BucketRecord(step=3, index=0, params=("head.weight",), nbytes=4000, ready_s=10.2, done_s=10.5),
        BucketRecord(step=3, index=1, params=("fc.weight", "fc.bias"), nbytes=2000, ready_s=10.6, done_s=11.0),
    )
    return StepTimeline(step=3, backward_start_s=10.0, backward_end_s=10.6, start_marked=True, buckets=buckets)


def test_step_timeline_overlap_uses_last_ready_as_backward_end():
    stats = _timeline().overlap()
    # comm union: [10.2, 10.5] + [10.6, 11.0] = 0.7 s; hidden: 0.3 s (the last bucket is always exposed)
    assert stats.comm_s == pytest.approx(0.7)
    assert stats.hidden_s == pytest.approx(0.3)
    assert stats.exposed_s == pytest.approx(0.4)


def test_step_timeline_dict_is_relative_to_backward_start_and_json_ready():
    data = _timeline().to_dict()
    json.dumps(data)
    assert data["backward_ms"] == [0.0, pytest.approx(600.0)]
    assert data["buckets"][1]["params"] == ["fc.weight", "fc.bias"]
    assert data["buckets"][0]["ready_ms"] == pytest.approx(200.0)
    assert _timeline().bucket_names() == [["head.weight"], ["fc.weight", "fc.bias"]]


def test_plot_timeline_writes_png(tmp_path):
    out = plot_timeline(_timeline(), tmp_path / "sub" / "timeline.png", title="unit")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recorder_config_is_validated():
    with pytest.raises(ValueError, match="keep_steps=0"):
        RecorderConfig(keep_steps=0)
    with pytest.raises(TypeError):
        RecorderConfig(64)  # keyword-only


# -- alignment ------------------------------------------------------------------------------------------

PLANNED = [["head.weight"], ["b1.w", "b1.b"], ["b0.w", "b0.b"], ["tok.weight"]]


def test_identical_groups_are_aligned():
    result = check_alignment(PLANNED, PLANNED)
    assert result.ok
    assert [b.piece for b in result.buckets] == [0, 1, 2, 3]
    assert "4/4" in str(result) and "WARNING" not in str(result)


def test_order_inside_a_bucket_does_not_matter():
    observed = [["head.weight"], ["b1.b", "b1.w"], ["b0.b", "b0.w"], ["tok.weight"]]
    assert check_alignment(PLANNED, observed).ok


def test_coarser_buckets_on_piece_boundaries_are_aligned_and_extra_splits_are_noted():
    observed = [["head.weight", "b1.w", "b1.b"], ["b0.w", "b0.b", "tok.weight"]]
    result = check_alignment(PLANNED, observed)
    assert result.ok
    assert result.unused_piece_boundaries == (0, 2)
    assert "note: planned pieces [0, 2]" in str(result)


def test_bucket_ending_inside_a_piece_is_reported_with_names():
    observed = [["head.weight", "b1.w"], ["b1.b", "b0.w", "b0.b"], ["tok.weight"]]
    result = check_alignment(PLANNED, observed)
    assert not result.ok
    assert [b.aligned for b in result.buckets] == [False, True, True]
    bad = result.mismatched[0]
    assert bad.index == 0 and bad.piece == 1
    assert bad.split_before == ("b1.w",) and bad.split_after == ("b1.b",)
    assert result.mismatched_params() == ["b1.w", "b1.b"]
    text = str(result)
    assert text.count("WARNING") == 1
    assert "bucket 0 ends inside planned piece 1" in text and "b1.w" in text and "b1.b" in text


def test_one_warning_line_per_mismatched_bucket():
    observed = [["head.weight", "b1.w"], ["b1.b", "b0.w"], ["b0.b", "tok.weight"]]
    result = check_alignment(PLANNED, observed)
    assert [b.aligned for b in result.buckets] == [False, False, True]
    assert str(result).count("WARNING") == 2


def test_params_on_one_side_only_are_reported_separately():
    observed = [["head.weight"], ["b1.w", "b1.b"], ["b0.w", "b0.b", "extra.bias"]]
    result = check_alignment(PLANNED, observed)
    assert not result.ok
    assert all(b.aligned for b in result.buckets)  # tok.weight / extra.bias don't poison the boundaries
    assert result.only_planned == ("tok.weight",)
    assert result.only_observed == ("extra.bias",)
    assert "never all-reduced by DDP: [tok.weight]" in str(result)
    assert "missing from the plan: [extra.bias]" in str(result)
    json.dumps(result.to_dict())


@pytest.mark.parametrize(
    ("planned", "observed", "match"),
    [
        ("head.weight", PLANNED, "list of lists"),
        (PLANNED, [["a", 1]], "list of lists"),
        ([["a"], ["a"]], [["a"]], r"lists \['a'\] more than once"),
    ],
)
def test_bad_inputs_are_value_errors(planned, observed, match):
    with pytest.raises(ValueError, match=match):
        check_alignment(planned, observed)
