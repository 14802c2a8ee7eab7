"""The benchmark's modes for what torch 2.14 offers (issue 36, item 4): each is listed, described and built, and
each says why where its torch lacks the mechanism (no rank processes here; the runs are in BENCHMARKS.md)."""

from __future__ import annotations

import re
import types

import pytest
import torch

NEW_MODES = ("torch_reducer_overlap", "torch_savvy_one_rank", "torch_savvy_megacache", "ours_step_in_graph_auto")


def test_every_mode_has_a_builder_and_a_description_and_the_new_ones_are_there():
    from benchmarks.bracket_modes import BRACKET_BUILDERS
    from benchmarks.config import IN_GRAPH_MODES, MODE_HELP, MODES
    from benchmarks.modes import BUILDERS

    assert set(MODES) == set(BUILDERS) | set(BRACKET_BUILDERS) == set(MODE_HELP)
    assert set(NEW_MODES) <= set(MODES)
    assert "ours_step_in_graph_auto" in IN_GRAPH_MODES  # its backward all-reduces: DDP's hooks see nothing


def test_modes_name_the_missing_mechanism_and_the_torch(monkeypatch):
    from benchmarks import modes_torch
    from benchmarks.mode_context import ModeUnavailable

    # a torch without compile_on_one_rank in torch.compiler.config (2.13 keeps an unwired flag elsewhere)
    monkeypatch.setattr(torch.compiler, "config", types.SimpleNamespace())
    with pytest.raises(ModeUnavailable, match=rf"torch {re.escape(torch.__version__)} .*compile_on_one_rank"):
        modes_torch.build_torch_savvy_one_rank(None)
    # a torch whose Inductor has no overlap scheduler with collective bucketing
    monkeypatch.setattr(torch._inductor, "config", types.SimpleNamespace())
    with pytest.raises(ModeUnavailable, match="collective_bucketing"):
        modes_torch.build_torch_reducer_overlap(None)
    # the mega-cache mode keeps its file in the cache dir the runner gives a mode's cold and warm jobs
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with pytest.raises(ModeUnavailable, match="TORCHINDUCTOR_CACHE_DIR"):
        modes_torch.build_torch_savvy_megacache(None)


def test_cache_info_counts_artifacts_by_kind():
    from benchmarks.modes_torch import _cache_info

    info = types.SimpleNamespace(artifacts={"inductor": ["a", "b"], "aot_autograd": ["c"]})
    assert _cache_info(info) == {"inductor": 2, "aot_autograd": 1}
    assert _cache_info(None) is None


def test_dynamo_is_set_for_the_python_reducer_modes():
    import torch._dynamo

    from benchmarks.modes import configure_dynamo

    # The config module's own patch, not pytest's monkeypatch: since pytest 9.2 monkeypatch restores a module
    # attribute it did not find in the module's __dict__ by deleting it, and deleting a torch config entry hides
    # it for the rest of the process ("torch._dynamo.config.optimize_ddp does not exist" in every later DDP test).
    with torch._dynamo.config.patch(optimize_ddp=True, compiled_autograd=False):
        configure_dynamo("torch_reducer_overlap")
        assert torch._dynamo.config.optimize_ddp == "python_reducer" and torch._dynamo.config.compiled_autograd
        configure_dynamo("torch_savvy_one_rank")
        assert torch._dynamo.config.optimize_ddp is True
    assert torch._dynamo.config.optimize_ddp is True and not torch._dynamo.config.compiled_autograd
