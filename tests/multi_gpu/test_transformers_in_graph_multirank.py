"""Real model families from `transformers` (small configs, no weights) in the modes that own the
communication, on 2 ranks against eager DDP with the same options and optimizer:

* `compile(ddp="in_graph")` in a plain user loop (SGD momentum), for GPT-2 and Llama: every gradient is
  all-reduced inside the compiled backward, DDP's reducer all-reduces nothing;
* `train_step(ddp="in_graph", optimizer_in_backward=True)` (SGD momentum), for every family but Llama (whose
  in-backward run is in tests/multi_gpu/test_in_backward_multirank.py): update 1 goes through DDP's reducer
  (it creates the optimizer state), and from update 2 every parameter is updated inside the backward, right
  after its bucket's all-reduce, which the same graph pass as the plain loop's inserts. Its in-graph report is
  checked as the plain loop's is, so these families are not trained through the plain loop a second time.

Models and data come from tests/multi_gpu/test_transformers_multirank.py (rank-dependent batches);
each model's output `.logits` is squared and averaged as the loss, which needs no target, so the step
is called as `step(*inputs, target=None)`. All scenarios run in one 2-rank launch.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.multi_gpu.ddp_compare import (
    assert_close_params,
    assert_matches_eager,
    ok,
    run_scenarios,
    snapshot,
)
from tests.ranks import run_ranks, to_rank_device, wrap_ddp

pytestmark = [pytest.mark.multi_gpu, pytest.mark.timeout(600)]

pytest.importorskip("transformers", reason="needs the `transformers` package (test extra)")

from tests.multi_gpu.test_transformers_multirank import CAP_MB, MODELS, _logits_loss, _scenario, _tokens  # noqa: E402
from tests.multi_gpu.user_script import Script, assert_like_eager, run_against_eager  # noqa: E402


def _gpt2_checkpointed():
    """GPT-2 with `gradient_checkpointing_enable()` in training: its top-level forward logs a warning, a graph
    break that leaves the transformer's frame one graph and the tied head another."""
    model = MODELS["gpt2"][0]()
    model.gradient_checkpointing_enable()
    return model.train()


MODELS = {**MODELS, "gpt2_checkpointed": (_gpt2_checkpointed, MODELS["gpt2"][1])}
IN_GRAPH = ("gpt2", "llama")  # the plain loop; the other families' reduce graph is checked through IN_BACKWARD
IN_BACKWARD = ("gpt2", "bert", "t5", "vit", "resnet", "gpt2_checkpointed")  # llama: test_in_backward_multirank.py
UPDATES = 3
NOISE = 1e-4  # an update under this fraction of the largest is rounding noise (see `_update_errors`)


def _in_backward(name: str):
    make_model, make_input = MODELS[name]

    def run(rank: int) -> dict:
        import compile_core

        torch.manual_seed(0)
        model = to_rank_device(make_model())
        ref = copy.deepcopy(model)
        initial = snapshot(model)
        ours, theirs = wrap_ddp(model, bucket_cap_mb=CAP_MB), wrap_ddp(ref, bucket_cap_mb=CAP_MB)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
        step = compile_core.train_step(
            ours,
            opt,
            lambda out, _: _logits_loss(out),
            backend="aot_eager",
            ddp="in_graph",
            optimizer_in_backward=True,
        )
        losses, ref_losses = [], []
        for index in range(UPDATES):
            inputs = to_rank_device(make_input(rank, index))
            losses.append(step(*inputs, target=None).item())
            loss = _logits_loss(theirs(*inputs))
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_losses.append(loss.item())
        return {
            "params": snapshot(model),
            "ref": snapshot(ref),
            "initial": initial,
            "losses": losses,
            "ref_losses": ref_losses,
            "in_backward": step.report().to_dict()["optimizer_in_backward"],
            "report": step.report().to_dict(),
        }

    return run


def _gpt2_logging_block_norms():
    """GPT-2 with a forward hook on each block that logs the norm of its output (`.item()`, as activation
    logging does): a graph break inside the loop over the blocks, so Dynamo skips the transformer's frame and
    compiles the frames below it on their own (the embeddings' and the final LayerNorm's never read the
    step's variant: ddp/in_graph/dispatch.py)."""
    model = MODELS["gpt2"][0]()
    model.block_norms = []
    for block in model.transformer.h:
        block.register_forward_hook(lambda mod, args, out: model.block_norms.append(out[0].detach().norm().item()))
    return model


def _logging_hooks_accumulating(rank: int) -> dict:
    script = Script(
        make_model=_gpt2_logging_block_norms,
        data=lambda r, n, device: [((_tokens(r, i).to(device),), torch.zeros(1)) for i in range(n)],
        loss=lambda out, target, model, step: _logits_loss(out),
        make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        accum=2,
    )
    return run_against_eager(script, rank, how="compile", ddp="in_graph", bucket_cap_mb=CAP_MB)


def _all(rank: int, world_size: int) -> dict:
    scenarios = {f"in_graph/{name}": _scenario(name, ddp="in_graph") for name in IN_GRAPH}
    scenarios["in_graph/gpt2_logging_hooks_accumulating"] = _logging_hooks_accumulating
    scenarios.update({f"in_backward/{name}": _in_backward(name) for name in IN_BACKWARD})
    return run_scenarios(scenarios, rank)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, world_size=2, timeout=560)


