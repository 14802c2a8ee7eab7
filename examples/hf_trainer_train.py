"""Hugging Face `Trainer` + compile_core: GPT-2 (a small config, no weights) on synthetic tokens, the Trainer's
own loop (AdamW, linear schedule, clipping, accumulation), DDP through torchrun.

    torchrun --nproc_per_node 2 examples/hf_trainer_train.py                # CPU: gloo ranks
    torchrun --nproc_per_node 2 examples/hf_trainer_train.py --no-compile   # the Trainer's DDP only

One line differs from a plain Trainer script: `compile_core.integrations.transformers.compile(trainer, ...)`
before `trainer.train()`; the Trainer's DDP model is then compiled in place when training begins. With
`--out DIR` each rank saves its parameters, rank 0 the compile report (JSON) and `trainer.save_model`'s
checkpoint. Needs the [transformers] extra: pip install -e ".[transformers]".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run as a script: the repo root holds compile_core
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import compile_core.integrations.transformers as ddp_compile  # noqa: E402
from compile_core import BACKENDS  # noqa: E402

VOCAB, SEQ_LEN = 128, 16


class Tokens(Dataset):
    """Seeded synthetic sequences; the Trainer's distributed sampler gives each rank different ones."""

    def __init__(self, n: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-compile", action="store_true", help="the Trainer's DDP model as it wraps it (the baseline)")
    p.add_argument("--backend", choices=BACKENDS, default="inductor")
    p.add_argument("--ddp-mode", choices=("split", "in_graph", "none", "torch"), default="split")
    p.add_argument("--bucket-cap-mb", type=int, default=1, help="DDP's bucket cap (the Trainer takes whole MB)")
    p.add_argument("--steps", type=int, default=4, help="optimizer updates")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per update")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per micro-batch")
    p.add_argument("--layers", type=int, default=3, help="GPT-2 blocks (3: about 2.4 MB of parameters, 3 buckets)")
    p.add_argument("--bf16", action="store_true", help="the Trainer's bf16 mixed precision (autocast)")
    p.add_argument("--out", type=Path, default=None, help="save parameters, report and checkpoint here")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("compile_core").setLevel(logging.INFO)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=128, n_layer=args.layers, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cpu = not torch.cuda.is_available()
    training_args = TrainingArguments(
        output_dir=str(args.out or Path("hf_trainer_out")),
        use_cpu=cpu,
        ddp_backend="gloo" if cpu else None,
        ddp_bucket_cap_mb=args.bucket_cap_mb,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=args.bf16,
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Tokens(args.steps * args.accum * args.batch * world)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    compiled = None
    if not args.no_compile:
        compiled = ddp_compile.compile(trainer, backend=args.backend, ddp=args.ddp_mode)
    trainer.train()

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rank = trainer.args.process_index
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        torch.save(params, args.out / f"params_rank{rank}.pt")
        if rank == 0:
            torch.save(initial, args.out / "params_initial.pt")
        trainer.save_model(str(args.out / "model"))  # rank 0 writes model.safetensors
        if trainer.is_world_process_zero() and compiled is not None:
            (args.out / "report.json").write_text(json.dumps(compiled.report().to_dict(), default=str))


if __name__ == "__main__":
    main()
