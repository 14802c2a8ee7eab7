"""A real script's loop (nanoGPT's `train.py`, in tests/multi_gpu/real_script.py) with its one compile line
changed to ours trains exactly what the eager script trains, in every `ddp=` mode and `train_step` variant.

What it checks beyond the parameters: the object the compile line returns is the DDP object (`.module` is
the user's model, with its methods; checkpoint keys are the eager script's), the accumulation flag the
script writes on it reaches DDP (gradients after a micro-batch that does not synchronise stay local, as
in the eager script), and evaluation that only rank 0 runs, with or without gradients, never makes a rank
wait. All scenarios run in one 2-rank launch (module-scoped fixture).
"""

from __future__ import annotations

import pytest
import torch

from tests.multi_gpu.ddp_compare import ok, run_scenarios
from tests.multi_gpu.real_script import Loop, compiled_run
from tests.ranks import run_ranks

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(600)]

EVAL_FIRST = Loop()  # rank 0 alone evaluates before update 1 and before update 3
UNEVEN = Loop(eval_batches=(3, 1), grad_probe_at=1)  # both evaluate, unevenly; rank 0 probes with gradients
# rank 0 alone validates under inference_mode before every update: the first forward after update 1 is one of them
INFERENCE = Loop(eval_interval=1, eval_under="inference_mode")
# nanoGPT's compile=True: the script torch.compiles its model before DDP wraps it; without clipping, update 1 of
# the in-backward step runs eagerly, so it is the one that would call the script's own compile
TORCH_COMPILED = Loop(iters=5, eval_batches=(3, 1), torch_compiled="wrapper", clip=None)
MODULE_COMPILED = Loop(iters=5, eval_batches=(3, 1), torch_compiled="in_place", clip=None)
# static_graph: after update 1 rank 0 alone runs a forward with gradients and the sync flag on, no backward (the
# reducer swap waits for a synchronising forward there, and this one is rank 0's alone)
STATIC_PROBE = Loop(iters=5, accum=1, static_graph=True, grad_probe_at=1, grad_probe_syncs=True)

SCENARIOS = {
    "split": lambda r: compiled_run(r, EVAL_FIRST, "compile", ddp="split", bucket_cap_mb=0.01),
    "split_uneven": lambda r: compiled_run(r, UNEVEN, "compile", ddp="split", bucket_cap_mb=0.01),
    "split_inference": lambda r: compiled_run(r, INFERENCE, "compile", ddp="split", bucket_cap_mb=0.01),
    "in_graph": lambda r: compiled_run(r, EVAL_FIRST, "compile", ddp="in_graph", bucket_cap_mb=0.01),
    "in_graph_uneven": lambda r: compiled_run(r, UNEVEN, "compile", ddp="in_graph", bucket_cap_mb=0.01),
    "none": lambda r: compiled_run(r, EVAL_FIRST, "compile", ddp="none"),
    "torch": lambda r: compiled_run(r, EVAL_FIRST, "compile", ddp="torch"),
    "train_step_split": lambda r: compiled_run(r, EVAL_FIRST, "train_step", ddp="split", bucket_cap_mb=0.01),
    "train_step_in_graph": lambda r: compiled_run(r, UNEVEN, "train_step", ddp="in_graph", bucket_cap_mb=0.01),
    "train_step_in_backward": lambda r: compiled_run(
        r, Loop(iters=5, eval_batches=(3, 1), grad_probe_at=2), "train_step", ddp="in_graph", optimizer_in_backward=True
    ),
    "split_torch_compiled": lambda r: compiled_run(r, TORCH_COMPILED, "compile", ddp="split", bucket_cap_mb=0.01),
    "train_step_in_backward_torch_compiled": lambda r: compiled_run(
        r, TORCH_COMPILED, "train_step", ddp="in_graph", optimizer_in_backward=True
    ),
    "in_graph_module_compiled": lambda r: compiled_run(r, MODULE_COMPILED, "compile", ddp="in_graph"),
    "split_static_graph_probe": lambda r: compiled_run(r, STATIC_PROBE, "compile", ddp="split", bucket_cap_mb=0.01),
    "in_graph_static_graph_probe": lambda r: compiled_run(
        r, STATIC_PROBE, "compile", ddp="in_graph", bucket_cap_mb=0.01
    ),
}


def _rank_fn(rank: int, world_size: int) -> dict:
    return run_scenarios(SCENARIOS, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank_fn, timeout=540)