def _shared_between_graphs(report: dict, variant: str) -> list[str]:
    """Parameters in the buckets of more than one `variant` graph (a layer on both sides of a graph break:
    T5's tied embedding under torch 2.11's Dynamo); each graph reduces only its own share of them."""
    seen: dict[str, int] = {}
    for g in report["graphs"]:
        if g.get("variant") == variant:
            for n in {n for b in g["buckets"] for n in b["params"]}:
                seen[n] = seen.get(n, 0) + 1
    return sorted(n for n, count in seen.items() if count > 1)


def _assert_reduced_in_the_compiled_backward(per_rank: list[dict], variant: str) -> None:
    """Each rank's report: the compiled backward all-reduced, nothing fell back, every parameter sits in one
    bucket of each `variant` graph, one that several graphs take is also averaged after the backward (its
    total gradient, as DDP averages it), and both ranks bucketed alike."""
    for rank, r in enumerate(per_rank):
        report = r["report"]
        assert report["in_graph"]["reducer"] == "compiled backward", report["in_graph"]
        assert report["in_graph"]["fallbacks"] == [] and report["fallbacks"] == [], report
        for g in report["graphs"]:
            if g.get("variant") == variant:
                names = [n for b in g["buckets"] for n in b["params"]]
                assert len(names) == len(set(names)) and names, f"rank {rank}, {g.get('name')}: {names}"
        shared = _shared_between_graphs(report, variant)
        assert set(shared) <= set(report["in_graph"]["outside_graph"]), (rank, shared, report["in_graph"])
    assert [g["buckets"] for g in per_rank[0]["report"]["graphs"]] == [
        g["buckets"] for g in per_rank[1]["report"]["graphs"]
    ]


@pytest.mark.parametrize("name", IN_GRAPH)
def test_model_family_is_reduced_inside_its_compiled_backward_like_eager_ddp(results, name):
    per_rank = ok(results, f"in_graph/{name}")
    assert_matches_eager(per_rank, rtol=1e-4, atol=1e-5, update_rtol=1e-3, noise=NOISE)
    for rank, r in enumerate(per_rank):
        assert all(step["ddp_reducer"] == 0 for step in r["reduced"]), f"rank {rank}: DDP's reducer ran"
    _assert_reduced_in_the_compiled_backward(per_rank, "reduce")


def _update_errors(r: dict) -> dict[str, float]:
    """Per parameter: distance from eager's parameter relative to eager's update, for parameters whose
    update is more than noise. An attention key bias has an exactly zero true gradient (softmax ignores
    a score shift shared by all keys): its compiled and eager updates are rounding noise (~1e-9 of the
    others), and their ratio says nothing."""
    moved = {n: (r["ref"][n].double() - r["initial"][n].double()).norm().item() for n in r["ref"]}
    largest = max(moved.values())
    return {
        n: ((r["params"][n].double() - r["ref"][n].double()).norm() / moved[n]).item()
        for n in r["ref"]
        if moved[n] > NOISE * largest
    }


@pytest.mark.parametrize("name", IN_BACKWARD)
def test_model_family_updates_inside_the_backward_like_eager_ddp(results, name):
    per_rank = ok(results, f"in_backward/{name}")
    for rank, r in enumerate(per_rank):
        errors = _update_errors(r)
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-3, f"rank {rank}: {worst}'s update differs from eager DDP's by {errors[worst]:.2e}"
        assert len(errors) > len(r["ref"]) // 2, f"rank {rank}: most parameters barely moved: {sorted(errors)}"
        assert_close_params(r["params"], r["ref"], rtol=1e-4, atol=1e-5, what=f"rank {rank} vs eager DDP:")
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-7)
    assert per_rank[0]["losses"][0] != per_rank[1]["losses"][0], "the ranks saw the same data"
    for name_ in per_rank[0]["params"]:
        assert torch.equal(per_rank[0]["params"][name_], per_rank[1]["params"][name_]), f"{name_} differs between ranks"
    _assert_reduced_in_the_compiled_backward(per_rank, "reduce_update")
    for r in per_rank:
        report = r["in_backward"]
        assert report["active"] and report["reason"] is None, report
        assert report["updates_in_backward"] == UPDATES - 1, report  # update 1 creates the state
        # A parameter two graphs take gets a share of its gradient from each backward: the normal step updates
        # it (none on torch 2.13, where every family here is one graph).
        assert report["not_updated_in_backward"] == _shared_between_graphs(r["report"], "reduce_update"), report


def test_activation_logging_hooks_with_accumulation_keep_the_reduction_in_the_backward(results):
    """Only the tied embedding (a graph's and the head's) is reduced after the backward, as DDP averages its total.
    Before: the position embedding and the final LayerNorm too (`nn.Embedding.forward`'s and
    `nn.LayerNorm.forward`'s frames, compiled under the first, `no_sync()` forward, kept their local graphs)."""
    per_rank = ok(results, "in_graph/gpt2_logging_hooks_accumulating")
    assert_like_eager(per_rank, rtol=1e-4, atol=1e-5)
    after = ["transformer.wte.weight"]
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        # torch 2.11's Dynamo compiles no frame below the one it skipped: those layers run eagerly
        after += ["transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    for r in per_rank:
        assert r["report"]["in_graph"]["leftovers_last_step"] == after, r["report"]["in_graph"]
