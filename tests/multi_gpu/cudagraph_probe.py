"""Each train-step mode under CUDA graphs against eager DDP, one process per mode (a diagnostic for a GPU
machine, not a test): `python -m tests.multi_gpu.cudagraph_probe [--device cuda|cpu] [--steps N] [MODE ...]`.

A mode runs in a child process of its own, with `faulthandler` on, so a crash (the one GPU run of in-backward
updates under `mode="reduce-overhead"` died with SIGSEGV, torch 2.11) is reported with its exit code and the
Python stack where it happened, and the other modes still run. Each child trains a small GPT on one rank
(nccl on a GPU, gloo on the CPU) with AdamW, beside eager DDP with the same data, and prints one line:
how far its parameters ended from eager's relative to eager's update (the worst parameter whose
update is more than rounding noise; a lost optimizer state shows as order 1), how many of its graphs Inductor left
out of CUDA graphs (and the first reason it logged), whether the update ran inside the backward, and its
median step time after the first 3 steps (`--parallel N` runs N modes at once: faster, but their step
times then share the device).

The `in_backward` modes lift the train step's refusal of CUDA graphs with updates inside the backward (left,
since session 61's H100 run, for accumulation only) for this process (`compile_core/in_backward/path.py:
in_backward_blocker`): the probe is how that refusal gets lifted or kept. A failing child's whole output goes
to `cudagraph_probe_<mode>.log` in the working directory (`$OUT` where set), not only its end. On the CPU the
modes run with CUDA graphs asked for and none captured (a check of the probe itself).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

NOISE = 1e-4
"""Parameters whose eager update is below this fraction of the largest are left out of the comparison."""

MODES = {
    "split": {"ddp": "split"},
    "in_graph": {"ddp": "in_graph"},
    "in_backward": {"ddp": "in_graph", "optimizer_in_backward": True},
    "in_backward_clip": {"ddp": "in_graph", "optimizer_in_backward": True, "clip_grad_norm": 1.0},
    "in_graph_accum": {"ddp": "in_graph", "accum_steps": 2},
    "in_backward_accum": {"ddp": "in_graph", "optimizer_in_backward": True, "accum_steps": 2},
}
"""train_step options per mode (each also gets backend="inductor", mode="reduce-overhead"); eager DDP clips and
accumulates as the mode does."""


class _SkipReasons(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." lines."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []
        self.setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "skipping cudagraphs" in message:
            self.reasons.append(message.splitlines()[0][:200])


def _child(mode: str, device: str, steps: int) -> None:
    faulthandler.enable()
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compile_core
    from compile_core.in_backward import path as in_backward_path
    from examples.gpt import GPT, GPTConfig, lm_loss

    skips = _SkipReasons()
    torch._logging.set_logs(cudagraphs=True)  # Inductor's "skipping cudagraphs due to ..." lines
    logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").addHandler(skips)
    if mode.startswith("in_backward"):
        in_backward_path.in_backward_blocker = lambda config, *, grad_scaler, device_type: None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29800 + sorted(MODES).index(mode)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    config = GPTConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, max_seq_len=128)

    def build():
        torch.manual_seed(0)
        model = GPT(config).to(device)
        ddp = DDP(model, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=1)
        return model, ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)

    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randint(0, 4096, (4, 128), generator=g).to(device),
            torch.randint(0, 4096, (4, 128), generator=g).to(device),
        )
        for _ in range(steps)
    ]
    ref_model, ref_ddp, ref_opt = build()
    initial = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    accum, clip = MODES[mode].get("accum_steps", 1), MODES[mode].get("clip_grad_norm")
    for i, (x, y) in enumerate(batches):
        (lm_loss(ref_ddp(x), y) / accum).backward()  # world size 1: syncing every micro-batch changes nothing
        if (i + 1) % accum:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref_ddp.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    model, ddp, opt = build()
    step = compile_core.train_step(ddp, opt, lm_loss, backend="inductor", mode="reduce-overhead", **MODES[mode])
    times = []
    for x, y in batches:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x, y)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    moved = {n: (ref_model.get_parameter(n).double() - initial[n].double()).norm().item() for n in initial}
    floor = NOISE * max(moved.values())  # below it, an update is rounding noise (an attention key's bias)
    worst, worst_name = 0.0, "-"
    for name, p in model.named_parameters():
        if moved[name] < floor:
            continue
        err = (p.detach().double() - ref_model.get_parameter(name).double()).norm().item() / moved[name]
        if err > worst:
            worst, worst_name = err, name
    in_backward = step.report().optimizer_in_backward
    why = f" ({in_backward['reason']})" if in_backward.get("reason") else ""
    print(
        f"== {mode}: params vs eager {worst:.2e} (worst {worst_name}); "
        f"graphs left out of CUDA graphs {counters['inductor']['cudagraph_skips']}"
        f"{': ' + skips.reasons[0] if skips.reasons else ''}; updates in backward "
        f"{in_backward.get('updates_in_backward', 0)}{why}; "
        f"median step {1e3 * statistics.median(times[3:]):.1f} ms",
        flush=True,
    )
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="*", default=list(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=8, help="micro-batches (an even number: 2 per update with _accum)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per mode")
    parser.add_argument("--parallel", type=int, default=1, help="modes run at once (their step times then overlap)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: at least 1")
    if args.steps % 2:
        parser.error(f"--steps {args.steps}: an even number (the _accum modes update every 2 micro-batches)")
    if args.steps < 4:
        parser.error(f"--steps {args.steps}: at least 4 (the median is of the steps after the first 3)")
    unknown = [m for m in [*args.modes, *([args.child] if args.child else [])] if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    if args.child:
        _child(args.child, args.device, args.steps)
        return 0
    # Each child writes to a file of its own: a pipe read only at the end would fill up with a child's
    # compile warnings and stop it, while this loop waits for it to finish.
    logs = tempfile.TemporaryDirectory()
    children = []
    for mode in args.modes:  # every child at once with --parallel (their step times then share the device)
        cmd = [sys.executable, "-m", "tests.multi_gpu.cudagraph_probe", "--child", mode]
        cmd += ["--device", args.device, "--steps", str(args.steps)]
        while sum(c[1].poll() is None for c in children) >= args.parallel:
            time.sleep(0.5)
        log = open(os.path.join(logs.name, f"{mode}.log"), "w+")  # noqa: SIM115 (closed below)
        children.append((mode, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    failed = 0
    deadline = time.monotonic() + args.timeout * len(children) / args.parallel
    for mode, child, log in children:
        try:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.seek(0)
        output = log.read()
        log.close()
        lines = [line for line in output.splitlines() if line.startswith("== ")]
        if child.returncode == 0 and lines:
            print(lines[-1], flush=True)
            continue
        failed += 1
        why = f"exit code {child.returncode}" if child.returncode >= 0 else f"killed by signal {-child.returncode}"
        kept = os.path.join(os.environ.get("OUT", "."), f"cudagraph_probe_{mode}.log")
        with open(kept, "w") as f:
            f.write(output)
        print(
            f"== {mode}: {why} (a timeout kills it); its whole output: {kept}; where its first traceback "
            "starts, then its end:",
            flush=True,
        )
        out_lines = output.splitlines()
        first = next((i for i, line in enumerate(out_lines) if "Traceback" in line), len(out_lines))
        print("\n".join(out_lines[first : first + 30] + ["[...]"] + out_lines[-30:]), flush=True)
    logs.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
