"""Pure parts of `python -m benchmarks` (no rank processes): first-step breakdown, profiler overlap math,
memory high-water mark, configuration and CLI plumbing, dependency check, aggregation and tables; plus
canaries for the torch timers, counters and profiler events they read."""

from __future__ import annotations

import json
import time

import pytest
import torch

# -- benchmarks/breakdown.py ---------------------------------------------------------------------------


def _timers(**kw: float) -> dict[str, float]:
    from benchmarks import breakdown as b

    names = {
        "frame": b.FRAME,
        "backend": b.BACKEND,
        "lazy": b.LAZY_BACKWARD,
        "inductor": b.INDUCTOR,
        "load": b.INDUCTOR_LOAD,
        "cpp": b.CPP,
    }
    return {names[k]: v for k, v in kw.items()}


def test_breakdown_phases_add_up_to_the_wall_time():
    from benchmarks.breakdown import breakdown

    # a frame of 10 s whose backend took 8 s (Inductor 6 s of it, 4 s C++), then a lazy backward of 3 s
    # with 2 s of Inductor: Dynamo 2, AOT 8 + 3 - 8 = 3, Inductor 8 - 4 = 4, C++ 4, other 14 - 13 = 1
    timers = _timers(frame=10.0, backend=8.0, lazy=3.0, inductor=8.0, cpp=4.0)
    counters = {
        "inductor": {"fxgraph_cache_miss": 2},
        "aot_autograd": {"autograd_cache_miss": 1, "autograd_cache_guard_miss": 1},
        "stats": {"unique_graphs": 1},
        "frames": {"total": 3},
    }
    got = breakdown(14.0, timers, counters)
    assert got["compile_s"] == 13.0
    assert (got["dynamo_s"], got["aot_s"], got["inductor_s"], got["cpp_compile_s"], got["other_s"]) == (2, 3, 4, 4, 1)
    parts = got["dynamo_s"] + got["aot_s"] + got["inductor_s"] + got["cpp_compile_s"] + got["other_s"]
    assert parts == pytest.approx(got["wall_s"])
    assert got["cache"] == {
        "fxgraph_hit": 0,
        "fxgraph_miss": 2,
        "fxgraph_bypass": 0,
        "aot_hit": 0,
        "aot_miss": 2,
        "aot_bypass": 0,
    }
    assert (got["graphs"], got["frames"]) == (1, 3)
    json.dumps(got)  # JSON-ready


def test_breakdown_of_a_warm_cache_counts_inductor_loads_and_never_goes_negative():
    from benchmarks.breakdown import breakdown

    # warm: the backend only loads Inductor's output from the AOTAutograd cache
    got = breakdown(1.0, _timers(frame=0.9, backend=0.6, load=0.5), {"aot_autograd": {"autograd_cache_hit": 2}})
    assert got["inductor_s"] == 0.5 and got["aot_s"] == pytest.approx(0.1) and got["cache"]["aot_hit"] == 2
    # clock skew between nested timers must not produce negative phases
    skewed = breakdown(0.5, _timers(frame=1.0, backend=1.2, inductor=1.3, cpp=1.4), {})
    assert all(skewed[k] >= 0 for k in ("dynamo_s", "aot_s", "inductor_s", "other_s"))
    assert breakdown(0.01, {}, {})["compile_s"] == 0.0  # eager: nothing compiled


def test_summarize_steps_flags_compiles_after_the_warmup():
    from benchmarks.breakdown import breakdown, summarize_steps

    steps = [
        breakdown(5.0, _timers(frame=4.0, backend=3.0), {}),
        breakdown(2.0, _timers(frame=1.5), {}),
        breakdown(0.1, {}, {}),
        breakdown(0.1, {}, {}),
        breakdown(0.9, _timers(lazy=0.8), {}),
    ]
    got = summarize_steps(steps, warmup=2)
    assert got["first_step"]["compile_s"] == 4.0
    assert got["later_warmup_compile_s"] == 1.5
    assert got["timed_compile_s"] == pytest.approx(0.8) and got["timed_steps_with_compile"] == [4]
    assert summarize_steps([], warmup=2) == {}


