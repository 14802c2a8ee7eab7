"""Shared by the 2-rank tests: run many scenarios in one launch, record what DDP really reduced, compare.

Spawning ranks costs seconds (a torch import per rank on 2 cores), so a test module runs all of its
scenarios in ONE launch: `run_scenarios` runs them one after the other on every rank and returns
{name: result}; a module-scoped fixture keeps the results and one small test per scenario asserts on
its entry. A scenario that raises is recorded with its traceback and the remaining ones are skipped
(the ranks may be out of step in their collectives after that), so one failure never hangs the launch.

Every numerical check compares with EAGER DDP trained in the same processes on the same data; the data
depend on the rank, so a bucket that is not reduced (or reduced with the wrong scale) changes the
numbers, and `assert_reduced_once` catches a bucket reduced twice (which averaging would hide).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp.torch_ddp import reducer_bucket_elements
from tests.ranks import to_rank_device, wrap_ddp

# -- inside the ranks ---------------------------------------------------------------------------------


def run_scenarios(
    scenarios: dict[str, Callable[[int], dict]], rank: int, names: tuple[str, ...] | None = None
) -> dict[str, dict]:
    """Run the named scenarios (default: every one) in their dict's order on this rank; {name: result or
    {"error": traceback}}."""
    results: dict[str, dict] = {}
    failed = None
    for name, fn in scenarios.items():
        if names is not None and name not in names:
            continue
        if failed is not None:
            results[name] = {"error": f"not run: scenario {failed!r} raised before it on rank {rank}"}
            continue
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            results[name] = fn(rank)
            results[name]["seconds"] = time.perf_counter() - start
        except Exception:  # noqa: BLE001 - recorded for the test of that scenario
            results[name] = {"error": f"rank {rank}, scenario {name!r}:\n{traceback.format_exc()}"}
            failed = name
    torch._dynamo.reset()
    return results


def selected_scenarios(request: Any, scenarios: dict[str, Any]) -> tuple[str, ...]:
    """The scenarios a module-scoped launch must run for the tests this session selected from its module.

    Every scenario, unless each selected test of the module names the ones it reads with
    `@pytest.mark.scenarios(...)`: then only those. So `pytest -m compat` (one test of a module) or `-k`
    pays for the scenarios it checks, not for the module's whole launch. `request` is the fixture's.
    """
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        marker = item.get_closest_marker("scenarios")
        if marker is None:
            return tuple(scenarios)
        wanted.update(marker.args)
    unknown = sorted(wanted - set(scenarios))
    if unknown:
        raise ValueError(f"@pytest.mark.scenarios names {unknown}, which {request.module.__name__} does not define")
    return tuple(n for n in scenarios if n in wanted)


class BucketLog:
    """Comm-hook state: the buckets DDP hands to the hook, per backward (parameter names, user names).

    The hook (`logging_allreduce`) does what DDP's default hook does (divide by the world size, then
    all-reduce), so the numbers are DDP's own; it only writes down which bucket went when.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.steps: list[list[tuple[int, list[str]]]] = []

    def new_step(self) -> None:
        """Call before each backward (each micro-batch): its buckets are listed under a new entry."""
        self.steps.append([])

    def attach(self, ddp: DDP) -> "BucketLog":
        ddp.register_comm_hook(self, logging_allreduce)
        return self


