"""The AdamW update alone, in the ways a train step can run it, on the GPU benchmark's model (issue 34, item 2).

`python -m benchmarks.update_kernels [--device cuda|cpu] [--d-model 768 --layers 12 ...] [--out FILE]`

Why: on one H100 (session 61, torch 2.11, GPT-2 small, fp32) the peer whose only difference from
`torch.compile(ddp)` + `torch.compile(opt.step)` is torch's fused AdamW step kept the GPU 1.3 ms a step longer
(36.2 against 34.9 ms busy), and every train-step mode of ours calls that fused kernel (in-graph after the
backward, in-backward once per bucket). Whether Inductor's update, or the same kernel over flat buffers, would
win that back, and what each costs to compile, decides the update's GPU design; this measures it, update by
update, without the model's forward and backward.

Variants (each on the same parameters, gradients and state; AdamW, lr 1e-3, weight decay 0.01):

* `foreach`: `optimizer.step()` with `foreach=True` (torch's default on CUDA), eager;
* `fused`: `optimizer.step()` with `fused=True` (what `ddp="split"` and `ddp="in_graph"` steps run);
* `fused_per_bucket`: torch's fused kernel once per DDP bucket (25 MiB, the model's parameters in reverse), what
  `optimizer_in_backward=True` calls inside the backward;
* `compiled_step`: `torch.compile(optimizer.step)`, foreach (the peer `torch_savvy`); its first call's seconds
  are its compile;
* `fused_flat`: torch's fused kernel over one flat buffer each of parameters, gradients and moments (what a
  flat layout of the state would give);
* `compiled_flat`: the AdamW math over those flat buffers, compiled by Inductor (one elementwise kernel);
* `compiled_per_param`: the same math per parameter in one compiled call (Inductor: a kernel per parameter), what
  the update graph of `optimizer_in_backward=True` with `fused=False` compiles to (there spread over the buckets);
* `compiled_per_param_combo`: that with Inductor's horizontal fusion of independent kernels (`combo_kernels`),
  a few launches for all parameters.

Per variant: how far one update from the common start ends from `foreach`'s (max abs), the first call's
seconds (a compile where there is one), then, profiled (torch.profiler, the kernels of benchmarks/kernels.py),
the median per update of the GPU's busy ms, kernels and host ops, and, unprofiled, the host ms of a call (until
it returns, before the device sync). On the CPU it runs as a check of
the script (the host runs every kernel itself: its ms are not the GPU's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

from aot.torch_eager import add_to_each, fused_adam_kernel
from benchmarks.kernels import summarize_kernels
from benchmarks.profile_overlap import StepProfiler

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
VARIANTS = (
    "foreach",
    "fused",
    "fused_per_bucket",
    "fused_flat",
    "compiled_flat",
    "compiled_per_param",
    "compiled_per_param_combo",
    "compiled_step",
)
"""In the order they run: the longest compile last, so that a time limit cuts the fewest."""


def _params(args: argparse.Namespace, device: torch.device) -> list[torch.nn.Parameter]:
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    params = list(GPT(config).to(device).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """DDP's bucketing in outline: the parameters in reverse, a new bucket once the cap is reached."""
    out: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        if out[-1] and size + params[i].numel() * params[i].element_size() > cap_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += params[i].numel() * params[i].element_size()
    return out


