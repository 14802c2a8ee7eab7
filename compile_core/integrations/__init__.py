"""Ways into `compile_core.compile` from the training frameworks people already use.

- `compile_core.integrations.lightning`: `DDPCompileStrategy` (Lightning Trainer) and
  `FabricDDPCompileStrategy` (Lightning Fabric); needs the `[lightning]` extra.
- `compile_core.integrations.accelerate`: `compile(accelerator, model, ...)` for a model prepared by
  Hugging Face accelerate; needs the `[accelerate]` extra.
- `compile_core.integrations.transformers`: `compile(trainer, ...)` for the model a Hugging Face `Trainer`
  trains (compiled in place when `trainer.train()` begins); needs the `[transformers]` extra.

This package imports neither framework: each submodule imports its own at its own import time and
says which extra to install when it is missing.
"""
