"""Fault suite, compile cases: something happens on ONE rank only, through `python -m launch`.

In `ddp="split"` the job must go on correctly (parameters equal an eager DDP reference trained in the
same processes on the same rank-dependent data, identical on both ranks) and the report must name the
rank that differed; in `ddp="in_graph"` a divergence that would pair mismatched collectives must end in
a clear error naming the rank, before any such collective; an exception or a bad argument on one rank
must end the job with the launcher naming that rank. The cases a job survives share one launch (one
after another in the same ranks, each compiling afresh after `torch._dynamo.reset()`); a case that ends
the job has a launch of its own. The split and error cases assert their wall time.
"""

from __future__ import annotations

import re
import textwrap
import time

import pytest

from tests.multi_gpu.launch_jobs import LaunchJob, launch_job_fixture

pytestmark = pytest.mark.multi_gpu


RANK_SCRIPT = textwrap.dedent(
    """
    import copy, json, os, sys, time
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import compile_core

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = os.environ.get("BACKEND", "aot_eager")


    class Net(nn.Module):
        def __init__(self, fault):
            super().__init__()
            self.fault = fault
            self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            if self.fault == "data_branch":  # which layer runs depends on the data (as experts in an MoE)
                h = torch.tanh(self.b(torch.tanh(self.a(x))))
                return torch.tanh(self.c(h)) if x[0, 0] > 0 else torch.tanh(self.d(h))
            x = torch.tanh(self.b(torch.tanh(self.a(x))))
            if self.fault in ("graph_break", "compile_error") and rank == 1:
                torch._dynamo.graph_break()  # this rank only (outside a loop: Dynamo resumes after it)
            return torch.tanh(self.d(torch.tanh(self.c(x))))


    def run_case(fault, mode):
        torch.manual_seed(0)
        model = Net(fault)
        ref = copy.deepcopy(model)
        unused = fault == "data_branch"
        ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.005, find_unused_parameters=unused) for m in (model, ref))
        kwargs = {"backend": backend, "ddp": mode}
        if fault == "bad_argument" and rank == 1:
            kwargs["bucket_cap_mb"] = -1  # this rank only
        if fault == "inductor_fails" and rank == 1:
            kwargs["options"] = {"_raise_error_for_testing": True}  # this rank only
        if fault == "compile_error":
            kwargs["fullgraph"] = True  # rank 1's graph break becomes an exception while compiling
        compiled = compile_core.compile(ddp, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            if fault == "late_hook" and rank == 1 and step == 2:  # activation logging on this rank, mid-run
                model.c.register_forward_hook(lambda mod, args, out: print("mean", out.mean().item()))
            batch = 6 if (fault == "recompile" and rank == 1 and step >= 2) else 4  # new size, this rank only
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(batch, 32, generator=g)
            if fault == "data_branch":  # layer c at step 0, d at step 1 (both ranks), then c on rank 0 only
                x[:, 0] = 1.0 if step == 0 or (step == 2 and rank == 0) else -1.0
            for run, o in ((compiled, opt), (ref_ddp, ref_opt)):
                run(x).square().mean().backward()
                o.step()
                o.zero_grad(set_to_none=True)
        err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        checksum = sum(float(p.double().sum()) for p in model.parameters())
        report = compiled.report().to_dict()
        return {"rank": rank, "err": err, "checksum": checksum, "differences": report["rank_differences"],
                "fallbacks": len(report["fallbacks"]), "graphs": len(report["graphs"]),
                "alignment": report["alignment"]["status"]}


    # CASES: "fault:mode,..." run one after another in these ranks (one launch for several cases that succeed)
    for case in os.environ["CASES"].split(","):
        fault, mode = case.split(":")
        start = time.perf_counter()
        result = run_case(fault, mode)
        print("RESULT " + json.dumps({**result, "case": case, "seconds": time.perf_counter() - start}), flush=True)
        torch._dynamo.reset()  # the next case compiles afresh, as in a process of its own
        dist.barrier()
    dist.destroy_process_group()
    """
)


_job = pytest.fixture(launch_job_fixture("compilefault", RANK_SCRIPT))


def _env(workdir, cases: str, backend: str, first_timeout_s: int = 60) -> dict:
    return {
        "CASES": cases,
        "BACKEND": backend,
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "cache"),
        "DDP_COMPILE_FIRST_TIMEOUT_S": str(first_timeout_s),
        "DDP_COMPILE_TIMEOUT_S": "30",
    }


@pytest.fixture
def job(_job: LaunchJob):
    """`job(fault, mode)` runs the rank script's one case on 2 gloo ranks through the launcher: (result, seconds)."""

    def run(fault: str, mode: str, *, backend: str = "aot_eager", timeout: float = 150, first_timeout_s: int = 60):
        start = time.time()
        env = _env(_job.workdir, f"{fault}:{mode}", backend, first_timeout_s)
        res, end = _job.run(env=env, timeout=timeout)
        return res, end - start

    return run


SURVIVED = ("graph_break:split", "recompile:split", "recompile:in_graph")
"""The divergences a job survives, run one after another in one launch (each case compiles afresh)."""