def test_step_clock_reads_torchs_timers_around_a_real_compile():
    """Canary: the dynamo_timed keys and counters benchmarks/breakdown.py relies on exist on this torch."""
    import torch

    from benchmarks import breakdown as b

    clock = b.StepClock()
    lin = torch.nn.Linear(4, 4)
    fn = torch.compile(lambda x: lin(x).relu().sum(), backend="aot_eager")
    clock.start()
    fn(torch.randn(2, 4)).backward()
    first = clock.stop(1.0)
    clock.start()
    fn(torch.randn(2, 4)).backward()
    second = clock.stop(0.1)
    assert first["timers"].get(b.FRAME, 0) > 0 and first["timers"].get(b.BACKEND, 0) > 0, first["timers"]
    timers = first["timers"]  # rounded to 0.1 ms
    assert first["compile_s"] == pytest.approx(timers[b.FRAME] + timers.get(b.LAZY_BACKWARD, 0), abs=1e-3)
    assert first["graphs"] >= 1 and first["frames"] >= 1
    assert second["compile_s"] == 0.0 and second["graphs"] == 0  # the cached graph ran: nothing compiled
    from torch._dynamo.utils import counters

    assert {"inductor", "aot_autograd", "stats", "frames"} <= set(b.COUNTERS) and isinstance(counters["stats"], dict)


# -- benchmarks/profile_overlap.py ------------------------------------------------------------------------


def _ev(name: str, start: float, end: float, thread: int = 1, nbytes: int = 0):
    from benchmarks.profile_overlap import Event

    return Event(name=name, thread=thread, start_us=start, end_us=end, nbytes=nbytes)


def _step_events(offset: float = 0.0) -> list:
    """One step (us): backward 100..1000; all-reduces issued at 300, 600, 1000 and done at 700, 900, 1400."""
    o = offset
    return [
        _ev("bench::step", o + 0, o + 1500),
        _ev("autograd::engine::evaluate_function: MmBackward0", o + 100, o + 200),
        _ev("c10d::allreduce_", o + 300, o + 310),
        _ev("gloo:all_reduce", o + 320, o + 700, thread=2),
        _ev("c10d::allreduce_", o + 600, o + 610),
        _ev("gloo:all_reduce", o + 700, o + 900, thread=3),
        _ev("c10d::allreduce_", o + 1000, o + 1010),
        _ev("gloo:all_reduce", o + 1010, o + 1400, thread=2),
        _ev("[memory]", o + 150, o + 150, nbytes=4000),
        _ev("[memory]", o + 400, o + 400, nbytes=6000),
        _ev("[memory]", o + 800, o + 800, nbytes=-8000),
        _ev("[memory]", o + 1200, o + 1200, nbytes=1000),
    ]


def test_profiler_overlap_matches_the_recorders_definition_on_a_synthetic_step():
    from benchmarks.profile_overlap import summarize
    from ddp.overlap.intervals import overlap_stats

    got = summarize(_step_events())
    # comm = [300,700] U [600,900] U [1000,1400] = 600+400 = 1000 us; window [100, 1000]; hidden 600
    expected = overlap_stats(compute=(100e-6, 1000e-6), comm=[(300e-6, 700e-6), (600e-6, 900e-6), (1000e-6, 1400e-6)])
    assert got["measured"] and got["paired"] and got["all_reduces"] == 3
    assert got["median_comm_ms"] == pytest.approx(1.0) and got["median_exposed_ms"] == pytest.approx(0.4)
    assert got["median_overlap_percent"] == pytest.approx(expected.percent) == pytest.approx(60.0)
    assert got["tensor_peak_mb"] == pytest.approx(10000 / 2**20)  # 4000 + 6000 before the free
    last = got["last_step"]
    assert last["backward_ms"] == [0.0, pytest.approx(0.9)]
    assert [b["ready_ms"] for b in last["buckets"]] == pytest.approx([0.2, 0.5, 0.9])


def test_profiler_overlap_takes_the_median_over_steps_and_falls_back_when_unpaired():
    from benchmarks.profile_overlap import label_buckets, summarize

    two = summarize(_step_events() + _step_events(offset=10_000))
    assert two["steps"] == 2 and two["median_overlap_percent"] == pytest.approx(60.0)
    # a gloo event without its issue (say, another thread issued it): only gloo's own intervals are used
    events = [e for e in _step_events() if not (e.name == "c10d::allreduce_" and e.start_us == 600)]
    unpaired = summarize(events)
    assert unpaired["measured"] and not unpaired["paired"]
    assert unpaired["median_comm_ms"] == pytest.approx((700 - 320 + 900 - 700 + 1400 - 1010) / 1e3)
    # no all-reduce at all (1 rank) or no step mark: not measured, with a reason
    quiet = summarize([e for e in _step_events() if "all" not in e.name])
    assert quiet["measured"] is False and "c10d::allreduce_" in quiet["reason"] and quiet["tensor_peak_mb"]
    assert summarize([])["measured"] is False
    planned = [{"params": ["a"], "bytes": 8}, {"params": ["b"], "bytes": 16}, {"params": ["c", "d"], "bytes": 4}]
    labelled = label_buckets(two["last_step"], planned)
    assert [b["params"] for b in labelled["buckets"]] == [["a"], ["b"], ["c", "d"]]
    assert label_buckets(two["last_step"], planned[:2]) is two["last_step"]  # counts differ: left alone


