"""Rank script of the node benchmark (benchmarks/nodes.py): the demo (examples/train_gpt.py), timed per rank.

Each rank writes `<NODES_BENCH_OUT>/rank<R>.attempt<A>.json` when its run ends: when the process
started, first step seconds (and when it ended), median later step ms, compile seconds (compiling or
loading, waiting for other ranks excluded, from the report's per-piece records), AOTAutograd cache
misses, and where each piece came from.
With `KILL_AT=RANK:STEP`, that rank SIGKILLs itself when it fetches the batch of step index STEP in the
job's first attempt, after writing `death.json` (the time of death).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STARTED = time.time()  # before torch and the demo are imported: the rank's own start-up is measured too
OUT = os.environ["NODES_BENCH_OUT"]
RANK = int(os.environ.get("RANK", "0"))
# After the death every rank is a restarted one (torchrun's own count stays 0 on the node that restarted
# for the other node's failure).
ATTEMPT = 1 if os.path.exists(os.path.join(OUT, "death.json")) else 0

import examples.train_gpt as demo  # noqa: E402

KILL = tuple(int(v) for v in os.environ["KILL_AT"].split(":")) if os.environ.get("KILL_AT") else None
times: list[tuple[float, float]] = []  # (seconds, end time) per step
reports: list = []


def _batch(real):
    def batch(*args, step, rank, **kwargs):
        if KILL is not None and (rank, step) == KILL and ATTEMPT == 0:
            with open(os.path.join(OUT, "death.json"), "w") as f:
                json.dump({"rank": rank, "step": step, "time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, step=step, rank=rank, **kwargs)

    return batch


def _build_step(real):
    def build(*args, **kwargs):
        step, report = real(*args, **kwargs)
        reports.append(step)

        def timed(x, y):
            t0 = time.perf_counter()
            loss = step(x, y)
            loss.item()
            times.append((time.perf_counter() - t0, time.time()))
            return loss

        return timed, report

    return build


def _write() -> None:
    if not times:
        return
    d = reports[0].report().to_dict() if reports and hasattr(reports[0], "report") else {}
    pieces = d.get("piece_compiles", []) + (d.get("optimizer") or {}).get("graph_compiles", [])
    distinct = [p for p in pieces if p.get("source") != "reused" and not p.get("reused_from")]
    out = {
        "rank": RANK,
        "attempt": ATTEMPT,
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "started": STARTED,
        "first_step_s": times[0][0],
        "first_step_end": times[0][1],
        "steady_ms": statistics.median(t for t, _ in times[1:]) * 1e3 if len(times) > 1 else None,
        "compile_s": sum(p.get("seconds", 0.0) for p in distinct),
        "report_compile_s": d.get("compile_seconds"),
        "aot_misses": sum(1 for p in distinct if p.get("aot_cache") == "miss"),
        "sources": sorted(str(p.get("source", "?")) for p in distinct),
        "waited_s": sum(p.get("waited_s", 0.0) for p in distinct),
    }
    with open(os.path.join(OUT, f"rank{RANK}.attempt{ATTEMPT}.json"), "w") as f:
        json.dump(out, f)


def _train(real):
    def train(*args, **kwargs):
        real(*args, **kwargs)
        _write()  # while the process group (and its store, which report() reads) is still there

    return train


demo.synthetic_batch = _batch(demo.synthetic_batch)
demo.build_step = _build_step(demo.build_step)
demo.train = _train(demo.train)
demo.main()
