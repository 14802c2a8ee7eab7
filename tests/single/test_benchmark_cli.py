"""The benchmark's command line and job planning (benchmarks/cli.py, benchmarks/suite.py): what the presets and
flags put into the config, that the presets build the same models as before, that each flag reaches every
planned job (and, for compile flags, the compile call or the rank's environment), which jobs each mode and
workload gets, and the dependency check that fails before any job runs."""

from __future__ import annotations

import importlib
import sys
import time

import pytest
import torch


def _cfg(*argv: str):
    from benchmarks.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(list(argv)), command="test")


def test_cli_presets_pick_workloads_caps_and_optimizers():
    full = _cfg()
    assert [w.name for w in full.workloads] == ["compute", "comm", "compile"]
    caps = {w.name: w.cap_mb(full.bucket_cap_mb) for w in full.workloads}
    assert caps == {"compute": None, "comm": 4.0, "compile": 1.0}
    compile_w = full.workloads[2]
    assert (compile_w.model.d_model, compile_w.model.n_layers, compile_w.batch, compile_w.seq_len) == (256, 12, 2, 64)
    assert 256 % compile_w.model.n_heads == 0 and not compile_w.scaling and not compile_w.overlap
    assert full.optimizer == "adamw" and full.warmup == 3 and full.profile_steps == 2 and full.plot
    smoke = _cfg("--smoke")
    assert smoke.optimizer == "sgd" and smoke.backend == "aot_eager" and smoke.profile_steps == 1
    assert all(w.cap_mb(smoke.bucket_cap_mb) == 1.0 and w.model.d_model == 128 for w in smoke.workloads)
    # --bucket-cap-mb sets every workload's cap; --no-plot and --optimizer go through
    custom = _cfg("--bucket-cap-mb", "2", "--workloads", "comm,compile", "--optimizer", "sgd", "--no-plot")
    assert [w.cap_mb(None) for w in custom.workloads] == [2.0, 2.0] and custom.optimizer == "sgd" and not custom.plot
    quick = _cfg("--quick", "--workloads", "compile")
    assert quick.workloads[0].model.n_layers == 12  # the compile workload keeps its shape outside smoke
    with pytest.raises(ValueError, match="'nope'.*compute,comm,compile"):
        _cfg("--workloads", "comm,nope")


# Parameter counts of the models each preset built when every caller still declared its own shape
# (examples/train_gpt.py, the integration examples, benchmarks/config.py): the presets must build the same.
PARAMS_BEFORE_PRESETS = {
    ("full", "compute"): 13_842_432,
    ("full", "comm"): 13_817_856,
    ("full", "compile"): 11_591_168,
    ("quick", "compute"): 929_280,
    ("quick", "comm"): 925_184,
    ("quick", "compile"): 11_591_168,
    ("smoke", "compute"): 929_280,
    ("smoke", "comm"): 925_184,
    ("smoke", "compile"): 929_280,
}


def _n_params(gpt_cfg) -> int:
    import torch

    from examples.gpt import GPT

    with torch.device("meta"):  # shapes only: no memory, no init time
        return sum(p.numel() for p in GPT(gpt_cfg).parameters())


def test_workloads_and_examples_build_the_models_they_built_before_the_presets():
    import dataclasses

    import examples.train_gpt as demo
    from benchmarks.suite import _worker_spec
    from examples.gpt import GPT_PRESETS, GPTConfig

    for preset, argv in (
        ("full", ()),
        ("quick", ("--quick", "--workloads", "compute,comm,compile")),
        ("smoke", ("--smoke",)),
    ):
        cfg = _cfg(*argv)
        for w in cfg.workloads:
            spec = _worker_spec(cfg, w, "eager", steps=1, record_overlap=False, timeline_png=None)
            assert spec["gpt"]["max_seq_len"] == w.seq_len  # the position table covers the workload's tokens
            assert _n_params(GPTConfig(**spec["gpt"])) == PARAMS_BEFORE_PRESETS[preset, w.name], (preset, w.name)
    assert _n_params(demo.TrainConfig().gpt()) == 667_136
    assert demo.TrainConfig().gpt() == GPT_PRESETS["demo"]
    assert _n_params(GPT_PRESETS["integration"]) == 168_512
    # the command-line overrides replace fields of the preset and are validated as GPTConfig
    custom = _cfg("--d-model", "64", "--heads", "2", "--layers", "3", "--vocab", "100").workloads[0].model
    assert custom == dataclasses.replace(GPT_PRESETS["bench"], d_model=64, n_heads=2, n_layers=3, vocab_size=100)
    with pytest.raises(ValueError, match="--d-model/--layers/--heads/--vocab: .*d_model=64 .*n_heads=5"):
        _cfg("--d-model", "64", "--heads", "5")
    with pytest.raises(ValueError, match="GPT preset 'huge' is unknown; choose one of bench, "):
        GPTConfig.preset("huge")
    with pytest.raises(SystemExit):  # argparse: the message names the flag
        demo.parse_args(["--d-model", "130"])


