"""One-process checks of compile_core.integrations: the core stays framework-free, a missing extra is
named, options are validated, and canaries for the few framework internals the integrations lean on.

The reductions themselves are proved on 2 ranks: tests/multi_gpu/test_lightning_multirank.py and
tests/multi_gpu/test_accelerate_multirank.py, tests/multi_gpu/test_hf_trainer_multirank.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.multi_gpu.script_jobs import REPO

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers")


def test_the_core_imports_no_framework():
    code = textwrap.dedent(f"""
        import sys
        import compile_core, compile_core.integrations, compile_core.integrations.common
        print(sorted(m for m in sys.modules if m.split(".")[0] in {FRAMEWORKS!r}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing compile_core imported {out.stdout.strip()}"


@pytest.mark.parametrize("extra", ["lightning", "accelerate", "transformers"])
def test_a_missing_extra_is_named_in_the_import_error(monkeypatch, extra):
    monkeypatch.setitem(sys.modules, extra, None)  # what Python does for a package that is not installed
    monkeypatch.delitem(sys.modules, f"compile_core.integrations.{extra}", raising=False)
    with pytest.raises(ImportError, match=rf'pip install -e "\.\[{extra}\]"'):
        importlib.import_module(f"compile_core.integrations.{extra}")


# ---- Lightning ------------------------------------------------------------------------------------

lightning_ok = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason='needs the [lightning] extra: pip install -e ".[lightning]"'
)


def _lit_gpt():
    from examples.lightning_train import LitGPT

    torch.manual_seed(0)
    return LitGPT()


@lightning_ok
@pytest.mark.parametrize("strategy_name", ["DDPCompileStrategy", "FabricDDPCompileStrategy"])
def test_lightning_compile_options_are_validated(strategy_name):
    from compile_core import CompileConfig
    from compile_core.integrations import lightning as integration

    cls = getattr(integration, strategy_name)
    with pytest.raises(ValueError, match="'bogus'"):
        cls(compile_config={"ddp": "bogus"})
    with pytest.raises(TypeError, match="'bakend'"):
        cls(compile_config={"bakend": "eager"})
    with pytest.raises(TypeError, match="CompileConfig"):
        cls(compile_config="eager")
    config = CompileConfig(backend="eager", ddp="in_graph")
    assert cls(compile_config=config).compile_config is config
    assert cls(compile_config={"backend": "aot_eager"}).compile_config.backend == "aot_eager"


@lightning_ok
def test_training_step_module_keeps_names_tensors_and_mode():
    from compile_core.integrations.lightning import TrainingStepModule

    lit = _lit_gpt()
    lit.register_buffer("seen", torch.zeros(1))
    lit.register_buffer("scratch", torch.zeros(1), persistent=False)
    step = TrainingStepModule(lit)
    assert [(n, id(p)) for n, p in step.named_parameters()] == [(n, id(p)) for n, p in lit.named_parameters()]
    assert list(step.state_dict()) == list(lit.state_dict())
    assert {n for n, _ in step.named_buffers()} == {"seen", "scratch"}
    step.eval()  # what Lightning's loops do through trainer.model
    assert not lit.training and not lit.model.training
    step.train()
    assert lit.training and lit.model.training


@lightning_ok
def test_canary_lightning_configure_ddp_goes_through_setup_model(pg):
    """DDPCompileStrategy overrides Lightning's private `DDPStrategy._setup_model`; this fails first
    when Lightning stops routing `configure_ddp` through it."""
    from torch.nn.parallel import DistributedDataParallel

    from compile_core.integrations.lightning import (
        DDPCompileStrategy,
        TrainingStepModule,
    )

    lit = _lit_gpt()
    strategy = DDPCompileStrategy(parallel_devices=[torch.device("cpu")], compile_config={"backend": "eager"})
    strategy.connect(lit)
    with pytest.raises(RuntimeError, match="no model compiled yet"):
        strategy.compile_report()
    strategy.configure_ddp()
    assert isinstance(strategy.model, DistributedDataParallel)
    assert isinstance(strategy.model.module, TrainingStepModule)
    assert strategy.model.module.lightning_module is lit
    assert strategy.compiled_model is strategy.model  # compiled in place: one handle
    assert strategy.compile_report().mode == "split"


@lightning_ok
def test_canary_lightning_marks_torch_compiled_modules(pg):
    """`trainer.fit(torch.compile(model))` unwraps the model and marks it (Lightning's private
    `_compiler_ctx`): the strategy refuses it rather than compiling twice; a module with manual
    optimization is refused too."""
    from lightning.pytorch.utilities.compile import from_compiled

    from compile_core.integrations.lightning import DDPCompileStrategy

    compiled = from_compiled(torch.compile(_lit_gpt()))
    manual = _lit_gpt()
    manual.automatic_optimization = False
    for module, message in ((compiled, "torch.compile"), (manual, "manual optimization")):
        strategy = DDPCompileStrategy(parallel_devices=[torch.device("cpu")], compile_config={"backend": "eager"})
        strategy.connect(module)
        with pytest.raises(ValueError, match=message):
            strategy.configure_ddp()
        assert strategy.compiled_model is None


# ---- accelerate -----------------------------------------------------------------------------------

accelerate_ok = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason='needs the [accelerate] extra: pip install -e ".[accelerate]"',
)


