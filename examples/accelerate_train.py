"""Hugging Face accelerate + compile_core: a small GPT on synthetic tokens, the usual accelerate loop.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --no-compile
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py     # a machine with 2 GPUs

On a CPU-only machine accelerate 1.x starts one process for `--cpu --num_processes 2` (its multi-CPU
path wants mpirun); `--multi_gpu` starts the ranks through torchrun and ACCELERATE_USE_CPU=1 (what
`--cpu` sets) makes them gloo ranks on CPU. The model is prepared by accelerate (DDP), then compiled in
place by `compile_core.integrations.accelerate.compile`; the loop is unchanged. With `--out DIR` each
rank saves its parameters, rank 0 the compile report (JSON) and `accelerator.save_model`'s checkpoint.
Needs the [accelerate] extra: pip install -e ".[accelerate]".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: the repo root holds compile_core and examples
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import compile_core.integrations.accelerate as ddp_compile  # noqa: E402
from compile_core import BACKENDS  # noqa: E402
from examples.gpt import GPT, GPT_PRESETS, lm_loss  # noqa: E402

CFG = GPT_PRESETS["integration"]


def token_dataset(n: int, seq_len: int = 16) -> TensorDataset:
    """Seeded synthetic tokens; accelerate's prepared loader gives each rank different sequences."""
    tokens = torch.randint(0, CFG.vocab_size, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-compile", action="store_true", help="accelerate's DDP model as prepared (the baseline)")
    p.add_argument("--backend", choices=BACKENDS, default="inductor")
    p.add_argument("--ddp-mode", choices=("split", "in_graph", "none", "torch"), default="split")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05, help="DDP's bucket cap (small: several buckets)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--out", type=Path, default=None, help="save parameters, report and checkpoint here")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("compile_core").setLevel(logging.INFO)
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_cap_mb)])
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(token_dataset(args.steps * args.batch * accelerator.num_processes), batch_size=args.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    compiled = None
    if not args.no_compile:
        compiled = ddp_compile.compile(accelerator, model, backend=args.backend, ddp=args.ddp_mode)

    model.train()
    for step, (x, y) in enumerate(loader):
        loss = lm_loss(model(x), y)  # `model` itself now runs the compiled pieces
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0 and compiled is not None and accelerator.is_main_process:
            print(compiled.report(), flush=True)
        accelerator.print(f"step {step + 1}: loss {loss.item():.4f}")

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        plain = accelerator.unwrap_model(model)
        torch.save(
            {n: p.detach().clone() for n, p in plain.named_parameters()},
            args.out / f"params_rank{accelerator.process_index}.pt",
        )
        accelerator.save_model(model, args.out / "model")  # rank 0 writes model.safetensors
        if accelerator.is_main_process and compiled is not None:
            (args.out / "report.json").write_text(json.dumps(compiled.report().to_dict(), default=str))
    accelerator.end_training()


if __name__ == "__main__":
    main()