def test_profiler_records_the_events_the_overlap_math_reads(pg):
    """Canary on a 1-rank gloo group: the op names, gloo's worker-thread event and memory events exist."""
    import torch
    import torch.distributed as dist

    from benchmarks.profile_overlap import DONE, ISSUE, MEMORY, STEP_MARK, StepProfiler

    t = torch.ones(1024)
    with StepProfiler() as prof:
        with prof.mark_step():
            x = torch.randn(256, requires_grad=True)
            (x * 2).sum().backward()
            dist.all_reduce(t)
    names = {e.name for e in prof.events()}
    assert {STEP_MARK, ISSUE[0], DONE[0], MEMORY} <= names, sorted(n for n in names if "::" in n or "gloo" in n)
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    assert any(e.nbytes < 0 for e in prof.events() if e.name == MEMORY)  # frees are negative


# -- benchmarks/memory.py ------------------------------------------------------------------------------------


def test_steady_peak_resets_below_an_earlier_high_water_mark_and_the_process_peak_survives_it():
    from benchmarks import memory

    if not memory.reset_peak() or memory.read_peak_mb() is None:
        pytest.skip("this kernel does not let a process reset VmHWM")
    # Anonymous mappings, not bytearrays: malloc may serve a bytearray from heap pages an earlier test in
    # this worker already made resident (then RSS does not grow); a fresh mapping always faults new pages.
    big = _touched_mapping(64)
    before = memory.read_peak_mb()
    big.close()
    tracker = memory.PeakTracker()
    tracker.start_steady()
    small = _touched_mapping(8)
    tracker.stop_steady()
    assert tracker.steady_mb < before - 32, (before, tracker.steady_mb)
    assert 6 < tracker.growth_mb < 32, tracker.growth_mb  # the 8 MiB the "steps" touched, not the baseline
    # the reset also reset ru_maxrss: the tracker remembers the peak from before it
    assert memory.process_peak_rss_mb() < before - 32
    assert tracker.process_peak_mb() >= before - 1
    small.close()


def test_training_state_counts_ddp_buckets_gradients_and_optimizer_state_once_each(pg):
    # What a job holds between steps; the step's absolute tensor peak is this plus the profiler's peak above it.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.memory import held_mb, training_state_mb
    from ddp.torch_ddp_reducer import release_reducer_buckets

    def state_after_one_step(**ddp_kwargs):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))
        ddp = DDP(model, **ddp_kwargs)
        opt = torch.optim.AdamW(model.parameters())
        ddp(torch.randn(4, 256)).sum().backward()
        opt.step()
        return model, opt, ddp

    model, opt, ddp = state_after_one_step()
    mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    got = training_state_mb(model, opt, ddp)
    assert got["parameters"] == pytest.approx(mib) and got["gradient_bytes"] == pytest.approx(mib)
    assert got["gradients"] == pytest.approx(mib)  # .grad alive (no zero_grad yet)
    assert got["ddp_buckets"] == pytest.approx(mib)  # DDP's reducer: a second copy of every gradient
    assert got["optimizer_state"] == pytest.approx(2 * mib, rel=0.01)  # exp_avg, exp_avg_sq (+ step scalars)
    assert got["buffers"] == pytest.approx((2 * 256 * 4 + 8) / 2**20)  # running mean/var + num_batches_tracked
    assert held_mb(got) == pytest.approx(sum(v for k, v in got.items() if k != "gradient_bytes"))
    opt.zero_grad(set_to_none=True)
    release_reducer_buckets(ddp)  # what the in-graph modes do: no bucket copy is held any more
    after = training_state_mb(model, opt, ddp)
    assert after["gradients"] == 0.0 and after["ddp_buckets"] < 0.001
    # with gradient_as_bucket_view the .grad tensors are the buckets: counted once, as buckets
    model, opt, ddp = state_after_one_step(gradient_as_bucket_view=True)
    viewed = training_state_mb(model, opt, ddp)
    assert viewed["gradients"] == 0.0 and viewed["ddp_buckets"] == pytest.approx(mib)


