"""The shape of the code base: the library imports no Dagster, its imports form no cycle and sit at the top of
their modules, modules and functions stay short, and the project speaks of itself only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "xc_dagster"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# third-party imports that may stay inside a function: heavy, and needed only by the one function (tree fitting,
# plotting)
LAZY_THIRD_PARTY = {"sklearn", "matplotlib"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _library_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(LIBRARY.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module):
    """Import statements that run when the module is imported (module level, not under ``if TYPE_CHECKING``)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The library modules an import statement loads (a ``from pkg import name`` of a submodule loads it)."""
    out = set()
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    for name in names:
        if name.split(".")[0] == "xc_dagster" and name in modules:
            out.add(name)
    return out


def command_modules() -> set[str]:
    """The modules the CLI imports by name when one of their commands runs (``xc_dagster.cli.COMMAND_MODULES``)."""
    for node in ast.parse((LIBRARY / "cli.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMAND_MODULES" for t in node.targets):
            return set(ast.literal_eval(node.value).values())
    return set()


def import_graph() -> dict[str, set[str]]:
    """Each library module's imports of library modules; the CLI's by name (:func:`command_modules`) count too."""
    modules = _library_modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        graph[name] = set().union(*(_targets(n, modules) for n in _runtime_imports(tree))) - {name}
    graph["xc_dagster.cli"] |= command_modules()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_library_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "xc_dagster.pipeline.run" in graph
    assert graph["xc_dagster.encoders.loading"] >= {"xc_dagster.encoders.bag", "xc_dagster.encoders.transformer"}
    named = command_modules()
    assert "xc_dagster.commands.plan" in named and named <= set(graph)
    assert cycles(graph) == []


def _function_imports(path: Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    yield fn.name, node.lineno, [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    yield fn.name, node.lineno, [node.module or ""]


def test_imports_sit_at_the_top_of_the_library_modules():
    """No library module imports another, or the standard library, inside a function (which would hide a cycle
    or a cost); only the heavy third-party modules one function needs may wait for it."""
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for fn, line, names in _function_imports(path):
            found += [f"{path.relative_to(ROOT)}:{line} ({fn}): {name}" for name in names
                      if name.split(".")[0] not in LAZY_THIRD_PARTY]
    assert found == []


# the one Dagster package the library may import, in the one module that may: dagster_pipes, the dependency-free
# protocol package meant for external processes, in the training stages' entry point (its docstring says why)
PIPES_PACKAGE = "dagster_pipes"
PIPES_MODULE = "xc_dagster.training.launch"


def _dagster_package(name: str) -> str | None:
    """The Dagster distribution package a module name belongs to (dagster, dagster_pipes, dagster_k8s, ...)."""
    top = name.split(".")[0]
    return top if top == "dagster" or top.startswith("dagster_") else None


def test_importing_the_library_imports_no_dagster():
    """Only dagster_pipes, which imports no other Dagster package."""
    code = ("import importlib, pkgutil, sys, xc_dagster\n"
            "for m in pkgutil.walk_packages(xc_dagster.__path__, 'xc_dagster.'):\n"
            "    if m.name != 'xc_dagster.definitions':\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules if n.split('.')[0] == 'dagster' "
            "or n.startswith('dagster_')}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == repr([PIPES_PACKAGE])


def test_only_the_launch_module_imports_a_dagster_package():
    found: dict[str, set[str]] = {}
    for name, path in _library_modules().items():
        if name == "xc_dagster.definitions":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found.setdefault(name, set()).update(filter(None, map(_dagster_package, names)))
    assert {k: v for k, v in found.items() if v} == {PIPES_MODULE: {PIPES_PACKAGE}}


def _python_files():
    for folder in ("xc_dagster", "assets", "resources", "bench"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_modules_and_functions_stay_short():
    long_modules, long_functions = [], []
    for path in _python_files():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert long_modules == [] and long_functions == []


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    paths = []
    for rel in out.stdout.split():
        p = ROOT / rel
        if p.suffix in {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".json", ".jsonl", ""} and \
                "builtin_data" not in p.parts and p.is_file():
            paths.append(p)
    return paths


def test_the_project_speaks_of_itself_only():
    """Code, docs and results describe the project, not how it was worked on: history goes to git."""
    word = re.compile(r"\b" + "ses" + r"sions?\b", re.IGNORECASE)
    hits = []
    for p in _tracked_text_files():
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if word.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert hits == []
