"""One rank of one benchmark job: `python -m benchmarks.worker SPEC.json` with RANK/WORLD_SIZE/MASTER_* set.

Writes `rank{R}.json` next to the spec, success or failure; exits non-zero on failure so the runner can stop
the other ranks instead of letting them wait in a collective.
"""
from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _init_process_group(rank: int, world_size: int, timeout_s: float) -> tuple[Any, str]:
    import torch
    import torch.distributed as dist

    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    backend = "nccl" if use_nccl else "gloo"
    device = torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return device, backend


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(spec: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.checksum import param_checksum
    from benchmarks.modes import BUILDERS, ModeContext, configure_dynamo
    from examples.gpt import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)  # one core per rank: 2 ranks share the 2 cores of the dev machine
    mode = spec["mode"]
    device, pg_backend = _init_process_group(rank, world_size, spec["timeout_s"])
    configure_dynamo(mode)

    cfg = GPTConfig(**spec["gpt"])
    torch.manual_seed(spec["seed"])
    model = GPT(cfg).to(device)
    ddp_kwargs = {} if spec["bucket_cap_mb"] is None else {"bucket_cap_mb": spec["bucket_cap_mb"]}
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **ddp_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)

    # the fingerprint of the final parameters is taken against these (see benchmarks/checksum.py)
    initial = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    recorder = None
    if spec["record_overlap"]:
        from ddp.overlap import OverlapRecorder

        recorder = OverlapRecorder.attach(ddp)
    mark = recorder.mark_backward_start if recorder is not None else (lambda: None)
    step = BUILDERS[mode](ModeContext(ddp=ddp, optimizer=optimizer, backend=spec["backend"], mark_backward=mark))

    batches = [
        tuple(t.to(device) for t in synthetic_batch(
            cfg, spec["batch"], spec["seq_len"], step=i, rank=rank, seed=spec["seed"]))
        for i in range(spec["warmup"] + spec["steps"])
    ]
    step_s: list[float] = []
    losses: list[float] = []
    for i, (x, y) in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        loss = step.run(x, y)
        _sync(device)
        step_s.append(time.perf_counter() - t0)
        losses.append(float(loss))  # outside the timed region

    final = torch.tensor([losses[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(final)
    timed = step_s[spec["warmup"]:]
    result: dict[str, Any] = {
        "ok": True,
        "mode": mode,
        "rank": rank,
        "world_size": world_size,
        "pg_backend": pg_backend,
        "device": str(device),
        "first_step_s": step_s[0],
        "warmup_s": sum(step_s[: spec["warmup"]]),
        "step_ms": [1e3 * s for s in timed],
        "median_step_ms": 1e3 * statistics.median(timed),
        "losses": losses,
        "final_loss": float(final.item()) / world_size,
        "param_checksum": param_checksum(dict(model.named_parameters()), initial),
        "peak_rss_mb": _peak_rss_mb(),
        "info": step.info(),
    }
    if recorder is not None:
        result["overlap"] = _overlap_result(recorder, spec, rank, result["info"])
    return result


def _overlap_result(recorder, spec: dict[str, Any], rank: int, info: dict[str, Any]) -> dict[str, Any]:
    from ddp.overlap import check_alignment

    if not recorder.steps():
        why = ("DDP's python reducer reduces per parameter under compiled autograd: no buckets to time"
               if recorder.bypassed else "no comm-hook call seen")
        return {"recorded": False, "reason": why}
    out: dict[str, Any] = {"recorded": True, **recorder.summary(skip_first=min(2, spec["warmup"]))}
    out["observed_buckets"] = recorder.observed_buckets()
    planned = info.get("planned_buckets")
    if planned:
        alignment = check_alignment(planned, out["observed_buckets"])
        out["alignment"] = alignment.to_dict()
        out["alignment_text"] = str(alignment)
    if rank == 0 and spec.get("timeline_png"):
        title = f"{spec['mode']} / {spec['workload']}"
        out["timeline_png"] = str(recorder.plot_timeline(spec["timeline_png"], title=title))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.worker SPEC.json  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)")
        return 2
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_path = spec_path.parent / f"rank{rank}.json"
    try:
        result = run(spec, rank, world_size)
        code = 0
    except BaseException as err:  # every failure becomes a result that names the mode and the rank
        from benchmarks.modes import ModeUnavailable

        unavailable = isinstance(err, ModeUnavailable)
        result = {
            "ok": False,
            "unavailable": unavailable,
            "mode": spec["mode"],
            "rank": rank,
            "error": f"{type(err).__name__}: {err}".strip()[:2000],
            "traceback": traceback.format_exc()[-8000:],
            "peak_rss_mb": _peak_rss_mb(),
        }
        code = 3 if unavailable else 1
    out_path.write_text(json.dumps(result, indent=1, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a rank whose peer already died can block in process-group destruction.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
