"""`python -m benchmarks nodes`: one node x 2 ranks against 2 nodes x 1 rank on this machine, and a restart.

Both layouts run the demo (examples/train_gpt.py, compiled train step, Inductor) through `python -m launch`
with the same model and the same global batch; the 2-node job's nodes have their own Inductor cache dirs
and see each other only through the job's store (as two hosts would). Per round, interleaved:
  * cold: fresh cache dirs; warm: the same job again on the caches the cold job left;
  * restart: 2 nodes, `--max-restarts 1`, fresh caches, rank 1 SIGKILLs itself in step KILL_STEP + 1 after
    a checkpoint; measured from its death to the end of the first step after the restart.
Per job: the slowest rank's first step, compile seconds summed over all ranks (time compiling or loading
each piece and optimizer chunk, waiting for another rank excluded), AOTAutograd misses, the median later
step. Medians over rounds. Results: bench_out/nodes/results.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "1 node x 2 ranks": ["--nnodes", "1", "--nproc-per-node", "2"],
    "2 nodes x 1 rank": ["--nnodes", "2", "--nproc-per-node", "1"],
}
TWO_NODES = "2 nodes x 1 rank"


def run_job(
    out: Path, layout: str, cache: Path, model: list[str], *, kill: str | None = None, timeout: float = 1500
) -> dict:
    """One launcher job; returns its per-rank records (and the death, for a restart job)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "launch",
        *LAYOUTS[layout],
        "--inductor-cache-dir",
        str(cache),
        "--log-dir",
        str(out / "logs"),
    ]
    if kill:
        cmd += ["--max-restarts", "1"]
    cmd += [str(REPO / "benchmarks" / "nodes_job.py"), *model, "--log-level", "WARNING"]
    if kill:
        cmd += ["--checkpoint-dir", str(out / "ckpt")]
    env = {**os.environ, "NODES_BENCH_OUT": str(out), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if kill:
        env["KILL_AT"] = kill
    start = time.time()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    (out / "stdout.txt").write_text(res.stdout)
    (out / "stderr.txt").write_text(res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"{layout} job failed ({res.returncode}); see {out}/stderr.txt:\n{res.stderr[-2000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.attempt*.json"))]
    death = json.loads((out / "death.json").read_text()) if (out / "death.json").exists() else None
    return {
        "layout": layout,
        "wall_s": time.time() - start,
        "ranks": ranks,
        "death": death,
        "launcher": [line for line in res.stderr.splitlines() if line.startswith("launch: ")],
    }


