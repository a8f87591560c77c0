"""The package's layout, read from the source (AST only, nothing imported): no import cycle among the
modules of hisparse/ and kernels_triton/, and neither imports the experiments or the benchmarks."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hisparse", "kernels_triton")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name the file imports, top-level and inside functions alike; `from m import x`
    gives m.x as well as m (x may be a submodule), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports by name (the parents Python imports on the way are
    not edges: a package's __init__ importing its own submodules is not a cycle)."""
    modules = module_files()
    return {name: {target for target in imported_names(name, path) if target in modules and target != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "black"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_import_graph_sees_both_kinds_of_import():
    graph = import_graph()
    assert "hisparse.dsa.ops" in graph["hisparse.dsa.fp8"]                 # top-level from-import
    assert "hisparse.traces" in graph["hisparse.synthetic"]                # an import inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles_in_hisparse():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_hisparse_imports_nothing_from_experiments_or_benchmarks():
    offenders = []
    for name, path in module_files().items():
        targets = {t for t in imported_names(name, path) if t.split(".")[0] in ("experiments", "benchmarks")}
        offenders += sorted(f"{name} imports {t}" for t in targets if t.rpartition(".")[0] not in targets)
    assert not offenders, "; ".join(offenders)
