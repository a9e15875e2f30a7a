"""No import cycles among the modules of plugrt and plugrt_cpu.

Every import counts: at module level, under ``TYPE_CHECKING`` and inside functions (a
deferred import hides a cycle from the interpreter, not from a reader).
"""

from __future__ import annotations

import ast
import pathlib

import plugrt
import plugrt_cpu

PACKAGES = {"plugrt": pathlib.Path(plugrt.__file__).parent, "plugrt_cpu": pathlib.Path(plugrt_cpu.__file__).parent}


def _module_name(package: str, root: pathlib.Path, path: pathlib.Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # "from . import x" names a module; "from .m import f" names the module m
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and name not in ("plugrt", "plugrt_cpu"):
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            files[_module_name(package, root, path)] = path
    known = set(files)
    return {module: _imports(module, path, known) for module, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_checker_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_graph_covers_the_core_modules():
    graph = import_graph()
    assert {"plugrt.session", "plugrt.capture", "plugrt.provider", "plugrt_cpu._provider"} <= set(graph)
    assert "plugrt.provider" in graph["plugrt.build"]


def test_no_import_cycle_in_the_core_or_the_cpu_provider():
    assert find_cycles(import_graph()) == []