def _check(results, name: str, *, local_grads: bool = True) -> dict:
    per_rank = ok(results, name)
    for rank, r in enumerate(per_rank):
        ours, eager = r["ours"], r["eager"]
        assert ours["is_ddp"] and ours["module_is_raw"], f"rank {rank}: the compile line did not return the DDP model"
        for key, value in eager["params"].items():
            torch.testing.assert_close(
                ours["params"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}"
            )
        torch.testing.assert_close(ours["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["evals"], eager["evals"], rtol=1e-5, atol=1e-6)
        assert ours["mfu"] == eager["mfu"]
        assert ours["checkpoint_keys"] == eager["checkpoint_keys"], f"rank {rank}: checkpoint keys differ"
        if "probe" in eager:
            assert ours["probe"] == pytest.approx(eager["probe"], rel=1e-5)
        if local_grads:
            # After a micro-batch with require_backward_grad_sync=False: the rank's own gradient, as eager.
            assert len(ours["local_fingerprints"]) == len(eager["local_fingerprints"]) > 0
            torch.testing.assert_close(ours["local_fingerprints"], eager["local_fingerprints"], rtol=1e-5, atol=1e-6)
    for rank, r in enumerate(per_rank):
        # an evaluation graph only rank 0 compiled is no difference between the ranks that matters
        assert r["ours"]["report"]["rank_differences"] == [], (rank, r["ours"]["report"]["rank_differences"])
    keys = per_rank[0]["ours"]["checkpoint_keys"]  # equal to the eager script's (above): `_orig_mod.` only there
    assert keys and not any(k.startswith("module.") for k in keys), keys[:3]
    e0, e1 = per_rank[0]["eager"], per_rank[1]["eager"]
    assert e0["losses"][0] != e1["losses"][0], "both ranks saw the same data: a missing reduction would not show"
    if local_grads:
        assert e0["local_fingerprints"][0] != e1["local_fingerprints"][0], "local gradients equal on both ranks"
    for key in e0["params"]:
        assert torch.equal(per_rank[0]["ours"]["params"][key], per_rank[1]["ours"]["params"][key]), key
    return per_rank[0]["ours"]["report"]


@pytest.mark.parametrize("name", ["split", "split_uneven", "split_inference"])
def test_split_trains_the_script_like_eager_and_aligns_after_rank0_evaluation(results, name):
    report = _check(results, name)
    assert report["alignment"]["status"] == "aligned", report["alignment"]


@pytest.mark.parametrize("name", ["in_graph", "in_graph_uneven"])
def test_in_graph_trains_the_script_like_eager_with_its_accumulation_flag(results, name):
    report = _check(results, name)
    assert report["in_graph"]["reducer"] == "compiled backward", report["in_graph"]


@pytest.mark.parametrize("name", ["none", "torch"])
def test_whole_and_torch_modes_train_the_script_like_eager(results, name):
    _check(results, name)


@pytest.mark.parametrize("name", ["train_step_split", "train_step_in_graph"])
def test_train_step_trains_the_script_like_eager(results, name):
    _check(results, name, local_grads=False)


def test_train_step_with_the_update_in_the_backward_trains_the_script_like_eager(results):
    _check(results, "train_step_in_backward", local_grads=False)
    for r in ok(results, "train_step_in_backward"):
        in_backward = r["ours"]["step_report"]["optimizer_in_backward"]
        assert in_backward["active"] and in_backward["updates_in_backward"] >= 3, in_backward


@pytest.mark.parametrize(
    "name", ["split_torch_compiled", "train_step_in_backward_torch_compiled", "in_graph_module_compiled"]
)
def test_a_model_the_script_torch_compiled_before_ddp_is_compiled_by_us_alone(results, name):
    """nanoGPT's `compile=True`: DDP wraps `torch.compile(model)` (or a model after `model.compile()`). We
    compile the model in its place (the script's backend never runs, not even in the in-backward step's eager
    update 1), train it like the eager script (whose compile did run), and say so in the report."""
    report = _check(results, name, local_grads="train_step" not in name)
    for r in ok(results, name):
        assert r["eager"]["script_compiles"] > 0, "the script's own torch.compile never ran in the eager script"
        compiled = r["ours"]["script_compiles"]
        assert compiled == 0, f"{compiled} graphs compiled by the script's backend"
    how = "compiled by module.compile()" if "module" in name else "torch.compile's wrapper of TinyGPT"
    assert any(how in note for note in report["notes"]), report["notes"]


@pytest.mark.parametrize("name", ["split_static_graph_probe", "in_graph_static_graph_probe"])
def test_a_static_graph_script_whose_rank0_probes_with_gradients_alone_trains_like_eager(results, name):
    """With static_graph=True our reducer is swapped in at a synchronising forward, and our buckets cut (a
    broadcast) only after its first backward: rank 0's lone forward with gradients after update 1 is a
    synchronising forward of that rank alone. Until the cut waited for that backward, ddp="split" hung there."""
    report = _check(results, name, local_grads=False)
    if name.startswith("split"):
        assert report["alignment"]["status"] == "aligned", report["alignment"]