def test_absolute_tensor_peak_adds_what_was_held_and_savings_are_read_in_gradient_bytes():
    from benchmarks.aggregate import aggregate_mode
    from benchmarks.memory import gradient_savings
    from benchmarks.tables import _tensor_peak_cell, gradient_savings_line

    def prof(step_peak, **state):
        return {
            "measured": False,
            "reason": "r",
            "tensor_peak_mb": step_peak,
            "state_mb": {"gradient_bytes": 50.0, **state},
        }

    held_ref = {"parameters": 50.0, "optimizer_state": 100.0, "ddp_buckets": 50.0}
    jobs = [
        _job("r", "cold", "ours_step", [_rank(8.0, 7.0, profile=prof(50.0, **held_ref))] * 2),
        _job(
            "b",
            "cold",
            "ours_step_in_backward",
            [_rank(8.0, 7.0, profile=prof(30.0, parameters=50.0, optimizer_state=100.0))] * 2,
        ),
    ]
    modes = {m: aggregate_mode(jobs, m) for m in ("ours_step", "ours_step_in_backward")}
    ref = modes["ours_step"]["profile"]
    assert ref["held_mb_per_rank"] == [200.0, 200.0] and ref["absolute_peak_mb_per_rank"] == [250.0, 250.0]
    [row] = gradient_savings(modes)
    # 250 - 180 = 70 MB lower: 140% of the 50 MB of gradients (DDP's bucket copy and the gradients both gone)
    assert row["mode"] == "ours_step_in_backward" and row["saved_mb"] == 70.0 and row["share"] == pytest.approx(1.4)
    assert _tensor_peak_cell(ref) == "200.0/200.0 + 50.0/50.0 = 250.0/250.0"
    assert _tensor_peak_cell({"tensor_peak_mb_per_rank": [12.5, 12.5]}) == "12.5/12.5"  # older results
    assert "ours_step_in_backward +70.0 MB (+140%)" in gradient_savings_line({"gradient_savings": [row]})


def _touched_mapping(mib: int):
    import mmap

    region = mmap.mmap(-1, mib * 2**20)
    for i in range(0, len(region), mmap.PAGESIZE):  # touch every page: RSS really grows
        region[i] = 1
    return region


# -- configuration, CLI, dependency check -------------------------------------------------------------------


def test_new_config_fields_are_validated_with_the_value_and_the_fix():
    from benchmarks.config import BenchConfig
    from benchmarks.workloads import Workload

    w = (Workload(name="w"),)
    with pytest.raises(ValueError, match="optimizer='adam'.*sgd"):
        BenchConfig(workloads=w, optimizer="adam")
    with pytest.raises(ValueError, match="lr=-0.1.*adamw 0.001"):
        BenchConfig(workloads=w, lr=-0.1)
    with pytest.raises(ValueError, match="profile_steps=-1"):
        BenchConfig(workloads=w, profile_steps=-1)
    with pytest.raises(ValueError, match="names a mode twice"):
        BenchConfig(workloads=w, modes=("eager", "eager"))
    with pytest.raises(ValueError, match=r"Workload\(w\).bucket_cap_mb=0"):
        Workload(name="w", bucket_cap_mb=0)
    with pytest.raises(ValueError, match="batch=True"):
        Workload(name="w", batch=True)
    cfg = BenchConfig(workloads=w, optimizer="adamw")
    assert cfg.optimizer_kwargs() == {"lr": 1e-3, "weight_decay": 0.01}
    assert BenchConfig(workloads=w, optimizer="sgd", lr=0.1).optimizer_kwargs() == {"lr": 0.1, "momentum": 0.9}
    assert cfg.describe_optimizer() == "AdamW(lr=0.001, weight_decay=0.01)"
    assert Workload(name="w", bucket_cap_mb=4).cap_mb(25.0) == 4 and Workload(name="w").cap_mb(None) is None