def summarize(job: dict) -> dict:
    last = max(r["attempt"] for r in job["ranks"])
    ranks = [r for r in job["ranks"] if r["attempt"] == last]
    out = {
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "compile_s": sum(r["compile_s"] for r in ranks),
        "aot_misses": sum(r["aot_misses"] for r in ranks),
        "steady_ms": statistics.median(r["steady_ms"] for r in ranks if r["steady_ms"] is not None),
        "sources": sorted(s for r in ranks for s in r["sources"]),
    }
    if job["death"] is not None:
        death = job["death"]["time"]
        out["death_to_step_s"] = max(r["first_step_end"] for r in ranks) - death
        out["death_to_start_s"] = max(r["started"] for r in ranks) - death  # torchrun: detect, stop, rendezvous
        out["start_to_step_s"] = max(r["first_step_end"] - r["first_step_s"] - r["started"] for r in ranks)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks nodes", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", type=Path, default=REPO / "bench_out" / "nodes")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-step", type=int, default=6, help="step index at which rank 1 dies (restart job)")
    p.add_argument(
        "--model",
        default="--d-model 64 --layers 2 --vocab 256 --seq-len 32 --batch 4",
        help="demo arguments for the model and the per-rank batch (the same in both layouts)",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.kill_step < 2 or args.kill_step >= args.steps:
        p.error("--rounds >= 1 and 2 <= --kill-step < --steps")
    model = [*args.model.split(), "--steps", str(args.steps), "--checkpoint-every", str(args.kill_step // 2)]
    jobs = []
    for rnd in range(args.rounds):
        order = list(LAYOUTS) if rnd % 2 == 0 else list(LAYOUTS)[::-1]  # rotate, so neither always goes first
        for layout in order:
            cache = args.out_dir / f"r{rnd}" / layout.replace(" ", "") / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            for phase in ("cold", "warm"):
                job = run_job(args.out_dir / f"r{rnd}" / layout.replace(" ", "") / phase, layout, cache, model)
                jobs.append({**job, "round": rnd, "phase": phase, **summarize(job)})
                print(f"round {rnd} {layout} {phase}: {json.dumps(summarize(job))}", flush=True)
        cache = args.out_dir / f"r{rnd}" / "restart" / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        job = run_job(args.out_dir / f"r{rnd}" / "restart" / "job", TWO_NODES, cache, model, kill=f"1:{args.kill_step}")
        jobs.append({**job, "round": rnd, "phase": "restart", **summarize(job)})
        print(f"round {rnd} restart: {json.dumps(summarize(job))} {job['launcher']}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(jobs, indent=1))
    print(table(jobs))
    return 0


def _median(jobs: list[dict], layout: str, phase: str, key: str) -> float:
    return statistics.median(j[key] for j in jobs if j["layout"] == layout and j["phase"] == phase)


def table(jobs: list[dict]) -> str:
    """The BENCHMARKS.md table: medians over rounds, and the issue's ratios."""
    one, two = LAYOUTS
    rows = [
        "| layout | first step cold (slowest rank) | first step warm | compile s cold, summed over ranks | "
        "compile s warm | AOT misses cold / warm | steady step ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        m = {
            (ph, k): _median(jobs, layout, ph, k)
            for ph in ("cold", "warm")
            for k in ("first_step_s", "compile_s", "aot_misses", "steady_ms")
        }
        rows.append(
            f"| {layout} | {m['cold', 'first_step_s']:.1f} s | {m['warm', 'first_step_s']:.2f} s | "
            f"{m['cold', 'compile_s']:.1f} | {m['warm', 'compile_s']:.2f} | {m['cold', 'aot_misses']:g} / "
            f"{m['warm', 'aot_misses']:g} | {m['warm', 'steady_ms']:.1f} |"
        )
    restart = [j for j in jobs if j["phase"] == "restart"]
    warm_two = _median(jobs, two, "warm", "first_step_s")
    compile_ratio = _median(jobs, two, "cold", "compile_s") / _median(jobs, one, "cold", "compile_s")
    first_ratio = _median(jobs, two, "cold", "first_step_s") / _median(jobs, one, "cold", "first_step_s")
    lines = rows + [
        "",
        f"- compile seconds, cold, 2 nodes / 1 node: {compile_ratio:.2f}x (target <= 1.2x)",
        f"- slowest rank's first step, cold, 2 nodes / 1 node: {first_ratio:.2f}x (target <= 1.1x)",
    ]
    if restart:
        death = statistics.median(j["death_to_step_s"] for j in restart)
        misses = [j["aot_misses"] for j in restart]
        parts = {
            k: statistics.median(j[k] for j in restart) for k in ("death_to_start_s", "start_to_step_s", "first_step_s")
        }
        lines.append(
            f"- restart (2 nodes, rank 1 SIGKILLed): death to the end of the first step after the restart "
            f"{death:.1f} s = {death / warm_two:.2f}x the 2-node warm first step ({warm_two:.2f} s; target "
            f"<= 1.2x): {parts['death_to_start_s']:.1f} s until the new ranks started (torchrun), "
            f"{parts['start_to_step_s']:.1f} s rank start-up (imports, process group, checkpoint, DDP), "
            f"{parts['first_step_s']:.1f} s first step; AOT misses after the restart: {misses}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
