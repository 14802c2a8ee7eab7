"""Lightning Fabric + FabricDDPCompileStrategy: a small GPT on synthetic tokens, 2 CPU ranks (gloo).

    python examples/fabric_train.py                                 # compile_core, inductor, ddp="split"
    python examples/fabric_train.py --backend aot_eager --ddp-mode in_graph
    python examples/fabric_train.py --strategy ddp                  # Fabric's own ddp, no compile

`fabric.launch()` starts the second rank (Fabric's `ddp` launcher runs this script again). Rank 0 logs
the compile report once, after the first optimizer step. With `--out DIR` each rank saves its
parameters, rank 0 the compile report (JSON), and `fabric.save` writes a checkpoint. Needs the
[lightning] extra: pip install -e ".[lightning]".
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
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from compile_core import BACKENDS  # noqa: E402
from compile_core.integrations.lightning import FabricDDPCompileStrategy  # noqa: E402
from examples.gpt import GPT, GPT_PRESETS, lm_loss  # noqa: E402

CFG = GPT_PRESETS["integration"]


def token_dataset(n: int, seq_len: int = 16) -> TensorDataset:
    """Seeded synthetic tokens; Fabric's DistributedSampler gives each rank different sequences."""
    tokens = torch.randint(0, CFG.vocab_size, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategy",
        choices=("compile", "ddp"),
        default="compile",
        help="compile: FabricDDPCompileStrategy; ddp: Fabric's own ddp strategy (no compile)",
    )
    p.add_argument("--backend", choices=BACKENDS, default="inductor")
    p.add_argument("--ddp-mode", choices=("split", "in_graph", "none", "torch"), default="split")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05, help="DDP's bucket cap (small: several buckets)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--out", type=Path, default=None, help="save parameters, report and checkpoint here")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("compile_core").setLevel(logging.INFO)  # the report, logged once after step 1
    if args.strategy == "compile":
        strategy = FabricDDPCompileStrategy(
            compile_config={"backend": args.backend, "ddp": args.ddp_mode}, bucket_cap_mb=args.bucket_cap_mb
        )
    else:
        strategy = DDPStrategy(bucket_cap_mb=args.bucket_cap_mb)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=args.devices)
    fabric.launch()

    torch.manual_seed(0)
    gpt = GPT(CFG)
    optimizer = torch.optim.SGD(gpt.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(gpt, optimizer)  # DDP around gpt, compiled by the strategy
    loader = fabric.setup_dataloaders(
        DataLoader(token_dataset(args.steps * args.batch * args.devices), batch_size=args.batch)
    )
    model.train()
    for step, (x, y) in enumerate(loader):
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        fabric.print(f"step {step + 1}: loss {loss.item():.4f}")

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {n: p.detach().clone() for n, p in gpt.named_parameters()}, args.out / f"params_rank{fabric.global_rank}.pt"
        )
        fabric.save(args.out / "model.ckpt", {"model": model, "optimizer": optimizer})
        if fabric.global_rank == 0 and isinstance(strategy, FabricDDPCompileStrategy):
            (args.out / "report.json").write_text(json.dumps(strategy.compile_report().to_dict(), default=str))


if __name__ == "__main__":
    main()