def test_param_tolerance_follows_backend_and_optimizer():
    from benchmarks.config import BenchConfig
    from benchmarks.workloads import Workload

    def tol(backend: str, optimizer: str) -> float:
        return BenchConfig(workloads=(Workload(name="w"),), backend=backend, optimizer=optimizer).param_tolerance()

    assert tol("aot_eager", "sgd") == 1e-5 and tol("inductor", "sgd") == 1e-3
    # AdamW divides each gradient element by its own running scale: rounding in tiny gradients is
    # amplified (seen 2e-5..5e-5 on aot_eager after 3 steps), a missing all-reduce still lands at ~0.6
    assert tol("aot_eager", "adamw") == 1e-3 and tol("inductor", "adamw") == 1e-2
    assert BenchConfig(workloads=(Workload(name="w"),), param_rtol=0.5).param_tolerance() == 0.5


def test_make_optimizer_builds_the_configured_optimizer():
    import torch

    from benchmarks.config import BenchConfig
    from benchmarks.modes import make_optimizer
    from benchmarks.workloads import Workload

    params = [torch.nn.Parameter(torch.zeros(2))]
    kwargs = BenchConfig(workloads=(Workload(name="w"),), optimizer="adamw").optimizer_kwargs()
    opt = make_optimizer("adamw", params, kwargs)
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["weight_decay"] == 0.01
    assert isinstance(make_optimizer("sgd", params, {"lr": 0.05, "momentum": 0.9}), torch.optim.SGD)
    with pytest.raises(ValueError, match="'rmsprop'"):
        make_optimizer("rmsprop", params, {})


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


def test_workloads_read_back_from_results_json_old_and_new():
    import dataclasses

    from benchmarks.config import BenchConfig
    from benchmarks.workloads import Workload, full_workloads
    from examples.gpt import GPT_PRESETS

    cfg = BenchConfig(workloads=full_workloads())
    recorded = json.loads(json.dumps(cfg.to_dict()))
    assert tuple(Workload.from_dict(w) for w in recorded["workloads"]) == cfg.workloads
    # runs before the presets recorded the model's shape flat in each workload
    old = {
        "name": "comm",
        "vocab_size": 4096,
        "d_model": 384,
        "n_layers": 6,
        "n_heads": 6,
        "batch": 2,
        "seq_len": 64,
        "bucket_cap_mb": 4.0,
        "scaling": True,
        "overlap": True,
        "purpose": "p",
    }
    w = Workload.from_dict(old)
    assert w.model == GPT_PRESETS["bench"] and (w.batch, w.seq_len, w.bucket_cap_mb) == (2, 64, 4.0)
    assert w.gpt() == dataclasses.replace(GPT_PRESETS["bench"], max_seq_len=64)
    with pytest.raises(TypeError, match="pass a GPTConfig"):
        Workload(name="w", model={"d_model": 64})


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


# -- aggregation and tables ----------------------------------------------------------------------------------


def _rank(first: float, compile_s: float, **extra) -> dict:
    from benchmarks.breakdown import breakdown

    b = breakdown(first, {"_compile.compile_inner": compile_s}, {})
    return {
        "ok": True,
        "median_step_ms": 10.0,
        "first_step_s": first,
        "peak_rss_mb": 500.0,
        "final_loss": 2.0,
        "compile": {
            "first_step": b,
            "later_warmup_compile_s": 0.0,
            "timed_compile_s": 0.0,
            "timed_steps_with_compile": [],
        },
        **extra,
    }


def _job(job_id: str, kind: str, mode: str, ranks: list) -> dict:
    return {"job_id": job_id, "kind": kind, "mode": mode, "workload": "w", "ok": True, "ranks": ranks}


def test_first_step_breakdown_is_the_median_jobs_slowest_rank():
    from benchmarks.aggregate import first_step_breakdown

    jobs = [
        _job("a", "warm", "m", [_rank(1.0, 0.5), _rank(3.0, 2.0)]),
        _job("b", "warm", "m", [_rank(9.0, 8.0), _rank(2.0, 1.0)]),
        _job("c", "warm", "m", [_rank(5.0, 4.0), _rank(4.0, 1.0)]),
    ]
    got = first_step_breakdown(jobs)
    assert (got["job_id"], got["rank"], got["wall_s"], got["compile_s"], got["jobs"]) == ("c", 0, 5.0, 4.0, 3)
    assert first_step_breakdown([_job("old", "warm", "m", [{"first_step_s": 1.0}])]) is None  # older results