def adamw_flat(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> None:
    """AdamW on flat buffers, in place (what Inductor compiles into one elementwise kernel)."""
    step.add_(1)
    _adamw(p, g, m, v, step)


def adamw_per_param(ps: list, gs: list, ms: list, vs: list, step: torch.Tensor) -> None:
    """AdamW on each parameter, in place, one step count for all (compiled: a kernel per parameter)."""
    step.add_(1)
    for p, g, m, v in zip(ps, gs, ms, vs):
        _adamw(p, g, m, v, step)


def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> None:
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    bias1 = 1 - BETAS[0] ** step
    bias2 = 1 - BETAS[1] ** step
    denom = (v.sqrt() / bias2.sqrt()).add_(EPS)
    p.sub_((LR / bias1) * m / denom)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def variant(
    name: str, params: list[torch.nn.Parameter], *, bucket_cap_mb: float = 25.0, backend: str = "inductor"
) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """(the update of `name` as a call, the parameters it updates read as one flat tensor)."""
    if name in ("foreach", "fused", "compiled_step"):
        opt = torch.optim.AdamW(
            params, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, foreach=name != "fused", fused=name == "fused"
        )
        read = lambda: _flat(params)  # noqa: E731
        if name == "compiled_step":
            return torch.compile(opt.step, backend=backend), read
        return opt.step, read
    # the overload the in-backward update calls (lr read from a tensor), through its home
    kernel, lr = fused_adam_kernel(decoupled=True), torch.tensor(LR, device=params[0].device)
    hyper = dict(beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
    if name == "fused_per_bucket":
        exp_avgs = [torch.zeros_like(p) for p in params]
        exp_avg_sqs = [torch.zeros_like(p) for p in params]
        steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in params]
        buckets = _buckets(params, int(bucket_cap_mb * 2**20))

        def per_bucket() -> None:
            for b in buckets:
                bucket_steps = [steps[i] for i in b]
                add_to_each(bucket_steps, 1)
                kernel(
                    [params[i].data for i in b], [params[i].grad for i in b], [exp_avgs[i] for i in b],
                    [exp_avg_sqs[i] for i in b], [], bucket_steps, lr=lr, **hyper,
                )  # fmt: skip

        return per_bucket, lambda: _flat(params)
    device = params[0].device
    if name in ("compiled_per_param", "compiled_per_param_combo"):
        tensors = [p.detach() for p in params], [p.grad for p in params]
        moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        step = torch.zeros((), dtype=torch.float32, device=device)
        options = {"combo_kernels": True} if name.endswith("_combo") and backend == "inductor" else None
        per_param = torch.compile(adamw_per_param, dynamic=False, backend=backend, options=options)
        return lambda: per_param(*tensors, *moments, step), lambda: _flat(params)
    numel = sum(p.numel() for p in params)
    flat_p, flat_g = _flat(params), _flat([p.grad for p in params])
    m, v = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    step = torch.zeros((), dtype=torch.float32, device=device)
    if name == "fused_flat":

        def flat() -> None:
            step.add_(1)
            kernel([flat_p], [flat_g], [m], [v], [], [step], lr=lr, **hyper)

        return flat, lambda: flat_p
    compiled = torch.compile(adamw_flat, dynamic=False, backend=backend)
    return lambda: compiled(flat_p, flat_g, m, v, step), lambda: flat_p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    name: str, params: list[torch.nn.Parameter], args: argparse.Namespace, reference: torch.Tensor | None
) -> dict[str, Any]:
    """`reference`: the parameters after one `foreach` update from the same start (None: this is that one)."""
    device = params[0].device
    update, read = variant(name, params, bucket_cap_mb=args.bucket_cap_mb)
    _sync(device)
    t0 = time.perf_counter()
    update()
    _sync(device)
    first_s = time.perf_counter() - t0
    after_one = read().clone()
    vs_foreach = 0.0 if reference is None else float((after_one - reference).abs().max())
    for _ in range(args.warmup):
        update()
    _sync(device)
    host = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        update()
        host.append((time.perf_counter() - t0) * 1e3)
        _sync(device)
    profiler = StepProfiler(cuda=device.type == "cuda", memory=False)
    with profiler:
        for _ in range(args.profile_steps):
            with profiler.mark_step():
                update()
            _sync(device)
    kernels = summarize_kernels(profiler.events())
    return {
        "variant": name,
        "first_call_s": round(first_s, 3),
        "host_ms": round(statistics.median(host), 3),
        "busy_ms": kernels.get("busy_ms"),
        "kernel_ms": kernels.get("kernel_ms"),
        "kernels": kernels.get("kernels"),
        "host_ops": kernels.get("host_ops"),
        "max_abs_vs_foreach": vs_foreach,
        "after_one": after_one if reference is None else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="unprofiled updates (host ms)")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)} (foreach always runs)"
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    device = torch.device(args.device)
    results: list[dict[str, Any]] = []
    reference = header = None
    for name in ["foreach"] + [v for v in variants if v != "foreach"]:  # foreach first: the reference
        params = _params(args, device)  # each variant from the same start
        if header is None:
            n = sum(p.numel() for p in params)
            header = f"AdamW update, {n / 1e6:.1f}M parameters, {device.type}, torch {torch.__version__}"
        try:
            result = measure(name, params, args, reference)
            after_one = result.pop("after_one")
            reference = after_one if reference is None else reference
            results.append(result)
        except Exception as err:  # one variant's failure (a compile on this torch) leaves the others' figures
            results.append({"variant": name, "error": f"{type(err).__name__}: {err}"[:300]})
        print(json.dumps(results[-1]), flush=True)
        if args.out:  # after each variant: a time limit keeps what was measured
            with open(args.out, "w") as f:
                json.dump({"header": header, "results": results, "argv": argv}, f, indent=1)
        del params
        torch._dynamo.reset()
    print(f"\n{header}\n| variant | first call s | host ms | busy ms | kernels | host ops | max abs vs foreach |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| `{r['variant']}` | failed: {r['error'][:120]} | | | | | |")
            continue
        cells = [r["first_call_s"], r["host_ms"], r["busy_ms"], r["kernels"], r["host_ops"], r["max_abs_vs_foreach"]]
        print(f"| `{r['variant']}` | " + " | ".join("-" if c is None else f"{c:g}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