def test_plan_gives_the_compile_workload_no_extra_jobs_and_workloads_their_caps(tmp_path):
    from benchmarks.suite import CacheDirs, plan_overlap, plan_round

    cfg = _cfg("--modes", "eager,ours_in_graph", "--out-dir", str(tmp_path))
    caches = CacheDirs(tmp_path)
    try:
        jobs = list(plan_round(cfg, 1, caches))
        overlap = list(plan_overlap(cfg, caches))
    finally:
        caches.cleanup()
    kinds = {(j.workload, j.kind) for j in jobs}
    assert ("compile", "single") not in kinds and ("comm", "single") in kinds
    assert {j.workload for j in overlap} == {"compute", "comm"}
    caps = {j.workload: j.worker["bucket_cap_mb"] for j in jobs}
    assert caps == {"compute": None, "comm": 4.0, "compile": 1.0}
    assert all(j.worker["optimizer"] == "adamw" and j.worker["optimizer_kwargs"]["lr"] == 1e-3 for j in jobs)
    assert all(j.worker["profile_steps"] == 0 for j in jobs)  # the timed jobs are never profiled in full runs
    assert all(j.worker["profile_steps"] == 2 and j.worker["record_overlap"] for j in overlap)


def test_missing_matplotlib_fails_in_well_under_a_second_before_any_job(monkeypatch, capsys):
    import importlib.util

    from benchmarks import cli, suite
    from benchmarks.deps import missing

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: pytest.fail("a job ran despite the missing dependency"))
    t0 = time.monotonic()
    assert cli.main(["--smoke"]) == 2
    assert time.monotonic() - t0 < 1.0
    err = capsys.readouterr().err
    assert "matplotlib is not importable" in err and "--no-plot" in err and "pip install" in err
    assert missing(plot=False) == []  # --no-plot runs without it


def test_new_flags_reach_the_config_and_every_job():
    from benchmarks.suite import CacheDirs, plan_round

    cfg = _cfg("--smoke", "--link-gbit", "2.5", "--comm-hook", "fp16", "--modes", "eager,ours_in_graph")
    assert (cfg.link_gbit, cfg.comm_hook, cfg.reduce_dtype) == (2.5, "fp16", None)
    assert cfg.link().qdisc_args()[-6:] == ["rate", "2500000000bit", "burst", "256kb", "latency", "100ms"]
    assert cfg.to_dict()["link_gbit"] == 2.5  # results.json records the link
    assert _cfg("--reduce-dtype", "bf16").reduce_dtype == "bf16" and _cfg().comm_hook is None and _cfg().link() is None
    caches = CacheDirs()
    try:
        jobs = list(plan_round(cfg, 1, caches))
    finally:
        caches.cleanup()
    assert all(
        (j.worker["comm_hook"], j.worker["link_gbit"], j.worker["reduce_dtype"]) == ("fp16", 2.5, None) for j in jobs
    )
    with pytest.raises(SystemExit):  # argparse: bf16_compress_hook is not offered (DDP refuses it on CPU)
        _cfg("--comm-hook", "bf16")


def test_compile_mode_reaches_every_job_and_every_compile_call():
    from benchmarks.config import BenchConfig
    from benchmarks.mode_context import ModeContext, compile_options
    from benchmarks.suite import CacheDirs, plan_round
    from benchmarks.workloads import Workload

    cfg = _cfg("--quick", "--compile-mode", "reduce-overhead", "--modes", "torch_savvy,ours_step_in_graph")
    assert cfg.compile_mode == "reduce-overhead" and _cfg("--quick").compile_mode is None
    caches = CacheDirs()
    try:
        assert {j.worker["compile_mode"] for j in plan_round(cfg, 1, caches)} == {"reduce-overhead"}
    finally:
        caches.cleanup()
    import torch

    ctx = dict(ddp=None, model=torch.nn.Linear(1, 1), optimizer=None, backend="inductor", mark_backward=lambda: None)
    assert compile_options(ModeContext(**ctx, compile_mode="reduce-overhead")) == {
        "backend": "inductor",
        "mode": "reduce-overhead",
    }
    assert compile_options(ModeContext(**ctx)) == {"backend": "inductor"}  # no mode: torch.compile's default
    w = (Workload(name="w"),)
    with pytest.raises(ValueError, match="compile_mode='fast'.*reduce-overhead"):
        BenchConfig(workloads=w, compile_mode="fast")
    with pytest.raises(ValueError, match="--compile-mode reduce-overhead needs --backend inductor.*aot_eager"):
        BenchConfig(workloads=w, backend="aot_eager", compile_mode="reduce-overhead")


