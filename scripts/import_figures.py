"""The package's import figures (issue 37): imports of its own modules at module level, inside
functions and under TYPE_CHECKING; the import cycles they make; who imports the features; the size
of jobs/generate.py. Usage: python scripts/import_figures.py [src/shardgen]"""

from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from pathlib import Path

FEATURES = ("features.steps", "features.openai_batch", "features.splits")


def module_names(root: Path) -> dict[str, Path]:
    """The package's modules by dotted name under ``shardgen`` (a package by its folder's name)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    names.pop("", None)
    return names


def own_imports(root: Path) -> tuple[dict[str, set[str]], Counter, list[tuple[str, str, int]]]:
    """Module -> the package's modules it imports; the count by place; the ones inside functions."""
    modules = module_names(root)
    edges: dict[str, set[str]] = defaultdict(set)
    places: Counter = Counter()
    in_functions: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, name: str, place: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = place
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                here = "function"
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                here = "TYPE_CHECKING"
            targets: list[str] = []
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "shardgen":
                base = child.module.removeprefix("shardgen").lstrip(".")
                for a in child.names:
                    inner = f"{base}.{a.name}".lstrip(".")
                    targets.append(inner if inner in modules else base)
            elif isinstance(child, ast.Import):
                targets = [a.name.removeprefix("shardgen.") for a in child.names if a.name.startswith("shardgen.")]
            for target in targets:
                if target in modules and target != name:
                    edges[name].add(target)
                    places[here] += 1
                    if here == "function":
                        in_functions.append((name, target, child.lineno))
            visit(child, name, here)

    for name, path in modules.items():
        visit(ast.parse(path.read_text()), name, "module level")
    return edges, places, in_functions


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def main(root: Path) -> None:
    edges, places, in_functions = own_imports(root)
    print("imports of the package's own modules:", dict(places))
    for component in cycles(edges):
        print(f"import cycle of {len(component)} modules: {', '.join(component)}")
    print(f"imports inside functions: {len(in_functions)}")
    print(f"config imports: {', '.join(sorted(edges['config']))}")
    for feature in FEATURES:
        users = sorted(
            m
            for m, targets in edges.items()
            if not m.startswith(feature) and any(t == feature or t.startswith(feature + ".") for t in targets)
        )
        print(f"{feature} is imported by {len(users)}: {', '.join(users)}")
    generate = root / "jobs" / "generate.py"
    tree = ast.parse(generate.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    longest = max(functions, key=lambda f: f.end_lineno - f.lineno)
    most = max(functions, key=lambda f: len(f.args.args) + len(f.args.kwonlyargs))
    print(f"generate.py: {len(generate.read_text().splitlines())} lines; longest function {longest.name} "
          f"({longest.end_lineno - longest.lineno + 1} lines); most parameters {most.name} "
          f"({len(most.args.args) + len(most.args.kwonlyargs)})")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "src" / "shardgen"))