class CollectiveLog:
    """Per step, from torch.profiler: how many gloo/nccl all-reduces ran and whether DDP's reducer did any
    bucket work (its `torch.distributed.ddp.reducer::` events).

    For ddp="in_graph", where a comm hook would be the user's code and change what runs, this proves
    the reducer idled without registering anything on the DDP object.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []

    @contextlib.contextmanager
    def step(self):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield
        names = [e.name for e in prof.events()]
        self.steps.append(
            {
                "all_reduces": sum(1 for n in names if n in ("gloo:all_reduce", "nccl:all_reduce")),
                "ddp_reducer": sum(1 for n in names if n.startswith("torch.distributed.ddp.reducer::")),
            }
        )


def logging_allreduce(state: BucketLog, bucket):
    state.steps[-1].append((bucket.index(), [state.names[id(p)] for p in bucket.parameters()]))
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def train_against_eager(
    make_model: Callable[[], torch.nn.Module],
    make_input: Callable[[int], tuple],
    *,
    steps: int = 3,
    ddp_kwargs: dict | None = None,
    ignore: tuple[str, ...] = (),
    call_ddp_directly: bool = False,
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.float().square().mean(),
    extra_refs: dict[str, Callable[[], torch.nn.Module]] | None = None,
    **compile_kwargs: Any,
) -> dict:
    """Train compiled DDP and eager DDP (same init, same rank-dependent data, SGD momentum) side by side.

    Models and inputs go to the rank's device (`to_rank_device`); `make_model` and `make_input` build
    them on the CPU. `extra_refs`: more eager DDP models trained the same way from the same init (e.g. an
    fp32 variant of an autocast model), to show what a wrong compile would have looked like; their params
    come back too.
    """
    import compile_core

    torch.manual_seed(0)
    model = to_rank_device(make_model())
    ref = copy.deepcopy(model)
    others = {}
    for name, make in (extra_refs or {}).items():
        other = to_rank_device(make())
        other.load_state_dict(model.state_dict())
        others[name] = other
    for m in (model, ref, *others.values()):
        if ignore:
            DDP._set_params_and_buffers_to_ignore_for_model(m, list(ignore))
    ours = wrap_ddp(model, **(ddp_kwargs or {}))
    theirs = wrap_ddp(ref, **(ddp_kwargs or {}))
    other_ddps = {n: wrap_ddp(m, **(ddp_kwargs or {})) for n, m in others.items()}
    in_graph = compile_kwargs.get("ddp") == "in_graph"  # a comm hook would change what in_graph runs
    log = CollectiveLog() if in_graph else BucketLog(model).attach(ours)
    compiled = compile_core.compile(ours, **compile_kwargs)
    forward = ours if call_ddp_directly else compiled
    initial = snapshot(model)

    def sgd(m):
        return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    opts = {"ours": sgd(model), "ref": sgd(ref), **{n: sgd(m) for n, m in others.items()}}
    runs = {"ours": forward, "ref": theirs, **other_ddps}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(steps):
        inputs = to_rank_device(make_input(step))
        for key, run in runs.items():
            watch = contextlib.nullcontext()
            if key == "ours":
                watch = log.step() if in_graph else contextlib.nullcontext()
                if not in_graph:
                    log.new_step()
            with watch:
                loss = loss_fn(run(*inputs))
                loss.backward()
            if key == "ours":
                grad_storage = _grad_storage_groups(model)
            opts[key].step()
            opts[key].zero_grad(set_to_none=True)
            losses[key].append(loss.item())
    return {
        "params": snapshot(model),
        "ref": snapshot(ref),
        "others": {n: snapshot(m) for n, m in others.items()},
        "initial": initial,
        "buffers": buffers(model),
        "ref_buffers": buffers(ref),
        "losses": losses["ours"],
        "ref_losses": losses["ref"],
        "report": compiled.report().to_dict(),
        "reduced": log.steps,
        "expected_reduced": sorted(n for n, p in model.named_parameters() if p.requires_grad and n not in ignore),
        "grad_storage": grad_storage,
        "ddp_bucket_elements": reducer_bucket_elements(ours),
    }


def _grad_storage_groups(model: torch.nn.Module) -> list[list[str]]:
    """Parameters whose .grad share one storage (a DDP bucket with gradient_as_bucket_view), sorted."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.untyped_storage().data_ptr(), []).append(name)
    return sorted(sorted(g) for g in groups.values())


# -- in the test process --------------------------------------------------------------------------------


def ok(results: list[dict], name: str) -> list[dict]:
    """The scenario's per-rank results; fails the test with the rank's traceback if it raised."""
    out = []
    for rank_results in results:
        if name not in rank_results:
            raise AssertionError(
                f"scenario {name!r} did not run in this launch (ran: {sorted(rank_results)}): "
                f"name it in the test's @pytest.mark.scenarios(...)"
            )
        r = rank_results[name]
        if "error" in r:
            raise AssertionError(r["error"])
        out.append(r)
    return out


def assert_close_params(got: dict, want: dict, *, rtol: float, atol: float, what: str) -> None:
    assert list(got) == list(want), f"{what}: parameter names differ"
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def assert_matches_eager(
    per_rank: list[dict],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    update_rtol: float = 1e-4,
    not_reduced=(),
    noise: float = 0.0,
) -> None:
    """Each rank equals its eager DDP reference (parameters within rtol/atol, and the training update
    within `update_rtol` of eager's update), training moved the parameters well beyond the tolerance,
    the ranks hold identical parameters (except `not_reduced` ones), and the data really differed per
    rank (so a missing reduction would have shown). `noise`: see `update_rel_err`."""
    for rank, r in enumerate(per_rank):
        err = update_rel_err(r["params"], r["ref"], r["initial"], noise=noise)
        assert err < update_rtol, f"rank {rank}: update differs from eager DDP's by {err:.2e} of its size"
        assert_close_params(r["params"], r["ref"], rtol=rtol, atol=atol, what=f"rank {rank} vs eager DDP:")
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=rtol, atol=atol)
        moved = max((r["params"][n] - r["initial"][n]).abs().max().item() for n in r["params"])
        assert moved > 100 * atol, f"rank {rank}: training barely moved the parameters ({moved:.2e})"
    r0, r1 = per_rank[0], per_rank[1]
    assert r0["losses"][0] != r1["losses"][0], "both ranks saw the same data: a missing all-reduce would not show"
    for name in r0["params"]:
        same = torch.equal(r0["params"][name], r1["params"][name])
        if name in not_reduced:
            assert not same, f"{name} is not reduced by DDP, yet the ranks agree: the data did not differ"
        else:
            assert same, f"{name} differs between ranks: a bucket was not reduced (or not everywhere)"


