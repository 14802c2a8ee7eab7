"""Lightning Trainer and Fabric on 2 CPU ranks, launched the way Lightning launches (its `ddp` script
launcher re-runs the example): DDPCompileStrategy / FabricDDPCompileStrategy against Lightning's own
`ddp` strategy without compile, same seed, same optimizer, rank-dependent data (DistributedSampler).

Each job runs the example a user reads (examples/lightning_train.py, examples/fabric_train.py) for 3
SGD steps and saves both ranks' parameters, the compile report and a checkpoint; the tests compare them.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.multi_gpu.ddp_compare import assert_accumulation_reduced_in_graph
from tests.multi_gpu.script_jobs import assert_ok, example, run_script_job

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(600)]

pytest.importorskip("lightning", reason='needs the [lightning] extra: pip install -e ".[lightning]"')

STEPS = 3
JOB_TIMEOUT_S = 240
COMPILED = ("--backend", "aot_eager", "--steps", str(STEPS))
# Two micro-batches per optimizer step (DDP's no_sync() under Lightning's accumulation), and
# Lightning's order: training_step (the forward), then zero_grad, then the backward.
TRAINER_RUNS = {
    "ddp_acc2": ("--strategy", "ddp", "--steps", str(STEPS), "--accumulate", "2"),
    "split": (*COMPILED, "--ddp-mode", "split", "--accumulate", "2"),
    "in_graph": (*COMPILED, "--ddp-mode", "in_graph", "--accumulate", "2"),
}
BASELINE = {"split": "ddp_acc2", "in_graph": "ddp_acc2"}
FABRIC_RUNS = {"ddp": ("--strategy", "ddp", "--steps", str(STEPS)), "split": (*COMPILED, "--ddp-mode", "split")}


def _run_all(script: str, runs: dict, out) -> dict:
    results = {}
    for name, args in runs.items():
        result = run_script_job(
            [*example(script), *args, "--out", str(out / name)], prefix=f"lightning_{name}", timeout=JOB_TIMEOUT_S
        )
        results[name] = {"out": out / name, "log": assert_ok(result)}
    return results


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    return _run_all("lightning_train.py", TRAINER_RUNS, tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    return _run_all("fabric_train.py", FABRIC_RUNS, tmp_path_factory.mktemp("fabric"))


def _params(run: dict, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run["out"] / f"params_rank{rank}.pt")


def assert_same_training(ours: dict, theirs: dict) -> None:
    """Both ranks' parameters after STEPS steps equal the reference run's; ranks agree with each other."""
    for rank in (0, 1):
        mine, ref = _params(ours, rank), _params(theirs, rank)
        assert mine.keys() == ref.keys()
        for name in ref:
            torch.testing.assert_close(mine[name], ref[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    for name, p in _params(ours, 0).items():
        assert torch.equal(p, _params(ours, 1)[name]), f"{name} differs between ranks"


def _report(run: dict) -> dict:
    return json.loads((run["out"] / "report.json").read_text())


def _bucket_names(report: dict) -> set[str]:
    return {name for g in report["graphs"] for b in g["buckets"] for name in b["params"]}


def assert_report_logged_once(log: str, where: str) -> None:
    """Exactly one summary line (so on one rank, once), followed by the report itself."""
    lines = log.splitlines()
    summary = f"compile_core: first training step done under {where}:"
    hits = [i for i, line in enumerate(lines) if line.startswith(summary)]
    assert len(hits) == 1, f"expected the first-step summary once, found {len(hits)}:\n{log[-4000:]}"
    assert lines[hits[0] + 1].startswith("compile report: "), lines[hits[0] : hits[0] + 3]


# ---- Trainer --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_trainer_strategy_trains_like_lightning_ddp(trainer_runs, mode):
    assert_same_training(trainer_runs[mode], trainer_runs[BASELINE[mode]])
    report = _report(trainer_runs[mode])
    assert (report["ddp_mode"], report["backend"]) == (mode, "aot_eager")
    # The graphs of training_step up to Lightning's self.log (a graph break); the rest is tiny.
    if mode == "split":
        assert max(g["pieces"] for g in report["graphs"]) >= 3, report["graphs"]
        assert report["alignment"]["status"] == "aligned", report["alignment"]
    else:  # one piece per graph; at the sync micro-batch the main graph all-reduces several buckets
        # inside its backward, the accumulated gradients with its own (the no_sync micro-batch compiled the
        # local variant first), so nothing of the main graph is reduced again after the backward
        assert {g["pieces"] for g in report["graphs"]} == {1}, report["graphs"]
        assert_accumulation_reduced_in_graph(report)


@pytest.mark.parametrize("mode", ["split", "in_graph"])
def test_trainer_strategy_logs_its_report_once(trainer_runs, mode):
    assert_report_logged_once(trainer_runs[mode]["log"], "DDPCompileStrategy")


def test_trainer_checkpoint_has_lightning_format_and_loads_into_a_plain_module(trainer_runs):
    from examples.lightning_train import LitGPT

    ours = torch.load(trainer_runs["split"]["out"] / "model.ckpt", weights_only=False)
    theirs = torch.load(trainer_runs["ddp_acc2"]["out"] / "model.ckpt", weights_only=False)
    assert sorted(ours) == sorted(theirs)
    assert list(ours["state_dict"]) == list(theirs["state_dict"])
    assert not [k for k in ours["state_dict"] if "_orig_mod" in k or "lightning_module" in k]
    assert ours["global_step"] == theirs["global_step"] == STEPS
    # The report names parameters as the user does: the checkpoint's own keys.
    assert _bucket_names(_report(trainer_runs["split"])) <= set(ours["state_dict"])

    plain = LitGPT.load_from_checkpoint(trainer_runs["split"]["out"] / "model.ckpt", map_location="cpu")
    trained = _params(trainer_runs["split"], 0)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name


# ---- Fabric ---------------------------------------------------------------------------------------


def test_fabric_strategy_trains_like_fabric_ddp(fabric_runs):
    assert_same_training(fabric_runs["split"], fabric_runs["ddp"])
    report = _report(fabric_runs["split"])
    assert report["ddp_mode"] == "split" and report["graphs"][0]["pieces"] >= 3, report["graphs"]
    assert report["alignment"]["status"] == "aligned", report["alignment"]
    assert_report_logged_once(fabric_runs["split"]["log"], "FabricDDPCompileStrategy")


def test_fabric_checkpoint_keys_are_unchanged(fabric_runs):
    ours = torch.load(fabric_runs["split"]["out"] / "model.ckpt", weights_only=False)
    theirs = torch.load(fabric_runs["ddp"]["out"] / "model.ckpt", weights_only=False)
    assert list(ours["model"]) == list(theirs["model"])
    assert not [k for k in ours["model"] if re.search(r"_orig_mod|^module\.", k)]
    assert _bucket_names(_report(fabric_runs["split"])) <= set(ours["model"])
    for name, p in _params(fabric_runs["split"], 0).items():
        assert torch.equal(ours["model"][name], p), name
