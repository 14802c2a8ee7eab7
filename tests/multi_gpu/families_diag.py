"""Where a model family's compiled training leaves eager DDP's, parameter by parameter (a diagnostic, not a
test): `python -m tests.multi_gpu.families_diag [bert vit ...]`, with `DDP_COMPILE_TEST_DEVICE=cuda` for
2 gloo ranks over CUDA tensors on one GPU.

Each family trains 3 SGD steps (the settings of `test_transformers_in_graph_multirank.py`) as
`compile(ddp="in_graph")` and as `compile(ddp="none")` (the same one AOT graph, reduced by DDP's reducer
after the backward), each beside its eager DDP twin. Per parameter it prints how far each run ended from
eager, relative to eager's own update, and how far the two compiled runs ended from each other: when
`in_graph` and `none` agree and both leave eager by the same amount, the difference is the compiled
arithmetic on that device, not the in-graph reduction. Parameters whose update is rounding noise (moved
less than `NOISE` of the largest update) are listed apart.
"""

from __future__ import annotations

import sys

import torch

from tests.multi_gpu.ddp_compare import run_scenarios, train_against_eager
from tests.ranks import run_ranks

NOISE = 1e-4


def _family(name: str, ddp: str):
    from tests.multi_gpu.test_transformers_multirank import CAP_MB, MODELS, _logits_loss

    make_model, make_input = MODELS[name]

    def run(rank: int) -> dict:
        r = train_against_eager(
            make_model,
            lambda step: make_input(rank, step),
            loss_fn=_logits_loss,
            ddp_kwargs={"bucket_cap_mb": CAP_MB},
            backend="aot_eager",
            ddp=ddp,
        )
        return {k: r[k] for k in ("params", "ref", "initial", "losses", "ref_losses")}

    return run


def _all(rank: int, world_size: int, names: list[str]) -> dict:
    return run_scenarios({f"{n}/{ddp}": _family(n, ddp) for n in names for ddp in ("in_graph", "none")}, rank)


def _relative(a: dict, b: dict, ref: dict, initial: dict) -> dict[str, tuple[float, float]]:
    """Per parameter: (|a - b| / |ref - initial|, |ref - initial|)."""
    out = {}
    for n in ref:
        moved = (ref[n].double() - initial[n].double()).norm().item()
        out[n] = ((a[n].double() - b[n].double()).norm().item() / max(moved, 1e-300), moved)
    return out


def _worst(errors: dict[str, tuple[float, float]], floor: float, k: int = 3) -> str:
    kept = sorted(((e, n) for n, (e, m) in errors.items() if m >= floor), reverse=True)[:k]
    return ", ".join(f"{n} {e:.2e}" for e, n in kept) or "-"


def main(names: list[str]) -> int:
    results = run_ranks(_all, names, world_size=2, timeout=900)
    for name in names:
        for rank, per_rank in enumerate(results):
            graph, none = per_rank[f"{name}/in_graph"], per_rank[f"{name}/none"]
            if "error" in graph or "error" in none:
                print(f"{name} rank {rank}: raised\n{graph.get('error', '')}{none.get('error', '')}")
                continue
            ref, initial = graph["ref"], graph["initial"]
            largest = max((ref[n].double() - initial[n].double()).norm().item() for n in ref)
            floor = NOISE * largest
            vs_eager = _relative(graph["params"], ref, ref, initial)
            none_vs_eager = _relative(none["params"], none["ref"], none["ref"], none["initial"])
            vs_none = _relative(graph["params"], none["params"], ref, initial)
            eager_twice = _relative(ref, none["ref"], ref, initial)
            noise = sorted(n for n, (_, m) in vs_eager.items() if m < floor)
            head = f"== {name} rank {rank}: largest update {largest:.3g};"
            print(f"{head} {len(noise)} below {floor:.2g} (noise): {noise[:3]}")
            print(f"   in_graph vs eager : {_worst(vs_eager, floor)}")
            print(f"   none     vs eager : {_worst(none_vs_eager, floor)}")
            print(f"   in_graph vs none  : {_worst(vs_none, floor)}")
            print(f"   eager vs eager    : {_worst(eager_twice, floor)}")
            print(f"   with noise params : in_graph vs eager {_worst(vs_eager, 0.0, 1)}")
            print(f"   losses ours {graph['losses']} eager {graph['ref_losses']}")
        same = all(
            torch.equal(results[0][f"{name}/in_graph"]["params"][n], results[1][f"{name}/in_graph"]["params"][n])
            for n in results[0][f"{name}/in_graph"].get("params", {})
        )
        print(f"   {name}: in_graph ranks hold identical parameters: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["bert", "vit", "resnet", "gpt2"]))