@pytest.fixture(scope="module")
def survived(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """case -> rank -> its RESULT, from one launch of every case in `SURVIVED`."""
    job = LaunchJob(tmp_path_factory.mktemp("survived"), "compilefault", RANK_SCRIPT)
    try:
        res, _ = job.run(env=_env(job.workdir, ",".join(SURVIVED), "aot_eager"), timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        job.assert_nothing_left()
    finally:
        job.kill()
    return {case: _results(res.stdout, case) for case in SURVIVED}


def _results(stdout: str, case: str | None = None) -> dict[int, dict]:
    import json

    found = {}
    for line in stdout.splitlines():
        m = re.search(r"RESULT (\{.*\})", line)
        if m:
            data = json.loads(m.group(1))
            if case is None or data["case"] == case:
                found[data["rank"]] = data
    assert sorted(found) == [0, 1], f"both ranks must finish; stdout:\n{stdout[-3000:]}"
    return found


def _assert_correct_and_identical(results: dict[int, dict]) -> None:
    for rank, r in results.items():
        assert r["err"] < 1e-5, f"rank {rank}: parameters differ from eager DDP by {r['err']:.2e}"
    assert results[0]["checksum"] == results[1]["checksum"], "ranks hold different parameters"


def _failed_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("launch: job FAILED")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["graph_break", "recompile"])
def test_split_mode_survives_a_rank_local_divergence_and_names_the_rank(survived, fault):
    results = survived[f"{fault}:split"]
    _assert_correct_and_identical(results)
    assert results[0]["alignment"] == results[1]["alignment"] == "aligned"
    named = [d for d in results[0]["differences"] if d["rank"] == 1]
    assert named, f"rank 0's report does not name rank 1: {results[0]['differences']}"
    what = "graphs" if fault == "graph_break" else "recompiles"
    assert what in named[0]["difference"], named[0]
    # no rank waited out the first step's 60 s agreement timeout (a normal case takes a few seconds)
    assert max(r["seconds"] for r in results.values()) < 60, results


@pytest.mark.timeout(300)
def test_in_graph_mode_survives_a_rank_local_recompile_with_the_same_buckets(survived):
    _assert_correct_and_identical(survived["recompile:in_graph"])


@pytest.mark.timeout(200)
def test_in_graph_mode_names_the_rank_whose_graph_break_changed_the_buckets(job):
    res, seconds = job("graph_break", "in_graph")
    assert res.returncode == 1, res.stdout[-2000:]
    line = _failed_line(res.stderr)
    assert "RankMismatchError" in line and "ranks [1] differ from rank 0" in line, line
    assert "RESULT" not in res.stdout  # nothing trained past the divergence
    assert seconds < 60 + 30, f"{seconds:.1f} s"


def _ended_waiting_for(missing: int, res, seconds: float) -> str:
    """The job failed on a rank that waited for rank `missing` at the graphs agreement, well before the 200 s
    compile timeout, and trained nothing past the divergence; returns the launcher's failure line."""
    assert res.returncode == 1, res.stdout[-2000:]
    line = _failed_line(res.stderr)
    assert "RankTimeoutError" in line and f"rank(s) [{missing}] did not reach 'graphs run'" in line, line
    assert "RESULT" not in res.stdout
    assert seconds < 200, f"{seconds:.1f} s"
    return line


@pytest.mark.timeout(300)
def test_in_graph_mode_ends_soon_when_a_hook_on_one_rank_breaks_its_graph_mid_run(job):
    # Rank 1 recompiles at step 2 (a new forward hook whose .item() breaks the graph) and waits for rank 0 to
    # agree on its new graphs; rank 0 compiled nothing and waits in its all-reduce. Rank 1 must not wait out the
    # long compile timeout (here 200 s) for a rank that is not compiling: it stops after DDP_COMPILE_TIMEOUT_S.
    res, seconds = job("late_hook", "in_graph", first_timeout_s=200, timeout=280)
    line = _ended_waiting_for(0, res, seconds)
    assert "started or ended no compile" in line, line


@pytest.mark.timeout(300)
def test_in_graph_mode_ends_soon_naming_the_cause_when_the_data_picks_other_layers_on_one_rank(job):
    # Step 2: rank 0's data takes the branch both ranks compiled at step 0, rank 1's the one agreed at step 1.
    # Nothing compiles; rank 1 runs the agreed graphs and waits in their all-reduces, rank 0 waits for rank 1
    # to agree on its changed graphs, and must say why after DDP_COMPILE_TIMEOUT_S (30 s here), not just "stuck".
    res, seconds = job("data_branch", "in_graph", first_timeout_s=200, timeout=280)
    _ended_waiting_for(1, res, seconds)
    assert "without compiling anything" in res.stderr and "use ddp='split'" in res.stderr, res.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.inductor
def test_split_mode_survives_inductor_failing_on_one_rank(job):
    res, _ = job("inductor_fails", "split", backend="inductor", timeout=270)
    assert res.returncode == 0, res.stderr[-3000:]
    results = _results(res.stdout)
    _assert_correct_and_identical(results)
    assert results[1]["fallbacks"] > 0 and results[0]["fallbacks"] == 0
    assert any(d["rank"] == 1 and "fallbacks" in d["difference"] for d in results[0]["differences"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "fault, words",
    [
        ("bad_argument", "ValueError: bucket_cap_mb=-1"),
        ("compile_error", "graph_break"),
    ],
)
def test_an_error_on_one_rank_ends_the_job_naming_it(job, fault, words):
    res, seconds = job(fault, "split")
    assert res.returncode == 1, res.stdout[-2000:]
    line = _failed_line(res.stderr)
    assert line.startswith("launch: job FAILED: rank 1 "), line
    assert words.lower() in (line + res.stderr).lower(), line
    assert seconds < 60 + 30, f"{seconds:.1f} s"
