"""Does plain `torch.compile` (Inductor, buffer reuse on or off) give eager's gradients for a GPT whose
blocks are nested compile regions called twice or more? A probe of torch itself, for a device other than
the CPU suite's: `python -m tests.single.regions_probe [cpu|cuda]`. It prints, per setting, the worst
gradient's distance from eager relative to that gradient's size.
"""

from __future__ import annotations

import sys

import torch


def worst_gradient_error(device: str, **options) -> tuple[str, float]:
    from examples.gpt import lm_loss
    from tests.single.test_aot_inductor import _region_gpt

    torch._dynamo.reset()
    regions, plain, (x, y) = _region_gpt(2)
    regions, plain, x, y = regions.to(device), plain.to(device), x.to(device), y.to(device)
    lm_loss(torch.compile(regions, options=options or None)(x), y).backward()
    lm_loss(plain(x), y).backward()
    errors = {
        name: ((p.grad - q.grad).norm() / q.grad.norm()).item()
        for (name, p), q in zip(regions.named_parameters(), plain.parameters())
    }
    worst = max(errors, key=errors.__getitem__)
    return worst, errors[worst]


def main(device: str) -> int:
    for options in ({}, {"allow_buffer_reuse": False}):
        name, err = worst_gradient_error(device, **options)
        print(f"{device} torch {torch.__version__} plain torch.compile {options or 'defaults'}: worst {name} {err:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