def test_aggregate_and_tables_show_breakdown_memory_profiler_and_ratios():
    from benchmarks.aggregate import aggregate_mode, comparisons
    from benchmarks.tables import markdown_table

    prof = {"measured": True, "median_overlap_percent": 70.0, "median_exposed_ms": 3.0, "tensor_peak_mb": 12.5}
    jobs = [
        _job(
            "t_cold", "cold", "torch_savvy", [_rank(20.0, 19.0, two_steps_s=21.0), _rank(21.0, 19.5, two_steps_s=22.0)]
        ),
        _job("t_warm", "warm", "torch_savvy", [_rank(6.0, 5.0), _rank(6.5, 5.0)]),
        _job(
            "o_cold",
            "cold",
            "ours_step_in_backward",
            [
                # its compile is at update 2: the first step is short, the second long
                _rank(8.0, 7.0, steady_peak_rss_mb=400.0, profile=prof, two_steps_s=16.0),
                _rank(9.0, 7.5, steady_peak_rss_mb=410.0, profile=prof, two_steps_s=15.0),
            ],
        ),
        _job("o_warm", "warm", "ours_step_in_backward", [_rank(2.0, 1.0), _rank(3.0, 1.0)]),
    ]
    modes = {m: aggregate_mode(jobs, m) for m in ("torch_savvy", "ours_step_in_backward")}
    ours = modes["ours_step_in_backward"]
    assert ours["first_step"]["cold"]["job_id"] == "o_cold" and ours["first_step"]["cold"]["rank"] == 1
    assert ours["steady_peak_rss_mb_per_rank"] == [400.0, 410.0]
    assert ours["profile"]["tensor_peak_mb_per_rank"] == [12.5, 12.5] and ours["profile"]["overlap_percent"] == 70.0
    [row] = comparisons(modes)
    assert row["peer"] == "torch_savvy" and row["first_step_cold_vs_peer"] == pytest.approx(9.0 / 21.0)
    assert row["first_step_warm_vs_peer"] == pytest.approx(3.0 / 6.5) and row["step_ms_vs_best_torch"] == 1.0
    assert row["warmup_compile_cold_vs_peer"] == pytest.approx(7.5 / 19.5)  # the slowest ranks' compile seconds
    assert row["two_steps_cold_vs_peer"] == pytest.approx(16.0 / 22.0)  # slowest ranks, to the end of step 2
    assert row["two_steps_warm_vs_peer"] is None  # the warm jobs' results do not have it: no ratio, no crash
    data = {
        "description": "d",
        "purpose": "p",
        "modes": modes,
        "comparisons": [row],
        "loss_agreement": {
            "ok": True,
            "tolerance": 0.1,
            "reference": "torch_savvy",
            "reference_loss": 2.0,
            "disagree": [],
            "unstable": [],
        },
    }
    text = markdown_table({"workloads": {"w": data}}, "w")
    assert "| ours_step_in_backward | cold | 9.00 | 7.50 |" in text  # breakdown row: slowest rank of the cold job
    assert "400/410" in text and "12.5/12.5" in text and "| 0.43 | 0.46 | 0.38 | 0.73 / - |" in text
    assert "| - / 70 | - / 3.0 |" in text  # no recorder in this job; the profiler's 70 % and 3.0 ms


# -- the bracket: floor and comm_only (benchmarks/bracket.py) ------------------------------------------------


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


def _fingerprint(deltas: dict) -> dict:
    import torch

    from benchmarks.checksum import param_checksum

    return param_checksum(
        {n: torch.tensor(v) for n, v in deltas.items()}, {n: torch.zeros(len(v)) for n, v in deltas.items()}
    )


def _fingerprinted(checksum, *, loss=2.0, ranks=0.0) -> dict:
    return {
        "status": "ok",
        "final_loss": loss,
        "final_loss_jobs": [loss],
        "param_checksum": checksum,
        "rank_param_distance": ranks,
        "param_checksum_jobs": [checksum],
    }