def pieces_and_buckets(report: dict) -> list[tuple[int, list[list[str]]]]:
    return [(g["pieces"], [b["params"] for b in g["buckets"]]) for g in report["graphs"]]


def assert_same_compile_on_every_rank(per_rank: list[dict], *, min_pieces: int = 3) -> None:
    compiled = [pieces_and_buckets(r["report"]) for r in per_rank]
    assert all(c == compiled[0] for c in compiled), f"ranks compiled different pieces: {compiled}"
    total = sum(p for p, _ in compiled[0])
    assert total >= min_pieces, f"only {total} piece(s): the scenario does not exercise splitting"


def planned_buckets(report: dict) -> list[list[str]]:
    """Our pieces' parameters in DDP's (backward) order: the last graph's backward runs first."""
    return [b["params"] for g in reversed(report["graphs"]) for b in g["buckets"] if b["params"]]


def assert_reduced_once(per_rank: list[dict]) -> None:
    """In every backward, every parameter DDP should reduce went through exactly one bucket."""
    for rank, r in enumerate(per_rank):
        for step, buckets in enumerate(r["reduced"]):
            counts = collections.Counter(n for _, names in buckets for n in names)
            twice = sorted(n for n, c in counts.items() if c > 1)
            assert not twice, f"rank {rank} step {step}: reduced more than once: {twice}"
            assert sorted(counts) == r["expected_reduced"], (
                f"rank {rank} step {step}: reduced {sorted(counts)}, DDP should reduce {r['expected_reduced']}"
            )
            assert [i for i, _ in buckets] == list(range(len(buckets))), f"rank {rank} step {step}: bucket order"


def assert_accumulation_reduced_in_graph(report: dict) -> None:
    """ddp="in_graph" in a loop with no_sync accumulation: the synchronising micro-batch ran the variant that
    reduces `accumulated + its own` in the graph's buckets, and none of those parameters was all-reduced again
    after the backward (`report`: `report().to_dict()` after a synchronising step)."""
    synced = [g for g in report["graphs"] if g.get("variant") == "reduce_acc"]
    assert synced and max(len(g["buckets"]) for g in synced) >= 2, report["graphs"]
    in_buckets = {n for g in synced for b in g["buckets"] for n in b["params"]}
    again = in_buckets & set(report["in_graph"]["leftovers_last_step"])
    assert not again, f"reduced in the graph and again after the backward: {sorted(again)}"


def assert_real_buckets_are_pieces(per_rank: list[dict], untouched: tuple[str, ...] = (), from_step: int = 1) -> None:
    """From `from_step` on (DDP's first step uses its own initial buckets), the buckets DDP really reduced
    are exactly our planned pieces, in backward order, plus buckets holding only the `untouched`
    parameters (those no compiled graph uses: DDP reduces them in bucket(s) of their own)."""
    for rank, r in enumerate(per_rank):
        want = [sorted(b) for b in planned_buckets(r["report"])]
        for step in range(from_step, len(r["reduced"])):
            real = [sorted(names) for _, names in r["reduced"][step]]
            extra = [b for b in real if set(b) <= set(untouched)]
            pieces = [b for b in real if b not in extra]
            assert pieces == want, f"rank {rank} step {step}: DDP reduced {real}, our pieces are {want}"
            assert sorted(n for b in extra for n in b) == sorted(untouched), (
                f"rank {rank} step {step}: parameters outside every piece were reduced as {extra}, expected {untouched}"
            )


def update_rel_err(params: dict, ref: dict, initial: dict, *, noise: float = 0.0) -> float:
    """How far `params` ended from `ref`, relative to how far training moved `ref` (worst parameter).

    Small differences in a few steps' updates hide under the size of the weights themselves; against the
    update they show: a run in another precision ends ~1e-3 of the update away, a matching run ~1e-7.
    `noise` > 0 leaves out parameters whose update is under that fraction of the largest one: an
    attention key bias has an exactly zero true gradient, so its update is rounding noise (~1e-12 of the
    others), which two devices' kernels round differently; the parameter check still covers them.
    """
    moved = {n: (ref[n].double() - initial[n].double()).norm().item() for n in ref}
    floor = noise * max(moved.values())
    return max(
        ((params[n].double() - ref[n].double()).norm() / moved[n]).item()
        for n in ref
        if moved[n] > floor and not torch.equal(ref[n], initial[n])
    )