@accelerate_ok
def test_accelerate_compile_checks_what_it_is_given(monkeypatch):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    import compile_core.integrations.accelerate as integration

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        integration.compile(object(), model)
    accelerator = Accelerator(cpu=True)  # one process: prepare() leaves the model unwrapped
    with pytest.raises(TypeError, match="'bakend'"):
        integration.compile(accelerator, model, bakend="eager")
    with pytest.raises(ValueError, match="torch.compile"):
        integration.compile(accelerator, torch.compile(model))
    # Several processes: anything but the DDP model prepare() returns is refused.
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.MULTI_CPU))
    with pytest.raises(ValueError, match="accelerator.prepare"):
        integration.compile(accelerator, model)


@accelerate_ok
@pytest.mark.compat  # torch 2.11 compiled no graph of this one-process (unwrapped) model before session 55
def test_accelerate_compile_compiles_the_prepared_model_in_place():
    from accelerate import Accelerator

    import compile_core.integrations.accelerate as integration

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    expected = model(x)
    compiled = integration.compile(accelerator, model, backend="eager")
    out = model(x)  # the prepared model itself, not the returned handle
    torch.testing.assert_close(out, expected)
    assert len(compiled.report().graphs) == 1
    assert list(accelerator.unwrap_model(model).state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


@accelerate_ok
def test_accelerate_compile_refuses_an_accelerator_that_compiles_itself():
    # A fresh process: accelerate keeps its state (dynamo settings included) once per process.
    code = textwrap.dedent("""
        import torch
        from accelerate import Accelerator
        import compile_core.integrations.accelerate as integration
        accelerator = Accelerator(cpu=True, dynamo_backend="inductor")
        try:
            integration.compile(accelerator, torch.nn.Linear(2, 2))
        except ValueError as err:
            print("refused:", err)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "dynamo_backend='INDUCTOR'" in out.stdout, out.stdout


# ---- Hugging Face Trainer -------------------------------------------------------------------------

transformers_ok = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason='needs the [transformers] extra (transformers and accelerate): pip install -e ".[transformers]"',
)


def _tiny_trainer(tmp_path, **overrides):
    """A one-process Trainer of a 1-block GPT-2 on 8 seeded sequences (same weights on every call)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    tokens = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = dict(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
        report_to=[], save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return Trainer(model=model, args=TrainingArguments(**{**args, **overrides}), train_dataset=data)


@transformers_ok
def test_transformers_compile_checks_what_it_is_given(tmp_path):
    import compile_core.integrations.transformers as integration

    with pytest.raises(TypeError, match="transformers.Trainer"):
        integration.compile(object())
    trainer = _tiny_trainer(tmp_path)
    with pytest.raises(TypeError, match="'bakend'"):
        integration.compile(trainer, bakend="eager")
    trainer.args.torch_compile = True  # as TrainingArguments(torch_compile=True) sets it
    with pytest.raises(ValueError, match="torch_compile=False"):
        integration.compile(trainer)
    trainer.args.torch_compile = False
    callback = integration.compile(trainer, backend="eager")
    with pytest.raises(RuntimeError, match="trainer.train"):
        callback.report()
    with pytest.raises(ValueError, match="once per Trainer"):
        integration.compile(trainer)


@transformers_ok
def test_transformers_trainer_runs_its_model_compiled(tmp_path):
    import compile_core
    import compile_core.integrations.transformers as integration

    plain = _tiny_trainer(tmp_path / "plain")
    plain.train()
    trainer = _tiny_trainer(tmp_path / "ours")
    callback = integration.compile(trainer, backend="eager")
    trainer.train()
    assert callback.model is trainer.model_wrapped and isinstance(trainer.model, compile_core.CompiledModel)
    assert len(callback.report().graphs) >= 1
    for (name, p), q in zip(trainer.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    compiled_before = callback.report().compile_seconds
    trainer.train()  # a second train(): the Trainer keeps its model, and so do we
    assert callback.model is trainer.model_wrapped
    assert callback.report().compile_seconds == compiled_before
