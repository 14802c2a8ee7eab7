"""House rules that are checked by reading the library's source (docs/design.md, "House rules").

Nothing here imports the library or torch: each test parses the library's .py files with `ast`, so
comments and docstrings never count, only code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compile_core", "ddp", "aot", "inductor", "launch")
HOMES = frozenset(
    {
        "ddp/torch_ddp.py",
        "ddp/torch_ddp_reducer.py",
        "aot/torch_dynamo.py",
        "aot/torch_aot.py",
        "aot/torch_graphs.py",
        "aot/torch_eager.py",
        "aot/torch_dynamo_cache.py",
        "inductor/torch_inductor.py",
    }
)
"""The only modules that may touch private torch names (each function there has a canary in its home's
tests/single/test_torch_internals_*.py)."""

NOT_TORCH = {
    "_compiler_ctx": "Lightning's LightningModule (compile_core/integrations/lightning.py; canary in "
    "tests/single/test_integrations.py)",
}
"""Private names of other libraries that the library reads on purpose, each with where it is checked."""

_PRIVATE_TORCH_MODULE = re.compile(r"^torch(\.\w+)*\._\w+(\.\w+)*$")
"""A string that is exactly the dotted name of a private torch module (`"torch._ops"`): an import or a
logger name in code. Human text mentioning one (a message, a docstring) has spaces or punctuation."""


def _library_files() -> dict[str, ast.Module]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            files[rel] = ast.parse(path.read_text(), filename=rel)
    return files


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the Constant nodes that are docstrings (of the module, classes, functions, attributes)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                value = stmt.value if isinstance(stmt, ast.Expr) else None
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.add(id(value))
    return found


def _own_private_names(files: dict[str, ast.Module]) -> set[str]:
    """Private names the library defines itself: functions, classes, module and class attributes, and
    attributes it sets on `self`/`cls`. A private attribute read that is none of these is someone else's."""
    names: set[str] = set()
    for tree in files.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return {n for n in names if _is_private(n)}


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Names bound to torch or one of its modules in this file (`torch`, `dist`, `fx`, ...)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    aliases.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            aliases.update(alias.asname or alias.name for alias in node.names)
    return aliases


def private_torch_uses(files: dict[str, ast.Module]) -> list[str]:
    """`file:line: what` for every use of a private torch name outside the homes."""
    own = _own_private_names(files) | set(NOT_TORCH)
    found = []
    for rel, tree in files.items():
        if rel in HOMES:
            continue
        torch_names = _torch_aliases(tree)
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Import):
                what = next(
                    (f"import {a.name}" for a in node.names if a.name.split(".")[0] == "torch" and "._" in a.name), None
                )
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                if "._" in node.module or node.module.startswith("_"):
                    what = f"from {node.module} import ..."
                else:
                    what = next(
                        (f"from {node.module} import {a.name}" for a in node.names if _is_private(a.name)), None
                    )
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                if _root_name(node.value) in torch_names or node.attr not in own:
                    what = f".{node.attr}"
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)
                and node.args[1].value not in own
            ):
                what = f"{node.func.id}(..., {node.args[1].value!r})"
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and _PRIVATE_TORCH_MODULE.match(node.value)
            ):
                what = repr(node.value)
            if what is not None:
                found.append((rel, node.lineno, what))
    return [f"{rel}:{line}: {what}" for rel, line, what in sorted(set(found))]


def test_private_torch_names_live_in_homes():
    offenders = private_torch_uses(_library_files())
    assert not offenders, (
        "private torch names used outside the homes (move each into a function of "
        f"{sorted(HOMES)} with a canary in tests/single/test_torch_internals_*.py):\n  " + "\n  ".join(offenders)
    )


def test_the_private_name_scan_sees_what_it_is_for():
    """The scan itself: each kind of private use is found, docstrings and messages are not."""
    source = '''
"""Docstring naming torch._dynamo is fine."""
import torch
import torch.utils._pytree as pytree
from torch._dynamo import exc
from torch.distributed import _functional_collectives
op = torch.ops._c10d_functional.all_reduce
def f(module, fn):
    """torch._ops in a docstring."""
    module._compiled_call_impl = fn
    if type(fn).__module__ == "torch._ops":
        raise ValueError("see torch._inductor.list_options() for the names")
    return getattr(module, "_call_impl")
'''
    found = private_torch_uses({"ddp/example.py": ast.parse(source)})
    assert [line.split(": ", 1)[1] for line in found] == [
        "import torch.utils._pytree",
        "from torch._dynamo import ...",
        "from torch.distributed import _functional_collectives",
        "._c10d_functional",
        "._compiled_call_impl",
        "'torch._ops'",
        "getattr(..., '_call_impl')",
    ], found


# -- imports go one way ---------------------------------------------------------------------------------


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(files: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Library module -> library modules it imports (anywhere in the file, function bodies included).

    `from package import name` counts as importing `package.name` when that is a module, else `package`.
    """
    modules = {_module_name(rel): rel for rel in files}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, rel in modules.items():
        package = name if rel.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(files[rel]):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module: its package
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _is_package_reexport(importer: str, imported: str) -> bool:
    """A package's `__init__` importing its own submodules (to re-export them) is not a circle."""
    return imported.startswith(importer + ".")


def test_no_import_cycles_between_library_modules():
    graph = import_graph(_library_files())
    graph = {m: {t for t in targets if not _is_package_reexport(m, t)} for m, targets in graph.items()}
    cycles = import_cycles(graph)
    assert not cycles, "library modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_finds_a_circle():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_the_library_never_imports_the_launcher():
    """`launch` stands beside the compile stack: the library reports progress through compile_core/progress.py,
    which a launcher subscribes to by name, and never imports `launch` itself."""
    graph = import_graph(_library_files())
    wrong = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if not m.startswith("launch")
        for t in targets
        if t == "launch" or t.startswith("launch.")
    )
    assert not wrong, "; ".join(wrong)


def test_the_launcher_import_check_sees_an_import():
    files = {"compile_core/x.py": ast.parse("from launch.heartbeat import beat"), "launch/heartbeat.py": ast.parse("")}
    graph = import_graph(files)
    assert graph["compile_core.x"] == {"launch.heartbeat"}


def downward_violations(graph: dict[str, set[str]], lower: str, upper: str) -> list[str]:
    """`module imports target` for every module of package `lower` that imports package `upper`."""

    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted(
        f"{m} imports {t}" for m, targets in graph.items() if inside(m, lower) for t in targets if inside(t, upper)
    )


def test_ddp_never_imports_compile_core():
    """Arrows go down: `ddp` (floor 3) stands under `compile_core` (floor 4). What compile_core adds to the
    in-graph reduction (the optimizer update inside the backward) reaches it through ddp/in_graph/hooks.py."""
    wrong = downward_violations(import_graph(_library_files()), "ddp", "compile_core")
    assert not wrong, "; ".join(wrong)


def test_the_downward_check_sees_an_upward_import():
    files = {
        "ddp/in_graph/x.py": ast.parse("def f():\n    from compile_core.step import optim_math"),
        "compile_core/__init__.py": ast.parse(""),
        "compile_core/step/__init__.py": ast.parse(""),
        "compile_core/step/optim_math.py": ast.parse(""),
        "ddp/y.py": ast.parse("import torch"),
    }
    assert downward_violations(import_graph(files), "ddp", "compile_core") == [
        "ddp.in_graph.x imports compile_core.step.optim_math"
    ]
