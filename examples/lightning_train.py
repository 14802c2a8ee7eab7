"""Lightning Trainer + DDPCompileStrategy: a small GPT on synthetic tokens, 2 CPU ranks (gloo).

    python examples/lightning_train.py                              # compile_core, inductor, ddp="split"
    python examples/lightning_train.py --backend aot_eager --ddp-mode in_graph --accumulate 2
    python examples/lightning_train.py --strategy ddp               # Lightning's own ddp, no compile

Lightning starts the second rank itself (its `ddp` launcher runs this script again). Rank 0 logs the
compile report once, after the first step. With `--out DIR` each rank saves its parameters, rank 0
the compile report (JSON) and a Lightning checkpoint (what tests/multi_gpu/test_lightning_multirank.py
compares against `--strategy ddp`). Needs the [lightning] extra: pip install -e ".[lightning]".
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

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from compile_core import BACKENDS  # noqa: E402
from compile_core.integrations.lightning import DDPCompileStrategy  # noqa: E402
from examples.gpt import GPT, GPT_PRESETS, lm_loss  # noqa: E402

CFG = GPT_PRESETS["integration"]


class LitGPT(L.LightningModule):
    """The GPT of examples/gpt.py as a LightningModule: next-token loss, SGD with momentum."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(CFG)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def token_dataset(n: int, seq_len: int = 16) -> TensorDataset:
    """Seeded synthetic tokens; Lightning's DistributedSampler gives each rank different sequences."""
    tokens = torch.randint(0, CFG.vocab_size, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategy",
        choices=("compile", "ddp"),
        default="compile",
        help="compile: DDPCompileStrategy; ddp: Lightning's own ddp strategy (no compile)",
    )
    p.add_argument("--backend", choices=BACKENDS, default="inductor")
    p.add_argument("--ddp-mode", choices=("split", "in_graph", "none", "torch"), default="split")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05, help="DDP's bucket cap (small: several buckets)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--out", type=Path, default=None, help="save parameters, report and checkpoint here")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("compile_core").setLevel(logging.INFO)  # the report, logged once after step 1
    torch.manual_seed(0)
    if args.strategy == "compile":
        strategy = DDPCompileStrategy(
            compile_config={"backend": args.backend, "ddp": args.ddp_mode}, bucket_cap_mb=args.bucket_cap_mb
        )
    else:
        strategy = L.pytorch.strategies.DDPStrategy(bucket_cap_mb=args.bucket_cap_mb)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LitGPT()
    sequences = args.steps * args.accumulate * args.batch * args.devices
    loader = DataLoader(token_dataset(sequences), batch_size=args.batch)
    trainer.fit(model, loader)

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, args.out / f"params_rank{rank}.pt")
        trainer.save_checkpoint(args.out / "model.ckpt")  # every rank calls it; rank 0 writes
        if rank == 0 and isinstance(strategy, DDPCompileStrategy):
            (args.out / "report.json").write_text(json.dumps(strategy.compile_report().to_dict(), default=str))


if __name__ == "__main__":
    main()
