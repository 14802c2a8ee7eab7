"""`python -m compile_core.doctor`: what this machine's torch offers this project, and whether its canaries pass.

Prints the versions a bug report needs (Python, torch and its CUDA/NCCL builds, Triton), the devices, which
`ddp=` modes and features work with this torch and why not where they do not (each torch home answers for its
layer: `ddp/torch_ddp.py`, `aot/torch_dynamo.py`, `inductor/torch_inductor.py`), then runs the canaries of
`tests/single/test_torch_internals_*.py` when the tests are next to the package (a built-in short check
otherwise). Exits non-zero when a canary or the check fails. A CI job on a new runner calls it first.

    python -m compile_core.doctor            # everything (about 35 s of canaries on 2 CPU cores)
    python -m compile_core.doctor --quick    # canaries without the Inductor ones (about 20 s)
    python -m compile_core.doctor --no-canaries
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SUPPORTED = ("2.11", "2.12", "2.13", "2.14")
"""torch minor versions pyproject.toml allows (`torch>=2.11,<2.15`)."""
TESTED = ("2.11.0", "2.13.0", "2.14.1")
"""Versions CI runs (`.ci/run`): the full suite on 2.13.0, canaries and `pytest -m compat` on the others."""
CANARIES = sorted((Path(__file__).resolve().parents[1] / "tests" / "single").glob("test_torch_internals_*.py"))
"""The canary files, one per home or close group of homes (none when the tests are not next to the package)."""


def versions() -> list[tuple[str, str]]:
    """(what, version) for the report's first lines."""
    import torch

    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} (git {torch.version.git_version[:12]})"),
        ("torch range", _range_note(torch.__version__)),
        ("CUDA build", str(torch.version.cuda)),
    ]
    try:
        import triton

        rows.append(("triton", triton.__version__))
    except ImportError:
        rows.append(("triton", "not installed (Inductor compiles C++/OpenMP on the CPU; GPUs need it)"))
    nccl = "not built in"
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as err:  # noqa: BLE001 - a build without NCCL libraries answers with an error
            nccl = f"unavailable ({err})"
    rows.append(("NCCL", nccl))
    gloo = torch.distributed.is_available() and torch.distributed.is_gloo_available()
    rows.append(("gloo", "available" if gloo else "not available"))
    return rows


def _range_note(version: str) -> str:
    minor = ".".join(version.split("+")[0].split(".")[:2])
    base = version.split("+")[0]
    if minor not in SUPPORTED:
        return (
            f"OUTSIDE the supported range {SUPPORTED[0]}-{SUPPORTED[-1]}: expect the canaries below to say what broke"
        )
    if base in TESTED:
        return f"supported, tested by CI ({', '.join(TESTED)})"
    return f"supported range, but CI tests {', '.join(TESTED)}, not {base}"


def devices() -> list[str]:
    import torch

    found = [f"cpu: {os.cpu_count()} cores ({platform.machine()})"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            found.append(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
    else:
        found.append("cuda: none visible")
    return found


def capabilities() -> list[tuple[str, bool, str]]:
    """(feature, available, how) from every torch home, Dynamo's requires_grad probe included."""
    from aot import torch_dynamo
    from ddp import torch_ddp
    from inductor import torch_inductor

    table = {**torch_ddp.capabilities(), **torch_dynamo.capabilities(run_probes=True), **torch_inductor.capabilities()}
    return [(name, ok, how) for name, (ok, how) in table.items()]


def modes() -> list[tuple[str, str | None]]:
    """(mode or feature, None when it works here else why not), as `CompileConfig` validates them."""
    from compile_core.config import BACKENDS, DDP_MODES, torch_blocker

    rows: list[tuple[str, str | None]] = []
    for mode in DDP_MODES:
        why = {backend: torch_blocker(mode, backend) for backend in BACKENDS}
        if all(w is None for w in why.values()):
            rows.append((f"ddp={mode!r} (backends {', '.join(BACKENDS)})", None))
        else:
            rows += [(f"ddp={mode!r} backend={backend!r}", w) for backend, w in why.items()]
    rows.append(("nested_regions=True (ddp='in_graph')", torch_blocker("in_graph", "inductor", nested_regions=True)))
    rows.append(("train_step(..., optimizer_in_backward=True) (ddp='in_graph')", torch_blocker("in_graph", "inductor")))
    return rows


def run_canaries(paths: list[Path], *, quick: bool, select: str | None) -> tuple[bool, str]:
    """Run the canary files with pytest in one child process: (passed, its summary line)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, paths)]
    if quick:
        cmd += ["-m", "not inductor"]
    if select:
        cmd += ["-k", select]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, cwd=paths[0].parents[2], env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = lines[-1] if lines else (done.stderr.strip().splitlines() or ["no output"])[-1]
    return done.returncode == 0, "\n".join([*failed, summary])


def builtin_check() -> tuple[bool, str]:
    """Without the tests: a two-layer model through `compile_core.compile` (aot_eager), its loss and
    gradients against the same model run eagerly."""
    import copy

    import torch

    import compile_core

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    compiled = compile_core.compile(model, backend="aot_eager")
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6):
            return False, f"built-in check: {name}'s gradient differs from eager"
    return True, "built-in check passed (a compiled model's gradients equal eager's)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compile_core.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the canaries that run Inductor's codegen")
    parser.add_argument("--no-canaries", action="store_true", help="versions and capabilities only")
    parser.add_argument("-k", dest="select", help="run only the canaries matching this pytest -k expression")
    parser.add_argument("--canaries", type=Path, nargs="+", default=CANARIES, help=argparse.SUPPRESS)  # its own test
    args = parser.parse_args(argv)

    print("== versions")
    for what, value in versions():
        print(f"  {what:12} {value}")
    print("== devices")
    for line in devices():
        print(f"  {line}")
    print("== what this torch offers")
    for name, ok, how in capabilities():
        print(f"  [{'ok' if ok else 'NO'}] {name}: {how}")
    print("== modes and features")
    blocked = 0
    for what, why in modes():
        blocked += why is not None
        print(f"  [{'ok' if why is None else 'NO'}] {what}" + ("" if why is None else f": {why}"))
    healthy = True
    if not args.no_canaries:
        start = time.perf_counter()
        if args.canaries and all(path.is_file() for path in args.canaries):
            print(f"== canaries ({args.canaries[0].parent}: {', '.join(path.name for path in args.canaries)})")
            healthy, summary = run_canaries(args.canaries, quick=args.quick, select=args.select)
        else:
            print("== built-in check (the canaries are not installed with the package)")
            healthy, summary = builtin_check()
        for line in summary.splitlines():
            print(f"  {line}")
        print(f"  ({time.perf_counter() - start:.1f} s)")
    verdict = "OK" if healthy and not blocked else ("CANARIES FAILED" if not healthy else "SOME MODES BLOCKED")
    print(f"== {verdict}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
