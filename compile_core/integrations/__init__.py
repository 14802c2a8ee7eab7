"""Ways into `compile_core.compile` from the training frameworks people already use.

- `compile_core.integrations.lightning`: `DDPCompileStrategy` (Lightning Trainer) and
  `FabricDDPCompileStrategy` (Lightning Fabric); needs the `[lightning]` extra.
- `compile_core.integrations.accelerate`: `compile(accelerator, model, ...)` for a model prepared by
  Hugging Face accelerate; needs the `[accelerate]` extra.

This package imports neither framework: each submodule imports its own at its own import time and
says which extra to install when it is missing.
"""