def test_the_gates_exempt_the_bracket_modes_and_the_tables_label_them():
    from benchmarks.aggregate import loss_agreement, param_agreement
    from benchmarks.bracket import bracket
    from benchmarks.tables import markdown_table

    good = _fingerprint({"w": [1.0, -2.0, 0.5]})
    own = _fingerprint({"w": [1.3, -1.6, 0.2]})  # floor: each rank followed its own gradient
    still = _fingerprint({"w": [0.0, 0.0, 0.0]})  # comm_only: trains nothing
    modes = {
        "floor": {**_fingerprinted(own, loss=2.4, ranks=0.5), "step_ms": 90.0},
        "comm_only": {**_fingerprinted(still, loss=0.0), "step_ms": 20.0},
        "eager": {**_fingerprinted(good), "step_ms": 100.0},
        "ours_step": {**_fingerprinted(good), "step_ms": 95.0},
    }
    loss = loss_agreement(modes, rtol=1e-3, atol=1e-4)
    params = param_agreement(modes, rtol=1e-5)
    assert loss["ok"] and params["ok"] and loss["exempt"] == params["exempt"] == ["floor", "comm_only"]
    assert set(params["distance"]) == {"eager", "ours_step"}
    # without the exemption the same data fails both gates: the exemption is what lets it pass
    gated = {"eager": modes["eager"], "floor_like": modes["floor"]}
    assert loss_agreement(gated, rtol=1e-3, atol=1e-4)["ok"] is False
    assert param_agreement(gated, rtol=1e-5)["ok"] is False

    for a in modes.values():
        a.update(
            step_ms_min=a["step_ms"],
            step_ms_max=a["step_ms"],
            pieces=None,
            first_step_s_warm=1.0,
            first_step_s_cold=None,
            first_step_s_smoke=None,
        )
    data = {
        "description": "d",
        "modes": modes,
        "loss_agreement": loss,
        "param_agreement": params,
        "bracket": bracket(modes),
    }
    text = markdown_table({"workloads": {"w": data}}, "w")
    assert "| floor | ok (bracket, not gated) | - | 90.0 | 90.0-90.0 | bracket | bracket |" in text
    assert "| comm_only | ok (bracket, not gated) |" in text and "n/a (no training)" in text
    assert "2.40000 (own data per rank)" in text and "**DISAGREES**" not in text
    assert "| eager | ok | - | 100.0 | 100.0-100.0 | +10.0 (+11%) | 50 |" in text
    assert text.count("Not gated: floor, comm_only (bracket modes: they do not train like eager DDP).") == 2
    assert text.index("**Bracket: floor 90.0 ms**") < text.index("| mode |")  # the bracket tops the table


def test_param_gate_loosened_for_16_bit_reductions_only_and_says_so():
    from benchmarks.aggregate import param_agreement
    from benchmarks.config import BenchConfig
    from benchmarks.tables import param_agreement_line
    from benchmarks.workloads import Workload

    ref = _fingerprint({"w": [1.0, -2.0, 0.5]})
    bf16 = _fingerprint({"w": [1.0, -2.0, 0.5 + 2e-3]})  # a 16-bit all-reduce lands ~1e-3 away
    modes = {"eager": _fingerprinted(ref), "ours_in_graph": _fingerprinted(bf16), "ours_compile": _fingerprinted(bf16)}
    cfg = BenchConfig(
        workloads=(Workload(name="w"),),
        backend="aot_eager",
        reduce_dtype="bf16",
        modes=("eager", "ours_compile", "ours_in_graph"),
    )
    assert cfg.param_tolerances() == {"ours_in_graph": 3e-2}
    got = param_agreement(modes, rtol=cfg.param_tolerance(), rtol_by_mode=cfg.param_tolerances(), loosened_because="x")
    # ours_compile reduces in fp32: the same distance fails it
    assert got["ok"] is False and [d["mode"] for d in got["disagree"]] == ["ours_compile"]
    del modes["ours_compile"]
    ok = param_agreement(modes, rtol=1e-5, rtol_by_mode={"ours_in_graph": 3e-2}, loosened_because="bf16 wire")
    assert ok["ok"] and "ours_in_graph gated at 3e-02 (bf16 wire; up to" in param_agreement_line(ok)
    assert BenchConfig(workloads=(Workload(name="w"),)).param_tolerances() == {}


# -- new flags: --link-gbit, --comm-hook, --reduce-dtype -------------------------------------------------------


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


def test_new_config_values_are_checked_naming_the_value_and_the_fix():
    from benchmarks.config import BenchConfig
    from benchmarks.workloads import Workload

    w = (Workload(name="w"),)
    for bad in (0.0, -5.0, float("nan"), float("inf"), True, 1e-7):
        with pytest.raises(ValueError, match="--link-gbit"):
            BenchConfig(workloads=w, link_gbit=bad)
    with pytest.raises(ValueError, match="comm_hook='bf16'.*CUDA"):
        BenchConfig(workloads=w, comm_hook="bf16")
    with pytest.raises(ValueError, match="changes none of the modes.*floor"):
        BenchConfig(workloads=w, modes=("floor",), comm_hook="fp16")
    with pytest.raises(ValueError, match="reduce_dtype='fp32'"):
        BenchConfig(workloads=w, reduce_dtype="fp32")
    with pytest.raises(ValueError, match="--reduce-dtype bf16 applies to.*ours_in_graph.*none of them"):
        BenchConfig(workloads=w, modes=("eager", "ours_step"), reduce_dtype="bf16")
    with pytest.raises(ValueError, match="--reduce-dtype bf16 conflicts with --comm-hook fp16"):
        BenchConfig(workloads=w, reduce_dtype="bf16", comm_hook="fp16")
    assert BenchConfig(workloads=w, reduce_dtype="fp16", comm_hook="fp16").reduce_dtype == "fp16"  # same wire


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