def test_nested_regions_reach_every_job_and_region_blocks_compute_what_plain_blocks_compute():
    from benchmarks.suite import CacheDirs, plan_round
    from examples.gpt import GPT, GPTConfig, synthetic_batch

    cfg = _cfg("--quick", "--nested-regions", "--modes", "torch_savvy,ours_step_in_graph")
    assert cfg.nested_regions and not _cfg("--quick").nested_regions
    caches = CacheDirs()
    try:
        assert {j.worker["nested_regions"] for j in plan_round(cfg, 1, caches)} == {True}
    finally:
        caches.cleanup()
    gpt = GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=3, max_seq_len=16)
    torch.manual_seed(0)
    regions = GPT(gpt, regions=True)
    plain = GPT(gpt)
    plain.load_state_dict(regions.state_dict())
    traced: list[int] = []

    def count_regions(gm, inputs):
        traced.append(sum("invoke_subgraph" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    x, _ = synthetic_batch(gpt, 2, 8, step=0)
    torch.testing.assert_close(torch.compile(regions, backend=count_regions)(x), plain(x), rtol=0, atol=0)
    assert traced == [3], traced  # one region call per layer: what makes the blocks traced once


def test_compile_threads_reach_each_ranks_environment(monkeypatch):
    from benchmarks.config import BenchConfig
    from benchmarks.report_sections import run_condition_lines
    from benchmarks.runner import _rank_env
    from benchmarks.suite import CacheDirs, plan_round
    from benchmarks.workloads import Workload

    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "7")  # the caller's own setting never leaks through
    caches = CacheDirs()
    try:
        pinned = next(iter(plan_round(_cfg("--quick"), 1, caches)))
        unpinned = next(iter(plan_round(_cfg("--quick", "--compile-threads", "torch"), 1, caches)))
        three = next(iter(plan_round(_cfg("--quick", "--compile-threads", "3"), 1, caches)))
    finally:
        caches.cleanup()
    assert _rank_env(pinned, 0, 1234)["TORCHINDUCTOR_COMPILE_THREADS"] == "1"  # 'auto' without a GPU
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in _rank_env(unpinned, 0, 1234)  # torch picks (the CPU count)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _cfg("--quick").compile_threads is None  # 'auto' where a GPU is: torch's default, as users run
    assert _rank_env(three, 1, 1234)["TORCHINDUCTOR_COMPILE_THREADS"] == "3"
    assert "torch's default" in run_condition_lines({"compile_threads": None})[-1]
    assert run_condition_lines({})[-1].endswith("1 (TORCHINDUCTOR_COMPILE_THREADS)")  # older runs: pinned
    for bad in ("0", "two", "-1"):
        with pytest.raises(SystemExit):
            _cfg("--compile-threads", bad)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="compile_threads=.*None for torch's default"):
            BenchConfig(workloads=(Workload(name="w"),), compile_threads=bad)


def test_bracket_modes_get_one_kind_of_job_each_and_no_scaling_or_overlap_jobs(tmp_path):
    from benchmarks.suite import CacheDirs, plan_overlap, plan_round

    cfg = _cfg("--modes", "floor,comm_only,eager", "--workloads", "comm", "--out-dir", str(tmp_path))
    caches = CacheDirs(tmp_path)
    try:
        r1 = [(j.mode, j.kind) for j in plan_round(cfg, 1, caches)]
        r2 = [(j.mode, j.kind) for j in plan_round(cfg, 2, caches)]
        overlap = [j.mode for j in plan_overlap(cfg, caches)]
    finally:
        caches.cleanup()
    # floor compiles (cold, then warm); comm_only compiles nothing (one job, like eager)
    assert r1 == [("floor", "cold"), ("floor", "warm"), ("comm_only", "warm"), ("eager", "warm"), ("eager", "single")]
    assert sorted(r2) == [("comm_only", "warm"), ("eager", "warm"), ("floor", "warm")]
    assert overlap == ["eager"]
    quick = _cfg("--quick", "--modes", "floor,comm_only,eager", "--out-dir", str(tmp_path))
    caches = CacheDirs(tmp_path)
    try:
        recorded = {j.mode: j.worker["record_overlap"] for j in plan_round(quick, 1, caches)}
    finally:
        caches.cleanup()
    assert recorded == {"floor": False, "comm_only": False, "eager": True}


def test_importing_the_entry_module_runs_nothing(monkeypatch):
    """`python -m benchmarks` runs the command line; importing benchmarks.__main__ (a tool listing modules,
    a test) must not start a benchmark."""
    monkeypatch.setattr(sys, "argv", ["benchmarks", "--no-such-flag"])  # main() would exit 2 on it
    monkeypatch.delitem(sys.modules, "benchmarks.__main__", raising=False)
    module = importlib.import_module("benchmarks.__main__")
    assert callable(module.main)
