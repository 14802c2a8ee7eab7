"""The demo's checkpoints (examples/checkpoint.py): written whole or not at all; a torn or partial one is
reported and never loaded."""

from __future__ import annotations

import json

import pytest
import torch

from examples import checkpoint


def state(step: int) -> dict:
    return {"step": step, "data_step": step, "model": {"w": torch.full((4,), float(step))}}


def test_latest_is_the_newest_complete_one_and_older_ones_are_pruned(tmp_path):
    for step in (3, 6, 9):
        checkpoint.save(str(tmp_path), step, state(step), keep=2)
    found = checkpoint.latest(str(tmp_path))
    assert (found.step, found.skipped) == (9, ())
    assert torch.equal(checkpoint.load(found.path)["model"]["w"], torch.full((4,), 9.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000006.done",
        "step_00000006.pt",
        "step_00000009.done",
        "step_00000009.pt",
    ]


@pytest.mark.parametrize(
    "damage", ["truncated", "no marker", "marker for other bytes", "only a temp file", "garbage marker"]
)
def test_a_torn_checkpoint_is_skipped_with_a_reason_and_never_loaded(tmp_path, damage):
    checkpoint.save(str(tmp_path), 3, state(3))
    checkpoint.save(str(tmp_path), 6, state(6))
    pt, done = tmp_path / "step_00000006.pt", tmp_path / "step_00000006.done"
    if damage == "truncated":  # the writer died half way through the file
        pt.write_bytes(pt.read_bytes()[:100])
    elif damage == "no marker":  # died after the file, before its marker: not committed, not listed
        done.unlink()
    elif damage == "marker for other bytes":
        done.write_text(json.dumps({"step": 6, "bytes": pt.stat().st_size, "sha256": "0" * 64}))
    elif damage == "only a temp file":  # died inside the write: the .pt never got its name
        pt.rename(tmp_path / "step_00000006.pt.tmp")
    else:
        done.write_text("{not json")
    found = checkpoint.latest(str(tmp_path))
    assert found.step == 3, found  # the complete one before it
    if damage != "no marker":
        assert len(found.skipped) == 1 and "step_00000006.pt" in found.skipped[0], found.skipped
    said = []
    step, loaded = checkpoint.resume(str(tmp_path), say=said.append)
    assert step == 3 and torch.equal(loaded["model"]["w"], torch.full((4,), 3.0))
    assert said[-1].startswith("checkpoint: resuming from step 3")
    assert (damage == "no marker") or any("skipping a torn or partial checkpoint, never loaded" in s for s in said)


def test_no_checkpoint_resumes_nothing(tmp_path):
    assert checkpoint.resume(str(tmp_path / "none"), say=lambda m: None) == (None, None)
    assert checkpoint.resume(None, say=lambda m: None) == (None, None)
    with pytest.raises(ValueError, match="keep"):
        checkpoint.save(str(tmp_path), 1, state(1), keep=0)