# -- the shaped link's availability check (benchmarks/link.py) ---------------------------------------------


def _fake_tools(folder, **scripts: str) -> str:
    """A PATH folder with shell scripts of the link's tool names (body per name; missing names: no file)."""
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return str(folder)


def test_link_check_names_every_missing_tool_and_root_in_one_line(tmp_path):
    from benchmarks.link import LinkShape, unavailable_reason

    shape = LinkShape(rate_gbit=5)
    msg = unavailable_reason(shape, path=_fake_tools(tmp_path / "bin", ip="exit 0", sh='exec /bin/sh "$@"'), euid=1000)
    assert msg.startswith("--link-gbit 5 cannot shape the link: not on PATH: unshare, nsenter, tc ")
    assert "not running as root (euid 1000)" in msg and "drop --link-gbit" in msg and "\n" not in msg
    assert "ip," not in msg.split("cannot shape the link:")[1].split("(")[0]  # ip was found
    everything = unavailable_reason(shape, path=str(tmp_path / "empty"), euid=0)
    assert "not on PATH: unshare, nsenter, ip, tc, sh" in everything and "not running as root" not in everything


def test_link_check_runs_a_trial_namespace_and_reports_why_it_failed(tmp_path):
    from benchmarks.link import LinkShape, unavailable_reason

    # every tool there, but unshare is refused (as in an unprivileged container): the trial says why
    path = _fake_tools(
        tmp_path / "bin",
        unshare="echo 'unshare: unshare failed: Operation not permitted' >&2; exit 1",
        nsenter="exit 0",
        ip="exit 0",
        tc="exit 0",
        sh='exec /bin/sh "$@"',
    )
    msg = unavailable_reason(LinkShape(rate_gbit=5), path=path, euid=0)
    assert "the trial namespace failed" in msg and "Operation not permitted" in msg and "code 1" in msg


def test_link_unavailable_exits_2_with_one_error_before_any_job(monkeypatch, capsys, tmp_path):
    from benchmarks import cli, link, suite

    monkeypatch.setenv("PATH", str(tmp_path))  # none of unshare, nsenter, ip, tc, sh
    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: pytest.fail("a job ran on an unavailable link"))
    assert link.find_tools()[1] == list(link.TOOLS)
    assert cli.main(["--smoke", "--no-plot", "--link-gbit", "5", "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--link-gbit 5 cannot shape the link: not on PATH: unshare" in err


def test_shaped_namespace_shapes_lo_and_leaves_nothing_behind():
    import os
    import subprocess

    from benchmarks.link import LinkShape, ShapedNamespace, unavailable_reason

    shape = LinkShape(rate_gbit=5)
    why = unavailable_reason(shape)
    if why:
        pytest.skip(f"needs root, unshare, nsenter, ip and tc: {why}")
    with ShapedNamespace(shape) as ns:
        inside = subprocess.run(
            [*ns.prefix(), "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True
        ).stdout
        links = subprocess.run([*ns.prefix(), "ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        holder = ns.prefix()[1].split("/")[2]
    assert "tbf" in inside and "rate 5Gbit" in inside
    assert [line.split(": ")[1] for line in links.splitlines()] == ["lo"]  # a fresh namespace: lo only
    outside = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout
    assert "tbf" not in outside  # the machine's own loopback was never touched
    assert not os.path.exists(f"/proc/{holder}")  # the holder is gone, and with it the namespace


def test_the_steady_peak_cell_shows_what_the_steps_added():
    from benchmarks.tables import _steady_cell

    assert _steady_cell({"steady_peak_rss_mb_per_rank": [900.0, 880.0]}) == "900/880"
    both = {"steady_peak_rss_mb_per_rank": [900.0, 880.0], "steady_growth_rss_mb_per_rank": [12.0, None]}
    assert _steady_cell(both) == "900/880 (+12/-)"
